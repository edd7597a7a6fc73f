// marspec_q6k::linear: float32 activations x Q6_K weights, with AVX-512 VNNI, or from 8 rows AMX
// tiles (amx.h; the same sums, below).
//
// Each activation row is quantised to int8 with its own scale (peak / 127, tiled_linear.h, as q4k.cpp's
// rows are), then multiplied by the weights' 6-bit codes q (0..63) exactly in int32
// (_mm512_dpbusd_epi32: codes as the unsigned operand, activations as the signed one). Per 256-weight
// super-block, sum_j sc_j * (q_j . x_j - 32 * sum(x_j)) over its sixteen 16-weight sub-blocks j (sc_j
// the signed int8 scales) is exact in int32 (|.| < 2^28); then y += d * float(that)
// in float32, super-block after super-block, and finally y * row scale (+ bias). Nothing a row
// computes depends on the other rows of the call, so its output is the same bits whatever else is in
// the batch.
//
// Packed layout (built in marspec/backends/q6k.py from GGUF Q6_K blocks): blocks, uint8
// [T, S, 6720] for T = ceil(N / 32) tiles of 32 output columns and S = K / 256 super-blocks. A tile's
// records follow each other, so a thread reads one sequential stream. A record is the super-block of
// two halves of 16 columns (the 16 lanes of a zmm), each field for half 0 then half 1:
//   codes  2 x 3072 bytes: per sub-block j (16), 192 bytes: two 64-byte nibble vectors p (0, 1) whose
//          byte 4*c + b holds the low 4 bits of column c's code for weight 16j + 8p + b in its low
//          nibble and for 16j + 8p + 4 + b in its high nibble, then one 64-byte vector whose byte
//          4*c + b holds the top 2 bits of the codes for weights 16j + 4i + b in its bits 2i, 2i + 1
//          (i = 0..3); so a few ANDs and shifts give dpbusd's 4 consecutive weights of 16 columns;
//   scales 2 x 256 bytes: the int8 sub-block scales sc [16][16];
//   d      2 x 32 bytes: fp16 (little-endian) d [16].
// A weight is d * sc * (q - 32) (ggml's Q6_K). 210 bytes a 256-weight column: the GGUF's own 6.5625
// bits a weight.

#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include "amx.h"
#include "tiled_linear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

