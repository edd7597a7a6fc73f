// q4k_linear: float32 activations x Q4_K weights (q4k_format.h: the packed layout and the sums), on this
// build's instruction set (simd.h), or on the AVX-512 path from 8 rows AMX tiles (amx.h; the same sums).
//
// Each activation row is quantised to int8 with its own scale (rows.h), then multiplied by the weights'
// 4-bit codes exactly in int32 (codes as the unsigned operand, activations as the signed one); the float
// operations after are Q4K::finish's, then y * row scale (+ bias). Nothing a row computes depends on the
// other rows of the call, or on the instruction set, so its output is the same bits whatever else is in
// the batch (a verification forward scores each token as a one-token step does) and on every CPU.

#include "amx.h"
#include "linears.h"
#include "q4k_format.h"
#include "tile_rows.h"
#include "tiled_linear.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

using marspec_kernels::Q4K;
using marspec_kernels::QuantisedRows;
static_assert(2 * Q4K::kHalf == marspec_kernels::kTileColumns, "the tiles tiled_linear runs");

#if MARSPEC_HAS_AMX
// The AMX path. A tile product sums 64 weights (two sub-blocks) at once, so the sub-block scales go
// into the weights it multiplies: with sc = 8 * hi + lo (hi, lo in 0..7), the products lo * q and
// hi * q (at most 105) are bytes, and over a super-block sum_k x_k * lo_k q_k + 8 * sum_k x_k * hi_k q_k
// = sum_g sc_g * (q_g . x_g), the vector path's exact int32 (each sum at most 256 * 127 * 105 in
// magnitude). Each record's codes are scaled once for all rows (a 16-bit multiply gives two bytes'
// products: neither exceeds a byte); a row then needs two sums per half.
using marspec_kernels::kChunk;
using marspec_kernels::kTileRows;
static_assert(kChunk == 2 * Q4K::kGroup, "a tile product sums two sub-blocks");
constexpr int kScaleBits = 3;  // sc = hi << 3 | lo
constexpr int64_t kHalf = Q4K::kHalf;
constexpr int64_t kGroups = Q4K::kGroups;

// One half of a record for the tiles: lo * q and hi * q as the weights' tile B of each chunk (16 rows
// of 16 columns x 4 weights: sub-block 2i's 8 rows, then sub-block 2i + 1's), the mins as int16 pairs.
struct AmxHalf {
  alignas(64) uint8_t lo[kGroups][8][64];
  alignas(64) uint8_t hi[kGroups][8][64];
  alignas(64) int32_t m[kGroups / 2][kHalf];
  alignas(64) float d[kHalf];
  alignas(64) float dmin[kHalf];
};

// A half of a record unpacked for the tiles, with its share of the next record's cache lines requested
// (starting at next: see Q4KWorker::requests_next_record).
void amx_unpack(const uint8_t* record, int half, int64_t used, AmxHalf& out, const uint8_t* next) {
  const uint8_t* codes = Q4K::codes_of(record, half, used);
  const uint8_t* scales = Q4K::scales_of(record, half, used);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i low_bits = _mm512_set1_epi32((1 << kScaleBits) - 1);
  for (int64_t g = 0; g < used; ++g) {
    marspec_kernels::prefetch_part(next, Q4K::kRecord, half * used + g, 2 * used);
    // Each column's scale part in both 16-bit words of its lane (its 4 code bytes).
    const __m512i sc = marspec_simd::widen_u8(scales + g * kHalf).v;
    const __m512i lo_part = _mm512_and_si512(sc, low_bits);
    const __m512i hi_part = _mm512_srli_epi32(sc, kScaleBits);
    const __m512i lo = _mm512_or_si512(lo_part, _mm512_slli_epi32(lo_part, 16));
    const __m512i hi = _mm512_or_si512(hi_part, _mm512_slli_epi32(hi_part, 16));
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + (g * 4 + c) * 64);
      const __m512i first = _mm512_and_si512(v, low);
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      _mm512_store_si512(out.lo[g][2 * c], _mm512_mullo_epi16(first, lo));
      _mm512_store_si512(out.lo[g][2 * c + 1], _mm512_mullo_epi16(second, lo));
      _mm512_store_si512(out.hi[g][2 * c], _mm512_mullo_epi16(first, hi));
      _mm512_store_si512(out.hi[g][2 * c + 1], _mm512_mullo_epi16(second, hi));
    }
  }
  Q4K::unpack_mins_and_d(record, half, used, out);
}

// A block of rows (the tiles' configured count, the last block's padded with zero rows) against a
// record unpacked in w: the tile products over its chunks (two sub-blocks each; where the last has one,
// its second's weights are whatever the buffer holds, against activations that are zeros there),
// stored to sums[half][lo, hi][row][column].
MARSPEC_AMX_TARGET void amx_products(const AmxHalf* w, const int8_t* xq, int64_t k, int64_t used, int32_t* sums) {
  const auto weights = [w](int64_t i, int half, bool high) -> const void* {
    return high ? w[half].hi[2 * i] : w[half].lo[2 * i];
  };
  marspec_kernels::chunk_products<false>(xq, k, (used + 1) / 2, weights, sums);
}

