// gguf_pack_tiles: a GGUF Q4_K or Q6_K tensor's rows as the kernels' records (pack_core.h), the bytes
// marspec/backends/q4k.py and q6k.py's numpy packing gives, ~5x faster: the 1.5B target's 198 Q4_K and
// Q6_K tensors 1.9 s against numpy's 10.3 (two threads, AMD EPYC Zen 4), a part of its first load.
//
// raw uint8 [N, S * block bytes] (the GGUF's rows, whole blocks), type 12 (Q4_K) or 14 (Q6_K); out
// uint8 [ceil(N / 32), S, record bytes], the last tile's rows past N zero blocks. Records are split
// among threads; each is written by one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "pack_core.h"

#include <algorithm>
#include <cstdint>

namespace {

using marspec_kernels::check_cpu;

at::Tensor pack_tiles(const at::Tensor& raw, int64_t type) {
  check_cpu(raw, "raw");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2, "raw must be uint8 [rows, bytes]");
  const int64_t record = marspec_kernels::packed_record_bytes(static_cast<int>(type));
  TORCH_CHECK(record > 0, "ggml type ", type, " is not one gguf_pack_tiles takes (Q4_K 12, Q6_K 14)");
  const int64_t block_bytes = marspec_kernels::block_format(static_cast<int>(type)).bytes;
  const at::Tensor rows = raw.contiguous();
  const int64_t count = rows.size(0), row_bytes = rows.size(1);
  TORCH_CHECK(row_bytes % block_bytes == 0, "a row of ", row_bytes, " bytes is not whole blocks of ", block_bytes);
  const int64_t supers = row_bytes / block_bytes;
  const int64_t tiles = (count + marspec_kernels::kPackTile - 1) / marspec_kernels::kPackTile;
  at::Tensor out = at::empty({tiles, supers, record}, rows.options());
  const uint8_t* in_p = rows.data_ptr<uint8_t>();
  uint8_t* out_p = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles * supers, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i / supers, s = i % supers;
      const int64_t first = tile * marspec_kernels::kPackTile;
      const int64_t present = std::min<int64_t>(marspec_kernels::kPackTile, count - first);
      marspec_kernels::pack_record(static_cast<int>(type), in_p + first * row_bytes, present, row_bytes, s,
                                   out_p + i * record);
    }
  });
  return out;
}

}  // namespace

MARSPEC_LIBRARY(m) { m.def("gguf_pack_tiles(Tensor raw, int type) -> Tensor", &pack_tiles); }
