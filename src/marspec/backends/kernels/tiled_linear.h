// What the kernels (q4k.cpp, q6k.cpp) share: the operator's frame (tiled_linear), which checks the
// arguments, quantises the activation rows to int8, runs the tiles of 32 output columns in parallel and
// writes the output; the kernel adds each tile's sums.
//
// Each row is put on [-127, 127] by its own scale (peak / 127) and rounded to nearest (ties to even),
// as torch code quantising a row does (RowwiseInt8Linear, the kernels' float64 references): the same
// int8 values in every kernel.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace marspec_kernels {

// Largest magnitude floor: an all-zero row gets a finite scale and quantises to zeros.
constexpr float kPeakFloor = 1e-30f;

struct QuantisedRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<int16_t> sums;  // [M, K / group]: each group's sum of q, |sum| <= group * 127
  std::vector<float> scale;   // [M]: peak / 127
};

// Each row (k_in values, a multiple of kGroup) quantised, in rows of k >= k_in values whose tail is
// zeros (the weights' padding meets zeros), with the sum of each kGroup values (16 or 32); then zero
// rows up to stored_rows (>= m_rows), which a tile load of whole row blocks may read.
template <int64_t kGroup>
QuantisedRows quantise_rows(const float* x, int64_t m_rows, int64_t k_in, int64_t k, int64_t stored_rows) {
  static_assert(kGroup % 16 == 0 && kGroup * 127 <= INT16_MAX, "a group is whole zmms and its sum an int16");
  QuantisedRows out;
  out.q.resize(stored_rows * k);  // zeros
  out.sums.resize(stored_rows * (k / kGroup));
  out.scale.resize(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * k_in;
    __m512 peak_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < k_in; i += 16) {
      peak_v = _mm512_max_ps(peak_v, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    }
    const float peak = std::max(_mm512_reduce_max_ps(peak_v), kPeakFloor);
    // As torch computes 127.0 / peak: the reciprocal, then the product.
    const __m512 inv = _mm512_set1_ps((1.0f / peak) * 127.0f);
    int8_t* q = out.q.data() + m * k;
    int16_t* sums = out.sums.data() + m * (k / kGroup);
    for (int64_t i = 0; i < k_in; i += kGroup) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t j = i; j < i + kGroup; j += 16) {
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(a));
        sum = _mm512_add_epi32(sum, a);
      }
      sums[i / kGroup] = static_cast<int16_t>(_mm512_reduce_add_epi32(sum));
    }
    out.scale[m] = peak / 127.0f;
  }
  return out;
}

constexpr int64_t kTileColumns = 32;  // output columns a tile's sums hold: two zmms of 16

// Output columns t*32 .. t*32+31 (those below n) of every row from a tile's float sums
// acc[m * 32 + column]: acc * the row's scale (+ bias).
inline void write_tile(const float* acc, const QuantisedRows& xq, int64_t m_rows, int64_t t, int64_t n,
                       const float* bias, float* y) {
  for (int64_t c = 0; c < 2; ++c) {
    const int64_t n0 = t * kTileColumns + c * 16;
    const int64_t width = std::clamp<int64_t>(n - n0, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int64_t m = 0; m < m_rows; ++m) {
      const __m512 sx = _mm512_set1_ps(xq.scale[m]);
      const __m512 a = _mm512_loadu_ps(acc + m * kTileColumns + c * 16);
      const __m512 out = bias != nullptr ? _mm512_fmadd_ps(a, sx, b) : _mm512_mul_ps(a, sx);
      _mm512_mask_storeu_ps(y + m * n + n0, mask, out);
    }
  }
}

// Requests `bytes` from p on into the cache (past a tensor's end a prefetch does not fault).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// Part `part` of `parts` of the cache lines of `bytes` from p on, requested into the cache (a long
// record's work spreads the next record's requests over itself: all at its start, they fill the
// core's line-fill buffers and the work behind them waits for memory).
inline void prefetch_part(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T0);
  }
}

// The 4 bytes at p in every 32-bit lane.
inline __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// y = x @ W.T (+ bias) for float32 x [M, k_in] and weights packed in blocks [T, ...] (T tiles of 32
// output columns, each a sequential stream of S records: S - 1 of record_bytes, then the last of
// last_record_bytes, which is shorter where the layer's width leaves the last super-block part empty),
// N = out_features. x's rows are quantised in rows of k values (k_in <= k; the caller checks k_in), with
// the sums of each kGroup, and zero rows after them up to stored_rows; then each tile, on a thread of its
// own (never split over K), gets its sums acc [M, 32] (zeros first) from add_record(record, s, quantised
// rows, acc) for its records s = 0..S-1 in turn, and its output from them, add_record = make_worker()
// made once per thread's share of the tiles (what it holds, such as tile registers, lives as long). The
// next record is requested from memory while one is added (the hardware prefetcher alone left a thread
// reading well below the memory's bandwidth): here, at the record's start, unless the worker's
// requests_next_record() says it spreads them over its own work.
template <int64_t kGroup, class MakeWorker>
at::Tensor tiled_linear(const at::Tensor& x, int64_t k, const at::Tensor& blocks, int64_t supers,
                        int64_t record_bytes, int64_t last_record_bytes, int64_t out_features,
                        const std::optional<at::Tensor>& bias, int64_t stored_rows, MakeWorker make_worker) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t tile_bytes = (supers - 1) * record_bytes + last_record_bytes;
  TORCH_CHECK(blocks.dim() >= 2 && blocks.scalar_type() == at::kByte && blocks.numel() == blocks.size(0) * tile_bytes,
              "blocks must be uint8 [ceil(N/32), ...] of ", tile_bytes, " bytes a tile for ", supers,
              " super-blocks");
  const int64_t tiles = blocks.size(0);
  TORCH_CHECK(out_features > (tiles - 1) * kTileColumns && out_features <= tiles * kTileColumns,
              "out_features does not match the tiles");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
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
        // Past the tensor's end a prefetch does not fault.
        if (!add_record.requests_next_record()) prefetch(record + record_bytes, record_bytes);
        add_record(record, s, xq, acc.data());
      }
      write_tile(acc.data(), xq, m_rows, t, out_features, bias_p, y_p);
    }
  });
  return y;
}

}  // namespace marspec_kernels
