// The linear operators' frame (q4k.cpp, q6k.cpp): checks the arguments, quantises the activation rows to
// int8 (rows.h), runs the tiles of 32 output columns in parallel and writes the output; the kernel adds
// each tile's sums.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "rows.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace marspec_kernels {

// y = x @ W.T (+ bias) for float32 x [M, k_in] and weights packed in blocks [T, ...] (T tiles of 32
// output columns, each a sequential stream of S records: S - 1 of record_bytes, then the last of
// last_record_bytes, which is shorter where the layer's width leaves the last super-block part empty),
// N = out_features. x's rows are quantised in rows of k values (k_in <= k; the caller checks k_in), with
// the sums of each kGroup, and zero rows after them up to stored_rows; then each tile, on a thread of its
// own (never split over K), gets its sums acc [M, 32] (zeros first) from add_record(record, s, quantised
// rows, acc) for its records s = 0..S-1 in turn, and its output from them, add_record = make_worker()
// made once per thread's share of the tiles (what it holds, such as tile registers, lives as long). The
// stream kRecordsAhead records on is requested from memory while a record is added (the hardware
// prefetcher alone left a thread reading well below the memory's bandwidth; rows.h): by the worker,
// spread over its work, where its requests_next_record(rows) says so (the AMX path; the vector path up
// to 16 rows), else here, at the record's start.
template <int64_t kGroup, class MakeWorker>
at::Tensor tiled_linear(const at::Tensor& x, int64_t k, const at::Tensor& blocks, int64_t supers,
                        int64_t record_bytes, int64_t last_record_bytes, int64_t out_features,
                        const std::optional<at::Tensor>& bias, int64_t stored_rows, MakeWorker make_worker) {
  check_cpu(x, "x");
  check_cpu(blocks, "blocks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t tile_bytes = (supers - 1) * record_bytes + last_record_bytes;
  TORCH_CHECK(blocks.dim() >= 2 && blocks.scalar_type() == at::kByte && blocks.numel() == blocks.size(0) * tile_bytes,
              "blocks must be uint8 [ceil(N/32), ...] of ", tile_bytes, " bytes a tile for ", supers,
              " super-blocks");
  const int64_t tiles = blocks.size(0);
  TORCH_CHECK(tiles > 0 && out_features > (tiles - 1) * kTileColumns && out_features <= tiles * kTileColumns,
              "out_features does not match the tiles");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features && bias->is_contiguous(),
                "bias must be contiguous float32 [N]");
  }
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = blocks.contiguous();
  const int64_t m_rows = xc.size(0);
  at::Tensor y = at::empty({m_rows, out_features}, xc.options());
  if (m_rows == 0) return y;

  TORCH_CHECK(stored_rows >= m_rows, "stored_rows below the rows");
  const QuantisedRows xq = quantise_rows<kGroup>(xc.data_ptr<float>(), m_rows, xc.size(1), k, stored_rows);
  const uint8_t* blocks_p = bc.data_ptr<uint8_t>();
  const float* bias_p = has_bias ? bias->data_ptr<float>() : nullptr;
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m_rows * kTileColumns);
    auto add_record = make_worker();
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* record = blocks_p + t * tile_bytes + s * record_bytes;
        if (!add_record.requests_next_record(m_rows)) {
          const Requested ahead =
              requested_ahead(record, s + 1 < supers ? record_bytes : last_record_bytes, record_bytes);
          if constexpr (kPrefetchLevel == 1) prefetch(ahead.start, ahead.bytes);
          else prefetch_l2(ahead.start, ahead.bytes);
        }
        add_record(record, s, xq, acc.data());
      }
      write_tile(acc.data(), xq.scale.data(), m_rows, t, out_features, bias_p, y_p);
    }
  });
  return y;
}

}  // namespace marspec_kernels
