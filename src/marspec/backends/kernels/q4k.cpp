// marspec_q4k::linear: float32 activations x Q4_K weights, with AVX-512 VNNI.
//
// Each activation row is quantised to int8 with its own scale (peak / 127), then multiplied by the
// weights' 4-bit codes exactly in int32 (_mm512_dpbusd_epi32: codes as the unsigned operand,
// activations as the signed one). Per 256-weight super-block, the sub-blocks' sums times their 6-bit
// scales, and the activations' sub-block sums times the 6-bit mins, are added exactly in int32; then
// y += d * float(first) - dmin * float(second) in float32, super-block after super-block, and finally
// y * row scale (+ bias). Nothing a row computes depends on the other rows of the call, so its output
// is the same bits whatever else is in the batch (a verification forward scores each token as a
// one-token step does).
//
// Packed layout (built in marspec/backends/q4k.py from GGUF Q4_K blocks): blocks, uint8 [T, bytes] for
// T = ceil(N / 32) tiles of 32 output columns of a layer K wide (a multiple of 32), each tile the
// records of its S = ceil(K / 256) super-blocks one after the other, so a thread reads one sequential
// stream. A record is the super-block of two halves of 16 columns (the 16 lanes of a zmm), each field
// for half 0 then half 1:
//   codes  2 x 256 bytes a sub-block: per sub-block g and 8-weight chunk c (4), 64 bytes: byte 4*j + b
//          holds column j's code for weight 8*c + b in its low nibble and for 8*c + 4 + b in its high
//          nibble (so one AND / one shift give dpbusd's 4 consecutive weights of 16 columns);
//   scales 2 x 256 bytes: the 6-bit sub-block scales sc [8][16], then the mins m [8][16];
//   d      2 x 128 bytes: float32 (little-endian) d [16], then dmin [16].
// A record holds the codes of the sub-blocks that hold weights: all 8 (4864 bytes), except in the last
// super-block of a layer whose width is not a multiple of 256 (the draft's 896: 3.5 super-blocks), which
// holds only its first K % 256 / 32, so no padding is stored or read. A weight is d * sc * q - dmin * m
// (ggml's Q4_K). 4.75 bits a weight.

#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include "tiled_linear.h"

#include <array>
#include <cstdint>
#include <optional>
#include <utility>