namespace {

using marspec_kernels::broadcast4;
using marspec_kernels::QuantisedRows;

constexpr int64_t kHalf = 16;          // output columns in a zmm's lanes
constexpr int64_t kTile = 2 * kHalf;   // output columns per tile: two halves share each broadcast
static_assert(kTile == marspec_kernels::kTileColumns, "the tiles tiled_linear runs");
constexpr int64_t kSuper = 256;        // weights per super-block
constexpr int64_t kGroup = 16;         // weights per sub-block (one scale)
constexpr int64_t kGroups = kSuper / kGroup;
constexpr int64_t kSteps = kGroup / 4;                // dpbusd steps of 4 weights in a sub-block
constexpr int64_t kGroupCodeBytes = 3 * 64;           // a half's codes of one sub-block
constexpr int64_t kCodeBytes = kGroups * kGroupCodeBytes;  // a half's codes in a record
constexpr int64_t kScaleBytes = kGroups * kHalf;      // a half's sc
constexpr int64_t kDBytes = kHalf * 2;                // a half's d (fp16)
constexpr int64_t kRecord = 2 * (kCodeBytes + kScaleBytes + kDBytes);
static_assert(kRecord == kTile * 210, "a record holds the GGUF's bytes of its 32 columns");
constexpr int32_t kOffset = 32;  // a weight is sc * (q - 32)
// Rows whose int32 sums stay in registers: 4 per row of the 32 vector registers, and a few more.
constexpr int64_t kRowBlock = 6;
// Blocks of rows that unpack the codes in registers themselves; more share them unpacked once into a
// buffer. Measured at 13 rows (blocks of 5, 4, 4), one thread: unpacking in each block took 3.3-3.7 ms
// on a 32768 x 1536 layer where the shared buffer took 5.2 (the shifts and masks run beside the dpbusds).
constexpr int64_t kBlocksFromRecord = 3;

// One half of a record, unpacked once and then read by every row.
struct UnpackedHalf {
  alignas(64) uint8_t codes[kGroups][kSteps][64];  // [sub-block][4-weight step][16 columns x 4 codes]
  alignas(64) int32_t sc[kGroups][kHalf];          // the sub-block scales
  alignas(64) float d[kHalf];
};

// Step i's codes (weights 4i..4i+3 of a sub-block) from the sub-block's nibble and top-bit vectors.
template <int kStep>
inline __m512i step_codes(const __m512i nibbles[2], __m512i top) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  const __m512i v = nibbles[kStep / 2];
  const __m512i low = (kStep % 2 == 0) ? _mm512_and_si512(v, low4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  // The step's 2 bits moved to bits 4-5 of each byte (16-bit shifts: the masked bits are the byte's own).
  __m512i high;
  if constexpr (kStep == 0) high = _mm512_slli_epi16(top, 4);
  else if constexpr (kStep == 1) high = _mm512_slli_epi16(top, 2);
  else if constexpr (kStep == 2) high = top;
  else high = _mm512_srli_epi16(top, 2);
  return _mm512_ternarylogic_epi32(high, bits45, low, 0xEA);  // (high & bits45) | low
}

// A sub-block's codes, all 4 steps, read from the record.
inline void group_codes(const uint8_t* group, __m512i out[kSteps]) {
  const __m512i nibbles[2] = {_mm512_loadu_si512(group), _mm512_loadu_si512(group + 64)};
  const __m512i top = _mm512_loadu_si512(group + 128);
  out[0] = step_codes<0>(nibbles, top);
  out[1] = step_codes<1>(nibbles, top);
  out[2] = step_codes<2>(nibbles, top);
  out[3] = step_codes<3>(nibbles, top);
}

void unpack_codes(const uint8_t* record, int64_t half, UnpackedHalf& out) {
  const uint8_t* codes = record + half * kCodeBytes;
  for (int64_t j = 0; j < kGroups; ++j) {
    __m512i steps[kSteps];
    group_codes(codes + j * kGroupCodeBytes, steps);
    for (int64_t i = 0; i < kSteps; ++i) _mm512_store_si512(out.codes[j][i], steps[i]);
  }
}

// A half's scales (as int32) and d.
void unpack_scales(const uint8_t* record, int64_t half, UnpackedHalf& out) {
  const uint8_t* scales = record + 2 * kCodeBytes + half * kScaleBytes;
  const uint8_t* d = record + 2 * (kCodeBytes + kScaleBytes) + half * kDBytes;
  for (int64_t j = 0; j < kGroups; ++j) {
    const auto* sc = reinterpret_cast<const __m128i*>(scales + j * kHalf);
    _mm512_store_si512(out.sc[j], _mm512_cvtepi8_epi32(_mm_loadu_si128(sc)));
  }
  _mm512_store_ps(out.d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d))));
}

