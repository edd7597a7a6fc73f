// vocab_argmax and vocab_top2: the largest (and second-largest) float32 logit of each
// row and its token, in one vectorised pass over the row, found exactly as torch finds them.
//
// torch's CPU argmax over a vocabulary row (150k logits) runs at ~2 G values/s; the verification of each
// decode step takes the top two of every row (verify.margins.top2: an argmax, a copy with the winner
// masked, a second argmax) and a draft model's step an argmax, so on 2 cores these cost ~1 ms of a
// step. Here each of 16 lanes keeps the best and second-best value it has seen and their indices,
// replaced only by a strictly larger value (so the earliest of equal values stays), then the lanes'
// 32 candidates are ranked by (value, lower index first): the row's first maximum, and the first
// maximum of the rest, which is what torch's argmax returns and what top2 computes. Rows where torch's
// answer depends on more than values (a NaN, which torch's argmax takes as the maximum, or a second
// value of -inf, where top2's masked copy ties with the masked winner) are computed by torch's own
// operators, so every row gets torch's answer.
//
// Rows run one after another on the calling thread, with no at::parallel_for: a row's pass over the
// vocabulary is short (a 13-row verification costs ~0.3 ms here, on one thread), shorter than waking a
// thread team.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"

#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row's best two: values and indices (index -1: none seen), and whether it holds a NaN.
struct RowTop {
  float v1 = kNegInf;
  int64_t i1 = -1;
  float v2 = kNegInf;
  int64_t i2 = -1;
  bool nan = false;
};

// a ranks before b: larger, or equal and earlier (an index of -1 ranks after everything).
inline bool ranks_before(float va, int64_t ia, float vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

// Each lane's best (and, with kSecond, second-best) values and indices over x[0, n), then the row's.
// Plain C++ over 16 lanes (the compiler vectorises it for the path's instruction set): comparisons only,
// so every path finds the same answer.
template <bool kSecond>
RowTop row_top(const float* x, int64_t n) {
  float v1[kLanes], v2[kLanes];
  int32_t i1[kLanes], i2[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    v1[l] = v2[l] = kNegInf;
    i1[l] = i2[l] = -1;
  }
  bool nan = false;
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t live = n - j < kLanes ? n - j : kLanes;
    for (int l = 0; l < kLanes; ++l) {
      const float v = l < live ? x[j + l] : kNegInf;  // past the end: -inf, never larger
      const auto idx = static_cast<int32_t>(j + l);
      nan |= v != v;
      const bool above1 = v > v1[l];
      if constexpr (kSecond) {
        // A new best moves the old best to second place; else a value above the second takes it.
        const bool above2 = v > v2[l];
        v2[l] = above1 ? v1[l] : (above2 ? v : v2[l]);
        i2[l] = above1 ? i1[l] : (above2 ? idx : i2[l]);
      }
      v1[l] = above1 ? v : v1[l];
      i1[l] = above1 ? idx : i1[l];
    }
  }
  RowTop top;
  top.nan = nan;
  // The row's best is the best lane's; its second is another lane's best or the best lane's second.
  for (int l = 0; l < kLanes; ++l) {
    if (ranks_before(v1[l], i1[l], top.v1, top.i1)) {
      top.v1 = v1[l];
      top.i1 = i1[l];
    }
  }
  if constexpr (kSecond) {
    for (int l = 0; l < kLanes; ++l) {
      const bool best_lane = i1[l] == top.i1;
      const float v = best_lane ? v2[l] : v1[l];
      const int64_t i = best_lane ? i2[l] : i1[l];
      if (ranks_before(v, i, top.v2, top.i2)) {
        top.v2 = v;
        top.i2 = i;
      }
    }
  }
  return top;
}

at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "logits must be float32 on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < std::numeric_limits<int32_t>::max(),
              "logits must be [..., V] with 0 < V < 2^31");
  return x.contiguous().view({-1, x.size(-1)});
}

// The largest logit's token of each row (the first of equal ones): long [...], the rows' shape.
at::Tensor argmax(const at::Tensor& x) {
  const at::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), n = rows.size(1);
  at::Tensor out = at::empty({m}, rows.options().dtype(at::kLong));
  const float* xp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const RowTop top = row_top<false>(xp + r * n, n);
    op[r] = top.nan || top.i1 < 0 ? -1 : top.i1;
  }
  for (int64_t r = 0; r < m; ++r) {
    if (op[r] < 0) op[r] = rows[r].argmax().item<int64_t>();  // a NaN or an all -inf row: torch's own
  }
  return out.view(x.sizes().slice(0, x.dim() - 1));
}

// The two largest logits of each row and their tokens ([..., 2] each), as verify.margins.top2 defines
// them: the argmax, then the argmax with the first masked to -inf.
std::tuple<at::Tensor, at::Tensor> top2(const at::Tensor& x) {
  const at::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), n = rows.size(1);
  at::Tensor values = at::empty({m, 2}, rows.options());
  at::Tensor tokens = at::empty({m, 2}, rows.options().dtype(at::kLong));
  const float* xp = rows.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const RowTop top = row_top<true>(xp + r * n, n);
    const bool plain = !top.nan && top.i2 >= 0 && top.v2 != kNegInf;
    vp[2 * r] = top.v1;
    vp[2 * r + 1] = top.v2;
    tp[2 * r] = plain ? top.i1 : -1;
    tp[2 * r + 1] = top.i2;
  }
  for (int64_t r = 0; r < m; ++r) {
    if (tp[2 * r] >= 0) continue;
    // torch's own: the argmax, then the argmax of a copy with it masked (NaN and -inf ties as torch has them)
    const at::Tensor row = rows[r];
    const int64_t first = row.argmax().item<int64_t>();
    at::Tensor masked = row.clone();
    masked[first].fill_(kNegInf);
    const int64_t second = masked.argmax().item<int64_t>();
    tp[2 * r] = first;
    tp[2 * r + 1] = second;
    vp[2 * r] = row[first].item<float>();
    vp[2 * r + 1] = row[second].item<float>();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = 2;
  return {values.view(shape), tokens.view(shape)};
}

}  // namespace

MARSPEC_LIBRARY(m) {
  m.def("vocab_argmax(Tensor logits) -> Tensor", &argmax);
  m.def("vocab_top2(Tensor logits) -> (Tensor, Tensor)", &top2);
}