namespace {

using marspec_kernels::broadcast4;
using marspec_kernels::QuantisedRows;

constexpr int64_t kHalf = 16;             // output columns in a zmm's lanes
constexpr int64_t kTile = 2 * kHalf;      // output columns per tile: two halves share each broadcast
static_assert(kTile == marspec_kernels::kTileColumns, "the tiles tiled_linear runs");
constexpr int64_t kSuper = 256;           // weights per super-block
constexpr int64_t kGroup = 32;            // weights per sub-block
constexpr int64_t kGroups = kSuper / kGroup;
constexpr int64_t kGroupCodeBytes = kGroup * kHalf / 2;  // a half's codes of one sub-block
constexpr int64_t kScaleBytes = 2 * kGroups * kHalf;      // a half's sc and m
constexpr int64_t kDBytes = 2 * kHalf * 4;                // a half's d and dmin
// A record whose first `used` sub-blocks hold weights.
constexpr int64_t record_bytes(int64_t used) { return 2 * (used * kGroupCodeBytes + kScaleBytes + kDBytes); }
constexpr int64_t kRecord = record_bytes(kGroups);
// Rows whose int32 sums stay in registers: 4 per row of the 32 vector registers, and a few more.
constexpr int64_t kRowBlock = 6;
constexpr int64_t kBlocksFromRecord = 3;
// One half of a record, unpacked once and then read by every row.
struct UnpackedHalf {
  alignas(64) uint8_t codes[kGroups][8][64];  // [sub-block][4-weight step][16 columns x 4 codes]
  alignas(64) int32_t sc[kGroups][kHalf];     // the sub-block scales
  alignas(64) int32_t m[kGroups / 2][kHalf];  // the mins of sub-blocks 2i, 2i + 1 as int16 pairs
  alignas(64) float d[kHalf];
  alignas(64) float dmin[kHalf];
};

// A half's 4-bit codes of the record's `used` sub-blocks, one byte each.
void unpack_codes(const uint8_t* record, int64_t half, int64_t used, UnpackedHalf& out) {
  const uint8_t* codes = record + half * used * kGroupCodeBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < used; ++g) {
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + (g * 4 + c) * 64);
      _mm512_store_si512(out.codes[g][2 * c], _mm512_and_si512(v, low));
      _mm512_store_si512(out.codes[g][2 * c + 1], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

// A half's scales, mins, d and dmin (after the codes of the record's `used` sub-blocks).
void unpack_scales(const uint8_t* record, int64_t half, int64_t used, UnpackedHalf& out) {
  const uint8_t* scales = record + 2 * used * kGroupCodeBytes + half * kScaleBytes;
  const uint8_t* d = record + 2 * (used * kGroupCodeBytes + kScaleBytes) + half * kDBytes;
  for (int64_t g = 0; g < kGroups; ++g) {
    const auto* sc = reinterpret_cast<const __m128i*>(scales + g * kHalf);
    _mm512_store_si512(out.sc[g], _mm512_cvtepu8_epi32(_mm_loadu_si128(sc)));
  }
  for (int64_t i = 0; i < kGroups / 2; ++i) {
    const auto* even = reinterpret_cast<const __m128i*>(scales + (kGroups + 2 * i) * kHalf);
    const auto* odd = reinterpret_cast<const __m128i*>(scales + (kGroups + 2 * i + 1) * kHalf);
    const __m512i pair = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128(even)),
                                         _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(odd)), 16));
    _mm512_store_si512(out.m[i], pair);
  }
  _mm512_store_ps(out.d, _mm512_loadu_ps(d));
  _mm512_store_ps(out.dmin, _mm512_loadu_ps(d + kHalf * 4));
}

// R rows' sums over one record's `used` sub-blocks (fewer than 8 only past the end of a row whose width
// is not a multiple of 256: there the activations are zeros, so their sums are zero and the mins' term
// needs no bound) (both halves: each broadcast of activations serves the two), added to
// their accumulators acc[r * 32 + column]: per row and column, the exact int32 sums
// sum_g sc_g * (q_g . x_g) and sum_g m_g * sum(x_g), then one multiply-add each by d and dmin. The
// codes come unpacked from w (read by several blocks of rows), or, when the record has one block of
// rows, straight from the record (unpacked in registers). Each output column gets the same
// operations, the integer ones exact, in the same order whatever R and the codes' source are.
template <int R, bool kFromRecord>
void rows_block(const UnpackedHalf* w, const uint8_t* record, const int8_t* xq, int64_t k, const int16_t* xsums,
                int64_t groups, int64_t used, float* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i scaled[R][2];
  for (int r = 0; r < R; ++r) scaled[r][0] = scaled[r][1] = _mm512_setzero_si512();
  for (int64_t g = 0; g < used; ++g) {
    __m512i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 8; j += 2) {  // 8 weights: 4 in the low nibbles, the next 4 in the high
      __m512i codes[2][2];  // [half][nibble]
      for (int c = 0; c < 2; ++c) {
        if constexpr (kFromRecord) {
          const __m512i v = _mm512_loadu_si512(record + c * used * kGroupCodeBytes + (g * 4 + j / 2) * 64);
          codes[c][0] = _mm512_and_si512(v, low);
          codes[c][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          codes[c][0] = _mm512_load_si512(w[c].codes[g][j]);
          codes[c][1] = _mm512_load_si512(w[c].codes[g][j + 1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < 2; ++n) {
          const __m512i x = broadcast4(xq + r * k + g * kGroup + (j + n) * 4);
          s[r][0] = _mm512_dpbusd_epi32(s[r][0], codes[0][n], x);
          s[r][1] = _mm512_dpbusd_epi32(s[r][1], codes[1][n], x);
        }
      }
    }
    for (int c = 0; c < 2; ++c) {
      const __m512i sc = _mm512_load_si512(w[c].sc[g]);
      for (int r = 0; r < R; ++r) scaled[r][c] = _mm512_add_epi32(scaled[r][c], _mm512_mullo_epi32(s[r][c], sc));
    }
  }
  for (int c = 0; c < 2; ++c) {
    const __m512 d = _mm512_load_ps(w[c].d);
    const __m512 dmin = _mm512_load_ps(w[c].dmin);
    for (int r = 0; r < R; ++r) {
      __m512i mins = _mm512_setzero_si512();
      for (int64_t i = 0; i < kGroups / 2; ++i) {
        mins = _mm512_dpwssd_epi32(mins, _mm512_load_si512(w[c].m[i]), broadcast4(xsums + r * groups + 2 * i));
      }
      float* a = acc + r * kTile + c * kHalf;
      __m512 f = _mm512_loadu_ps(a);
      f = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(scaled[r][c]), f);
      f = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(mins), f);
      _mm512_storeu_ps(a, f);
    }
  }
}