// R rows' sums over one record (both halves: each broadcast of activations serves the two), added to
// their accumulators acc[r * 32 + column]: per row and column, the exact int32
// sum_j sc_j * (q_j . x_j - 32 * sum(x_j)), each sub-block's dot product started from -32 * sum(x_j)
// (rather than a chain of offsets after the record's last dpbusd: 11% faster at 13 rows), then one
// multiply-add by d. The codes come
// unpacked from w (read by several blocks of rows), or straight from the record (unpacked in
// registers). Each output column gets the same operations, the integer ones exact, in the same order
// whatever R and the codes' source are.
template <int R, bool kFromRecord>
void rows_block(const UnpackedHalf* w, const uint8_t* record, const int8_t* xq, int64_t k, const int16_t* xsums,
                int64_t groups, float* acc) {
  __m512i scaled[R][2];
  for (int r = 0; r < R; ++r) scaled[r][0] = scaled[r][1] = _mm512_setzero_si512();
  for (int64_t j = 0; j < kGroups; ++j) {
    __m512i codes[2][kSteps];  // [half][step]
    for (int c = 0; c < 2; ++c) {
      if constexpr (kFromRecord) {
        group_codes(record + c * kCodeBytes + j * kGroupCodeBytes, codes[c]);
      } else {
        for (int i = 0; i < kSteps; ++i) codes[c][i] = _mm512_load_si512(w[c].codes[j][i]);
      }
    }
    __m512i s[R][2];  // |q_j . x_j - 32 * sum(x_j)| = |(q_j - 32) . x_j| <= 16 * 32 * 127
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_set1_epi32(-kOffset * xsums[r * groups + j]);
    for (int i = 0; i < kSteps; ++i) {
      for (int r = 0; r < R; ++r) {
        const __m512i x = broadcast4(xq + r * k + j * kGroup + i * 4);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], codes[0][i], x);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], codes[1][i], x);
      }
    }
    for (int c = 0; c < 2; ++c) {
      const __m512i sc = _mm512_load_si512(w[c].sc[j]);
      for (int r = 0; r < R; ++r) scaled[r][c] = _mm512_add_epi32(scaled[r][c], _mm512_mullo_epi32(s[r][c], sc));
    }
  }
  for (int c = 0; c < 2; ++c) {
    const __m512 d = _mm512_load_ps(w[c].d);
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * kTile + c * kHalf;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(scaled[r][c]), _mm512_loadu_ps(a)));
    }
  }
}

using RowsBlockFn = void (*)(const UnpackedHalf*, const uint8_t*, const int8_t*, int64_t, const int16_t*, int64_t,
                             float*);

template <bool kFromRecord, int... R>
constexpr std::array<RowsBlockFn, sizeof...(R) + 1> rows_blocks(std::integer_sequence<int, R...>) {
  return {nullptr, rows_block<R + 1, kFromRecord>...};
}

constexpr auto kFromRecordRows = rows_blocks<true>(std::make_integer_sequence<int, kRowBlock>{});
constexpr auto kUnpackedRows = rows_blocks<false>(std::make_integer_sequence<int, kRowBlock>{});

// Every row against one record (super-block s), in as few blocks as fit the registers, of sizes that
// differ by one at most (13 rows: 5, 4, 4).
void all_rows(UnpackedHalf* w, const uint8_t* record, const QuantisedRows& xq, int64_t m_rows, int64_t k,
              int64_t s, float* acc) {
  const int64_t groups = k / kGroup;
  const int64_t blocks = (m_rows + kRowBlock - 1) / kRowBlock;
  unpack_scales(record, 0, w[0]);
  unpack_scales(record, 1, w[1]);
  const bool from_record = blocks <= kBlocksFromRecord;
  if (!from_record) {
    unpack_codes(record, 0, w[0]);
    unpack_codes(record, 1, w[1]);
  }
  const RowsBlockFn* fns = from_record ? kFromRecordRows.data() : kUnpackedRows.data();
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = m_rows / blocks + (b < m_rows % blocks ? 1 : 0);
    fns[rows](w, record, xq.q.data() + m0 * k + s * kSuper, k, xq.sums.data() + m0 * groups + s * kGroups, groups,
              acc + m0 * kTile);
    m0 += rows;
  }
}

