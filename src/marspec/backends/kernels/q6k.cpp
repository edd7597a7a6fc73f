// q6k_linear: float32 activations x Q6_K weights (q6k_format.h: the packed layout and the sums), on this
// build's instruction set (simd.h), or on the AVX-512 path from 8 rows AMX tiles (amx.h; the same sums).
//
// Each activation row is quantised to int8 with its own scale (rows.h, as q4k.cpp's rows are), then
// multiplied by the weights' 6-bit codes exactly in int32 (codes as the unsigned operand, activations as
// the signed one); Q6K::finish's float operations, then y * row scale (+ bias). Nothing a row computes
// depends on the other rows of the call, or on the instruction set: its output is the same bits whatever
// else is in the batch and on every CPU.

#include "amx.h"
#include "linears.h"
#include "q6k_format.h"
#include "tile_rows.h"
#include "tiled_linear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>

namespace {

using marspec_kernels::Q6K;
using marspec_kernels::QuantisedRows;

#if MARSPEC_HAS_AMX
// The AMX path. Each weight's scaled code v = sc * (q - 32) (|v| <= 4096) is split into its 16-bit
// form's bytes, v = 256 * high + low (low unsigned 0..255, high signed): one tile product per byte
// (TDPBSUD for the low, TDPBSSD for the high), each over 64 weights (four sub-blocks) at once, and
// low_sum + 256 * high_sum = sum_j sc_j * (q_j - 32) . x_j, the VNNI path's exact int32 (each sum at most
// 256 * 127 * 255 in magnitude). The codes are scaled once a record for all rows; a row then needs two
// sums per half.
using marspec_kernels::kChunk;
using marspec_kernels::kTileRows;
constexpr int64_t kHalf = Q6K::kHalf;
constexpr int64_t kGroups = Q6K::kGroups;
constexpr int64_t kSteps = Q6K::kChunkSteps;
constexpr int64_t kChunks = Q6K::kSuper / kChunk;
constexpr int32_t kOffset = Q6K::kOffset;
constexpr int64_t kTile = marspec_kernels::kTileColumns;

// One half of a record for the tiles: the low and high bytes of sc * (q - 32), as the weights' tile B
// of each chunk (16 rows of 16 columns x 4 weights: its four sub-blocks' 4 rows each).
struct AmxHalf {
  alignas(64) uint8_t low[kGroups][kSteps][64];
  alignas(64) int8_t high[kGroups][kSteps][64];
  alignas(64) float d[kHalf];
};

// A byte permute's indices: bytes 2i and 2i + 1 of the result are the low (kHigh: high) bytes of 16-bit
// word i of its first and of its second operand.
template <bool kHigh>
constexpr std::array<uint8_t, 64> word_bytes() {
  std::array<uint8_t, 64> index{};
  for (int i = 0; i < 32; ++i) {
    index[2 * i] = static_cast<uint8_t>(2 * i + kHigh);
    index[2 * i + 1] = static_cast<uint8_t>(64 + 2 * i + kHigh);
  }
  return index;
}
constexpr auto kLowBytes = word_bytes<false>();
constexpr auto kHighBytes = word_bytes<true>();

// Byte permutes (VBMI): every CPU with AMX has them.
// With its share of the next record's cache lines requested (see Q6KWorker::requests_next_record).
__attribute__((target("avx512vbmi"))) void amx_unpack(const uint8_t* record, int64_t half, AmxHalf& out) {
  const uint8_t* codes = Q6K::codes_of(record, half);
  const uint8_t* scales = Q6K::scales_of(record, half);
  const uint16_t* d = Q6K::d_of(record, half);
  const __m512i lows = _mm512_loadu_si512(kLowBytes.data()), highs = _mm512_loadu_si512(kHighBytes.data());
  for (int64_t j = 0; j < kGroups; ++j) {
    // The sub-block's scale of each column in its lane's byte 0 (even codes) or byte 1 (odd codes), and
    // -32 * sc in both 16-bit words.
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + j * kHalf)));
    const __m512i sc_bytes = _mm512_and_si512(sc, _mm512_set1_epi32(0xFF));
    const __m512i even_sc = _mm512_or_si512(sc_bytes, _mm512_slli_epi32(sc_bytes, 16));
    const __m512i odd_sc = _mm512_slli_epi16(even_sc, 8);
    const __m512i sc_words = _mm512_or_si512(_mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc, 16));
    const __m512i offset = _mm512_mullo_epi16(sc_words, _mm512_set1_epi16(-kOffset));
    marspec_kernels::prefetch_part(record + Q6K::kRecord, Q6K::kRecord, half * kGroups + j, 2 * kGroups);
    marspec_simd::I32 steps[kSteps];
    Q6K::group_codes(codes + j * Q6K::kGroupCodeBytes, steps);
    for (int64_t i = 0; i < kSteps; ++i) {
      // 16-bit words of sc * q (q 0..63, sc -128..127: no saturation) plus -32 * sc.
      const __m512i even = _mm512_add_epi16(_mm512_maddubs_epi16(steps[i].v, even_sc), offset);
      const __m512i odd = _mm512_add_epi16(_mm512_maddubs_epi16(steps[i].v, odd_sc), offset);
      _mm512_store_si512(out.low[j][i], _mm512_permutex2var_epi8(even, lows, odd));
      _mm512_store_si512(out.high[j][i], _mm512_permutex2var_epi8(even, highs, odd));
    }
  }
  marspec_simd::storef(out.d, marspec_simd::halfs(d));
}