using RowsBlockFn = void (*)(const UnpackedHalf*, const uint8_t*, const int8_t*, int64_t, const int16_t*, int64_t,
                             int64_t, float*);

template <bool kFromRecord, int... R>
constexpr std::array<RowsBlockFn, sizeof...(R) + 1> rows_blocks(std::integer_sequence<int, R...>) {
  return {nullptr, rows_block<R + 1, kFromRecord>...};
}

constexpr auto kFromRecordRows = rows_blocks<true>(std::make_integer_sequence<int, kRowBlock>{});
constexpr auto kUnpackedRows = rows_blocks<false>(std::make_integer_sequence<int, kRowBlock>{});

// Every row against one record (super-block s), in as few blocks as fit the registers, of sizes that
// differ by one at most (13 rows: 5, 4, 4). Up to kBlocksFromRecord blocks each unpack the codes in
// registers; more share them unpacked once into w (measured: the first is faster up to ~16 rows).
void all_rows(UnpackedHalf* w, const uint8_t* record, const QuantisedRows& xq, int64_t m_rows, int64_t k,
              int64_t s, int64_t used, float* acc) {
  const int64_t groups = k / kGroup;
  const int64_t blocks = (m_rows + kRowBlock - 1) / kRowBlock;
  unpack_scales(record, 0, used, w[0]);
  unpack_scales(record, 1, used, w[1]);
  const bool from_record = blocks <= kBlocksFromRecord;
  if (!from_record) {
    unpack_codes(record, 0, used, w[0]);
    unpack_codes(record, 1, used, w[1]);
  }
  const RowsBlockFn* fns = from_record ? kFromRecordRows.data() : kUnpackedRows.data();
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = m_rows / blocks + (b < m_rows % blocks ? 1 : 0);
    fns[rows](w, record, xq.q.data() + m0 * k + s * kSuper, k, xq.sums.data() + m0 * groups + s * kGroups, groups,
              used, acc + m0 * kTile);
    m0 += rows;
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) % kGroup == 0, "x must be [M, K], K a multiple of 32");
  const int64_t k_in = x.size(1);  // the layer's width: its last super-block may hold fewer sub-blocks
  const int64_t supers = (k_in + kSuper - 1) / kSuper;
  const int64_t k = supers * kSuper;
  const int64_t last_used = (k_in - (k - kSuper)) / kGroup;  // sub-blocks in the last super-block
  return marspec_kernels::tiled_linear<kGroup>(
      x, k, blocks, supers, kRecord, record_bytes(last_used), out_features, bias,
      [&](const uint8_t* record, int64_t s, const QuantisedRows& xq, float* acc) {
        UnpackedHalf w[2];
        const int64_t used = s + 1 < supers ? kGroups : last_used;
        all_rows(w, record, xq, static_cast<int64_t>(xq.scale.size()), k, s, used, acc);
      });
}

}  // namespace

TORCH_LIBRARY(marspec_q4k, m) {
  m.def("linear(Tensor x, Tensor blocks, int out_features, Tensor? bias) -> Tensor", &linear);
}