#if MARSPEC_HAS_AMX
// The AMX path. Each weight's scaled code v = sc * (q - 32) (|v| <= 4096) is split into its 16-bit
// form's bytes, v = 256 * high + low (low unsigned 0..255, high signed): one tile product per byte
// (TDPBSUD for the low, TDPBSSD for the high), each over 64 weights (four sub-blocks) at once, and
// low_sum + 256 * high_sum = sum_j sc_j * (q_j - 32) . x_j, the VNNI path's exact int32 (each sum at most
// 256 * 127 * 255 in magnitude). The codes are scaled once a record for all rows; a row then needs two
// sums per half.
using marspec_kernels::kChunk;
using marspec_kernels::kTileRows;
constexpr int64_t kChunks = kSuper / kChunk;

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
  const uint8_t* codes = record + half * kCodeBytes;
  const uint8_t* scales = record + 2 * kCodeBytes + half * kScaleBytes;
  const uint8_t* d = record + 2 * (kCodeBytes + kScaleBytes) + half * kDBytes;
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
    marspec_kernels::prefetch_part(record + kRecord, kRecord, half * kGroups + j, 2 * kGroups);
    __m512i steps[kSteps];
    group_codes(codes + j * kGroupCodeBytes, steps);
    for (int64_t i = 0; i < kSteps; ++i) {
      // 16-bit words of sc * q (q 0..63, sc -128..127: no saturation) plus -32 * sc.
      const __m512i even = _mm512_add_epi16(_mm512_maddubs_epi16(steps[i], even_sc), offset);
      const __m512i odd = _mm512_add_epi16(_mm512_maddubs_epi16(steps[i], odd_sc), offset);
      _mm512_store_si512(out.low[j][i], _mm512_permutex2var_epi8(even, lows, odd));
      _mm512_store_si512(out.high[j][i], _mm512_permutex2var_epi8(even, highs, odd));
    }
  }
  _mm512_store_ps(out.d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d))));
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
    const __m512 d = _mm512_load_ps(w[c].d);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i low = _mm512_load_si512(sums + ((2 * c) * kTileRows + r) * kHalf);
      const __m512i high = _mm512_load_si512(sums + ((2 * c + 1) * kTileRows + r) * kHalf);
      const __m512i scaled = _mm512_add_epi32(low, _mm512_slli_epi32(high, 8));
      float* a = acc + r * kTile + c * kHalf;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(scaled), _mm512_loadu_ps(a)));
    }
  }
}
#endif

// What one thread adds per record on its share of a call's tiles: the VNNI path (all_rows), or, where
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
        amx_products(amx_.halves, xq.q.data() + m0 * k_ + s * kSuper, k_, amx_.sums);
        amx_finish(amx_.halves, std::min(block_rows_, m_rows - m0), amx_.sums, acc + m0 * kTile);
      }
      return;
    }
#endif
    all_rows(w_, record, xq, m_rows, k_, s, acc);
  }

  // The AMX path's records take long enough that requesting the next one all at their start stalls
  // them (measured: 14-28% slower on the default target's layers at 12-16 rows); it spreads the
  // requests over its sub-blocks.
  bool requests_next_record() const { return block_rows_ > 0; }

 private:
  int64_t k_, block_rows_;
  UnpackedHalf w_[2];
#if MARSPEC_HAS_AMX
  marspec_kernels::AmxThreadState<AmxHalf> amx_;
#endif
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocks.dim() == 3 && x.dim() == 2, "x must be [M, K], blocks [ceil(N/32), K/256, ", kRecord, "]");
  const int64_t supers = blocks.size(1);
  const int64_t k = supers * kSuper;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, these weights ", k);
  const auto amx = marspec_kernels::amx_row_blocks(x.size(0), marspec_kernels::amx_min_rows_q6k);
  return marspec_kernels::tiled_linear<kGroup>(x, k, blocks, supers, kRecord, kRecord, out_features, bias,
                                               amx.stored_rows, [&] { return Q6KWorker(k, amx.block_rows); });
}

}  // namespace

TORCH_LIBRARY(marspec_q6k, m) {
  m.def("linear(Tensor x, Tensor blocks, int out_features, Tensor? bias) -> Tensor", &linear);
}
