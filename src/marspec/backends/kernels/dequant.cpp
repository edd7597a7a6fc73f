// gguf_dequantize: a GGUF tensor's quantised rows to float32, the bits gguf-py's numpy dequantizers give
// (dequant_core.h), 7-14x faster on two cores: converting a model (its float32 checkpoint, the int8
// engine's rows, the 4-bit draft) spent most of its first load there.
//
// data uint8 [..., B] (each row B bytes of whole blocks), type a ggml type number block_format takes;
// out float32 [..., B / bytes * weights]. Rows are split among threads; each row is computed alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "dequant_core.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using marspec_kernels::block_format;
using marspec_kernels::BlockFormat;
using marspec_kernels::check_cpu;

at::Tensor dequantize(const at::Tensor& data, int64_t type) {
  check_cpu(data, "data");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() >= 1, "data must be uint8 [..., bytes]");
  const BlockFormat format = block_format(static_cast<int>(type));
  TORCH_CHECK(format.bytes > 0, "ggml type ", type, " is not one gguf_dequantize takes");
  const at::Tensor rows = data.contiguous();
  const int64_t row_bytes = rows.size(-1);
  TORCH_CHECK(row_bytes % format.bytes == 0, "a row of ", row_bytes, " bytes is not whole blocks of ", format.bytes);
  const int64_t blocks = row_bytes / format.bytes, width = blocks * format.weights;
  const int64_t count = row_bytes == 0 ? 0 : rows.numel() / row_bytes;
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, rows.options().dtype(at::kFloat));
  const uint8_t* in_p = rows.data_ptr<uint8_t>();
  float* out_p = out.data_ptr<float>();
  // Grains of ~64k weights: a 896-wide row is ~2 us of work, too little to hand to a thread alone.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(width, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      marspec_kernels::dequantize_row(static_cast<int>(type), in_p + r * row_bytes, blocks, out_p + r * width);
    }
  });
  return out;
}

}  // namespace

MARSPEC_LIBRARY(m) { m.def("gguf_dequantize(Tensor data, int type) -> Tensor", &dequantize); }
