// What every linear kernel does to its activation rows before and after the weights (torch-free, so the
// standalone harness runs it too): each row quantised to int8, and each tile's sums scaled back.
//
// Each row is put on [-127, 127] by its own scale (peak / 127) and rounded to nearest (ties to even),
// as torch code quantising a row does (RowwiseInt8Linear, the kernels' float64 references): the same
// int8 values on every path. A row holding a NaN or an infinity gets the scale NaN (and zeros for its
// int8 values), so every output of that row is NaN, as a float layer's would be.

#pragma once

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace marspec_kernels {

using namespace marspec_simd;

// Largest magnitude floor: an all-zero row gets a finite scale and quantises to zeros.
constexpr float kPeakFloor = 1e-30f;

struct QuantisedRows {
  std::vector<int8_t> q;      // [stored rows, K]
  std::vector<int16_t> sums;  // [stored rows, K / group]: each group's sum of q, |sum| <= group * 127
  std::vector<float> scale;   // [M]: peak / 127 (NaN for a row that is not finite)
};

// Row `m` of x (k_in values, a multiple of kGroup) quantised into q (k values, the tail past k_in zeros)
// with the sum of each kGroup values; its scale returned.
template <int64_t kGroup>
float quantise_row(const float* row, int64_t k_in, int8_t* q, int16_t* sums) {
  static_assert(kGroup % kLanes == 0 && kGroup * 127 <= INT16_MAX, "a group is whole vectors, its sum an int16");
  F32 peak_v = zerof();
  F32 finite = zerof();  // 0 * x summed: 0 for finite rows, NaN once a value is NaN or infinite
  for (int64_t i = 0; i < k_in; i += kLanes) {
    const F32 x = loadf(row + i);
    peak_v = maxf(peak_v, absf(x));
    finite = addf(finite, mulf(x, zerof()));
  }
  if (std::isnan(reduce_addf(finite))) return std::numeric_limits<float>::quiet_NaN();  // q stays zeros
  const float peak = std::max(reduce_maxf(peak_v), kPeakFloor);
  // As torch computes 127.0 / peak: the reciprocal, then the product.
  const F32 inv = set1f((1.0f / peak) * 127.0f);
  for (int64_t i = 0; i < k_in; i += kGroup) {
    I32 sum = zero();
    for (int64_t j = i; j < i + kGroup; j += kLanes) sum = add(sum, store_int8(q + j, mulf(loadf(row + j), inv)));
    sums[i / kGroup] = static_cast<int16_t>(reduce_add(sum));
  }
  return peak / 127.0f;
}

// Each of m_rows rows of x quantised in rows of k >= k_in values, then zero rows up to stored_rows
// (>= m_rows), which a tile load of whole row blocks may read.
template <int64_t kGroup>
QuantisedRows quantise_rows(const float* x, int64_t m_rows, int64_t k_in, int64_t k, int64_t stored_rows) {
  QuantisedRows out;
  out.q.resize(stored_rows * k);  // zeros
  out.sums.resize(stored_rows * (k / kGroup));
  out.scale.resize(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    out.scale[m] = quantise_row<kGroup>(x + m * k_in, k_in, out.q.data() + m * k, out.sums.data() + m * (k / kGroup));
  }
  return out;
}

constexpr int64_t kTileColumns = 32;  // output columns a tile's sums hold: two vectors of 16

// Output columns t*32 .. t*32+31 (those below n) of every row from a tile's float sums
// acc[m * 32 + column]: acc * the row's scale (+ bias), fused where there is a bias.
inline void write_tile(const float* acc, const float* scale, int64_t m_rows, int64_t t, int64_t n, const float* bias,
                       float* y) {
  for (int64_t c = 0; c < 2; ++c) {
    const int64_t n0 = t * kTileColumns + c * kLanes;
    const int64_t width = std::clamp<int64_t>(n - n0, 0, kLanes);
    if (width == 0) continue;
    float b[kLanes] = {};
    if (bias != nullptr) std::copy(bias + n0, bias + n0 + width, b);
    const F32 bv = loadf(b);
    for (int64_t m = 0; m < m_rows; ++m) {
      const F32 sx = set1f(scale[m]);
      const F32 a = loadf(acc + m * kTileColumns + c * kLanes);
      const F32 out = bias != nullptr ? fmadd(a, sx, bv) : mulf(a, sx);
      if (width == kLanes) {
        storef(y + m * n + n0, out);
      } else {
        float tail[kLanes];
        storef(tail, out);
        std::copy(tail, tail + width, y + m * n + n0);
      }
    }
  }
}

// Requests `bytes` from p on into the cache: every level, or the core's second level on (prefetch_l2).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line(p + i);
}
inline void prefetch_l2(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line_l2(p + i);
}

// Part `part` of `parts` of the cache lines of `bytes` from p on, requested into the cache (a long
// record's work spreads the next record's requests over itself: all at its start, they fill the
// core's line-fill buffers and the work behind them waits for memory).
inline void prefetch_part(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i) prefetch_line(p + 64 * i);
}
// The same into the core's second level on.
inline void prefetch_part_l2(const uint8_t* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i) prefetch_line_l2(p + 64 * i);
}

// How far ahead of its work a thread requests its weights, in records, and into which cache level.
// Requests for the next record into the first level, all at its start, made a many-row call's work wait
// for them; two records ahead into the second level, it runs while they arrive (benchmarks/
// kernel_variants.py). MARSPEC_RECORDS_AHEAD / MARSPEC_PREFETCH_LEVEL: a build that tries others.
#ifdef MARSPEC_RECORDS_AHEAD
constexpr int64_t kRecordsAhead = MARSPEC_RECORDS_AHEAD;
#else
constexpr int64_t kRecordsAhead = 2;
#endif

// The bytes requested while a thread adds the record at `record` (`bytes` long: shorter for a tile's last
// record where K is not a multiple of 256, as the 0.5B draft's 896) to its stream of tiles: the same
// length kRecordsAhead whole records (`full` bytes each) on. Consecutive records' requests then follow
// each other without a gap across a short record (the harness checks it), which a distance of the
// record's own length left in every tile of such a layer.
struct Requested {
  const uint8_t* start;
  int64_t bytes;
};
inline Requested requested_ahead(const uint8_t* record, int64_t bytes, int64_t full) {
  return {record + kRecordsAhead * full, bytes};
}
#ifdef MARSPEC_PREFETCH_LEVEL
constexpr int kPrefetchLevel = MARSPEC_PREFETCH_LEVEL;
#else
constexpr int kPrefetchLevel = 2;
#endif
// The vector path spreads those requests over a record's sub-blocks (a part each, by the first block of
// rows) for up to 16 rows (tile_rows.h's spreads_requests), as the AMX path does: made all at the
// record's start, they filled the core's line-fill buffers and its work waited behind them. Spread, on
// AMD EPYC Zen 4 (benchmarks/kernel_variants.py), one-row calls took 0.66-0.76x the time on the LM head's
// Q6_K, 0.67-0.87x on the other Q6_K layers and 0.83-0.96x on Q4_K, on AVX-512 and AVX2 alike.
// MARSPEC_SPREAD_REQUESTS=0: a build that requests at the start.
#ifdef MARSPEC_SPREAD_REQUESTS
constexpr bool kSpreadRequests = MARSPEC_SPREAD_REQUESTS != 0;
#else
constexpr bool kSpreadRequests = true;
#endif

}  // namespace marspec_kernels
