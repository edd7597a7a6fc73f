// A Llama-family decoder layer's work around its attention (Llama, Mistral, Qwen2: RMSNorm, q/k/v with
// an optional bias, rotary embedding, SiLU-gated MLP), in two operators: layer_pre (the input norm, q, k
// and v, the rotation) and layer_post (the output projection, the residuals, the MLP). The attention
// between them stays with the caller, who holds the cache.
//
// They run the same ATen operators, in the same order and on the same shapes, as
// marspec/backends/direct.py's Python (which follows transformers' formulas), and call the linear
// kernels (linears.h) as its layers' forward does, so their outputs are the same bits; what goes is the
// Python around ~160 operator calls a layer, a fifth of a one-token step on the q4k engine.
//
// A linear layer is given as (kind, weight, out_features, pad, bias): kind 0 a float weight [N, K]
// (torch.nn.Linear's F.linear), 1 Q4_K blocks, 2 Q6_K blocks (the kernels' packed layouts); pad the
// zeros a Q4_K layer's rows are widened by (backends/q4k.py's Q4KLinear).

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/record_function.h>

#include "linears.h"
#include "ops.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

enum Kind : int64_t { kDense = 0, kQ4K = 1, kQ6K = 2 };

struct Linears {
  const c10::List<std::optional<at::Tensor>>& biases;
  at::TensorList weights;
  at::IntArrayRef kinds, outs, pads;

  void check(size_t count, const char* which) const {
    TORCH_CHECK(weights.size() == count && kinds.size() == count && outs.size() == count && pads.size() == count &&
                    biases.size() == count,
                which, " takes ", count, " linear layers: weights, kinds, out_features, pads and biases each");
  }

  // Layer i of x [1, T, K]: [1, T, N], as the layer's module computes it.
  at::Tensor operator()(size_t i, const at::Tensor& x) const {
    const std::optional<at::Tensor> bias = biases.get(i);
    if (kinds[i] == kDense) return at::linear(x, weights[i], bias);
    TORCH_CHECK(kinds[i] == kQ4K || kinds[i] == kQ6K, "a linear layer's kind is 0, 1 or 2, not ", kinds[i]);
    at::Tensor rows = x.reshape({-1, x.size(-1)});
    if (pads[i] > 0) rows = at::constant_pad_nd(rows, {0, pads[i]}, 0);
    at::Tensor y;
    if (kinds[i] == kQ4K) {
      RECORD_FUNCTION("q4k_linear", std::vector<c10::IValue>());  // a profiler sees the kernel, as when called alone
      y = marspec_kernels::q4k_linear(rows, weights[i], outs[i], bias);
    } else {
      RECORD_FUNCTION("q6k_linear", std::vector<c10::IValue>());
      y = marspec_kernels::q6k_linear(rows, weights[i], outs[i], bias);
    }
    return y.reshape({x.size(0), x.size(1), outs[i]});
  }
};

// transformers' Llama RMSNorm in float32: weight * (x * rsqrt(mean(x^2) + eps)).
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const at::Tensor variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (hidden * at::rsqrt(variance + eps));
}

// transformers' rotary embedding of x [1, heads, T, D]: x * cos + rotate_half(x) * sin.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor swapped = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (swapped * sin);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_pre(const at::Tensor& hidden, const at::Tensor& norm_weight,
                                                         double eps, at::TensorList weights, at::IntArrayRef kinds,
                                                         at::IntArrayRef outs, at::IntArrayRef pads,
                                                         const c10::List<std::optional<at::Tensor>>& biases,
                                                         const at::Tensor& cos, const at::Tensor& sin,
                                                         int64_t head_dim) {
  const Linears linears{biases, weights, kinds, outs, pads};
  linears.check(3, "layer_pre");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.scalar_type() == at::kFloat,
              "hidden must be float32 [1, T, H]");
  TORCH_CHECK(head_dim > 0, "head_dim must be positive");
  const at::Tensor x = rms_norm(hidden, norm_weight, eps);
  const int64_t rows = hidden.size(1);
  at::Tensor heads[3];
  for (size_t i = 0; i < 3; ++i) heads[i] = linears(i, x).view({1, rows, -1, head_dim}).transpose(1, 2);
  return {rotate(heads[0], cos, sin), rotate(heads[1], cos, sin), heads[2]};
}

at::Tensor layer_post(const at::Tensor& hidden, const at::Tensor& attended, const at::Tensor& norm_weight, double eps,
                      at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef outs, at::IntArrayRef pads,
                      const c10::List<std::optional<at::Tensor>>& biases) {
  const Linears linears{biases, weights, kinds, outs, pads};
  linears.check(4, "layer_post");  // o, gate, up, down
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.scalar_type() == at::kFloat,
              "hidden must be float32 [1, T, H]");
  const int64_t rows = hidden.size(1);
  at::Tensor out = linears(0, attended.reshape({1, rows, -1}).contiguous());
  const at::Tensor mid = hidden + out;
  const at::Tensor x = rms_norm(mid, norm_weight, eps);
  out = linears(3, at::silu(linears(1, x)) * linears(2, x));
  return mid + out;
}

}  // namespace

MARSPEC_LIBRARY(m) {
  m.def(
      "layer_pre(Tensor hidden, Tensor norm_weight, float eps, Tensor[] weights, int[] kinds, int[] outs, "
      "int[] pads, Tensor?[] biases, Tensor cos, Tensor sin, int head_dim) -> (Tensor, Tensor, Tensor)",
      &layer_pre);
  m.def(
      "layer_post(Tensor hidden, Tensor attended, Tensor norm_weight, float eps, Tensor[] weights, int[] kinds, "
      "int[] outs, int[] pads, Tensor?[] biases) -> Tensor",
      &layer_post);
}