// A block of rows (the tiles' configured count) against a record unpacked in w: the tile products, stored
// to sums[half][low, high][row][column].
MARSPEC_AMX_TARGET void amx_products(const AmxHalf* w, const int8_t* xq, int64_t k, int32_t* sums) {
  const auto weights = [w](int64_t i, int half, bool high) -> const void* {
    return high ? static_cast<const void*>(w[half].high[4 * i]) : w[half].low[4 * i];
  };
  marspec_kernels::chunk_products<true>(xq, k, kChunks, weights, sums);
}

// The `rows` real rows of a block from amx_products' sums: acc += d * (low + 256 * high), as rows_block
// ends.
void amx_finish(const AmxHalf* w, int64_t rows, const int32_t* sums, float* acc) {
  for (int c = 0; c < 2; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i low = _mm512_load_si512(sums + ((2 * c) * kTileRows + r) * kHalf);
      const __m512i high = _mm512_load_si512(sums + ((2 * c + 1) * kTileRows + r) * kHalf);
      const marspec_simd::I32 scaled{_mm512_add_epi32(low, _mm512_slli_epi32(high, 8))};
      Q6K::finish(w[c], scaled, nullptr, acc + r * kTile + c * kHalf);
    }
  }
}
#endif

// What one thread adds per record on its share of a call's tiles: the vector path (all_rows), or, where
// the call's rows take AMX, blocks of block_rows rows through the tiles it holds while it lives.
class Q6KWorker {
 public:
  Q6KWorker(int64_t k, int64_t block_rows)
      : k_(k), block_rows_(block_rows)
#if MARSPEC_HAS_AMX
        , amx_(block_rows)
#endif
  {
  }

  void operator()(const uint8_t* record, int64_t s, const QuantisedRows& xq, float* acc) {
    const auto m_rows = static_cast<int64_t>(xq.scale.size());
#if MARSPEC_HAS_AMX
    if (block_rows_ > 0) {
      amx_unpack(record, 0, amx_.halves[0]);
      amx_unpack(record, 1, amx_.halves[1]);
      for (int64_t m0 = 0; m0 < m_rows; m0 += block_rows_) {
        amx_products(amx_.halves, xq.q.data() + m0 * k_ + s * Q6K::kSuper, k_, amx_.sums);
        amx_finish(amx_.halves, std::min(block_rows_, m_rows - m0), amx_.sums,
                   acc + m0 * marspec_kernels::kTileColumns);
      }
      return;
    }
#endif
    marspec_kernels::all_rows<Q6K>(w_, record, xq, m_rows, k_, s, Q6K::kGroups, acc);
  }

  // Requested all at a record's start, the next records stall the work behind them (see Q4KWorker's):
  // the AMX path spreads them over its sub-blocks, the vector path up to 16 rows.
  bool requests_next_record(int64_t m_rows) const {
    return block_rows_ > 0 || marspec_kernels::spreads_requests(m_rows);
  }

 private:
  int64_t k_, block_rows_;
  Q6K::Half w_[2];
#if MARSPEC_HAS_AMX
  marspec_kernels::AmxThreadState<AmxHalf> amx_;
#endif
};

}  // namespace

namespace marspec_kernels {

at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocks.dim() == 3 && x.dim() == 2, "x must be [M, K], blocks [ceil(N/32), K/256, ", Q6K::kRecord, "]");
  const int64_t supers = blocks.size(1);
  TORCH_CHECK(supers > 0, "blocks hold no super-block");
  const int64_t k = supers * Q6K::kSuper;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, these weights ", k);
  const auto amx = marspec_kernels::amx_row_blocks(x.size(0), marspec_kernels::amx_min_rows_q6k);
  return marspec_kernels::tiled_linear<Q6K::kGroup>(x, k, blocks, supers, Q6K::kRecord, Q6K::kRecord, out_features,
                                                    bias, amx.stored_rows, [&] { return Q6KWorker(k, amx.block_rows); });
}

}  // namespace marspec_kernels

MARSPEC_LIBRARY(m) {
  m.def("q6k_linear(Tensor x, Tensor blocks, int out_features, Tensor? bias) -> Tensor", &marspec_kernels::q6k_linear);
}