// The `rows` real rows of a block from amx_products' sums: each row's scaled sum, then Q4K::finish, as
// the vector path's rows end.
void amx_finish(const AmxHalf* w, const int16_t* xsums, int64_t groups, int64_t rows, const int32_t* sums,
                float* acc) {
  for (int c = 0; c < 2; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i lo = _mm512_load_si512(sums + ((2 * c) * kTileRows + r) * kHalf);
      const __m512i hi = _mm512_load_si512(sums + ((2 * c + 1) * kTileRows + r) * kHalf);
      const marspec_simd::I32 scaled{_mm512_add_epi32(lo, _mm512_slli_epi32(hi, kScaleBits))};
      Q4K::finish(w[c], scaled, xsums + r * groups, acc + r * marspec_kernels::kTileColumns + c * kHalf);
    }
  }
}
#endif

// What one thread adds per record on its share of a call's tiles: the vector path (all_rows), or, where
// the call's rows take AMX, blocks of block_rows rows through the tiles it holds while it lives.
class Q4KWorker {
 public:
  Q4KWorker(int64_t k, int64_t supers, int64_t last_used, int64_t block_rows)
      : k_(k), supers_(supers), last_used_(last_used), block_rows_(block_rows)
#if MARSPEC_HAS_AMX
        , amx_(block_rows)
#endif
  {
  }

  void operator()(const uint8_t* record, int64_t s, const QuantisedRows& xq, float* acc) {
    const int64_t used = s + 1 < supers_ ? Q4K::kGroups : last_used_;
    const auto m_rows = static_cast<int64_t>(xq.scale.size());
#if MARSPEC_HAS_AMX
    if (block_rows_ > 0) {
      const uint8_t* next = record + (s + 1 < supers_ ? Q4K::kRecord : Q4K::record_bytes(last_used_));
      amx_unpack(record, 0, used, amx_.halves[0], next);
      amx_unpack(record, 1, used, amx_.halves[1], next);
      const int64_t groups = k_ / Q4K::kGroup;
      for (int64_t m0 = 0; m0 < m_rows; m0 += block_rows_) {
        amx_products(amx_.halves, xq.q.data() + m0 * k_ + s * Q4K::kSuper, k_, used, amx_.sums);
        amx_finish(amx_.halves, xq.sums.data() + m0 * groups + s * Q4K::kGroups, groups,
                   std::min(block_rows_, m_rows - m0), amx_.sums, acc + m0 * marspec_kernels::kTileColumns);
      }
      return;
    }
#endif
    marspec_kernels::all_rows<Q4K>(w_, record, xq, m_rows, k_, s, used, acc);
  }

  // Requesting the next records all at a record's start stalls the work behind them (the AMX path:
  // 14-28% slower on the default target's layers at 12-16 rows; the vector path: rows.h's
  // kSpreadRequests): the AMX path spreads them over its sub-blocks, the vector path up to 16 rows
  // (tile_rows.h's spreads_requests).
  bool requests_next_record(int64_t m_rows) const {
    return block_rows_ > 0 || marspec_kernels::spreads_requests(m_rows);
  }

 private:
  int64_t k_, supers_, last_used_, block_rows_;
  Q4K::Half w_[2];
#if MARSPEC_HAS_AMX
  marspec_kernels::AmxThreadState<AmxHalf> amx_;
#endif
};

}  // namespace

namespace marspec_kernels {

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) % Q4K::kGroup == 0, "x must be [M, K], K a multiple of 32");
  const int64_t k_in = x.size(1);  // the layer's width: its last super-block may hold fewer sub-blocks
  const int64_t supers = (k_in + Q4K::kSuper - 1) / Q4K::kSuper;
  const int64_t k = supers * Q4K::kSuper;
  const int64_t last_used = (k_in - (k - Q4K::kSuper)) / Q4K::kGroup;  // sub-blocks in the last super-block
  const auto amx = marspec_kernels::amx_row_blocks(x.size(0), marspec_kernels::amx_min_rows_q4k);
  return marspec_kernels::tiled_linear<Q4K::kGroup>(
      x, k, blocks, supers, Q4K::kRecord, Q4K::record_bytes(last_used), out_features, bias, amx.stored_rows,
      [&] { return Q4KWorker(k, supers, last_used, amx.block_rows); });
}

}  // namespace marspec_kernels

MARSPEC_LIBRARY(m) {
  m.def("q4k_linear(Tensor x, Tensor blocks, int out_features, Tensor? bias) -> Tensor", &marspec_kernels::q4k_linear);
}
