// vocab_argmax and vocab_top2: the largest (and second-largest) float32 logit of each row and its token,
// in one vectorised pass over the row (vocab_core.h), found exactly as torch finds them.
//
// torch's CPU argmax over a vocabulary row (150k logits) runs at ~2 G values/s; the verification of each
// decode step takes the top two of every row (verify.margins.top2: an argmax, a copy with the winner
// masked, a second argmax) and a draft model's step an argmax. Rows where torch's answer depends on more
// than values (a NaN, which torch's argmax takes as the maximum, or a second value of -inf, where top2's
// masked copy ties with the masked winner) are computed by torch's own operators, so every row gets
// torch's answer.
//
// Rows run one after another on the calling thread, with no at::parallel_for: a row's pass over the
// vocabulary is short (a 13-row verification's ~0.3 ms), shorter than waking a thread team.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "vocab_core.h"

#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using marspec_kernels::kNegInf;
using marspec_kernels::row_top;
using marspec_kernels::RowTop;

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
