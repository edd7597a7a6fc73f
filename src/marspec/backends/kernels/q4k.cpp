// marspec_q4k::linear: float32 activations x Q4_K weights, with AVX-512 VNNI, or from 8 rows AMX tiles
// (amx.h; the same sums, below).
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

#include "amx.h"
#include "tiled_linear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

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

// 16 bytes at p as the int32 lanes of a zmm.
inline __m512i widened(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A record's half's scales (its sc, then its m, 8 x 16 bytes each) and d, dmin: where they start.
const uint8_t* half_scales(const uint8_t* record, int64_t half, int64_t used) {
  return record + 2 * used * kGroupCodeBytes + half * kScaleBytes;
}
const uint8_t* half_d(const uint8_t* record, int64_t half, int64_t used) {
  return record + 2 * (used * kGroupCodeBytes + kScaleBytes) + half * kDBytes;
}

// A half's mins as int16 pairs (sub-blocks 2i, 2i + 1), its d and dmin: what both paths' rows end with.
void unpack_mins_and_d(const uint8_t* record, int64_t half, int64_t used, int32_t (&m)[kGroups / 2][kHalf],
                       float (&d)[kHalf], float (&dmin)[kHalf]) {
  const uint8_t* mins = half_scales(record, half, used) + kGroups * kHalf;
  for (int64_t i = 0; i < kGroups / 2; ++i) {
    const __m512i even = widened(mins + 2 * i * kHalf), odd = widened(mins + (2 * i + 1) * kHalf);
    _mm512_store_si512(m[i], _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
  }
  const uint8_t* ds = half_d(record, half, used);
  _mm512_store_ps(d, _mm512_loadu_ps(ds));
  _mm512_store_ps(dmin, _mm512_loadu_ps(ds + kHalf * 4));
}

// A half's scales, mins, d and dmin (after the codes of the record's `used` sub-blocks).
void unpack_scales(const uint8_t* record, int64_t half, int64_t used, UnpackedHalf& out) {
  const uint8_t* scales = half_scales(record, half, used);
  for (int64_t g = 0; g < kGroups; ++g) _mm512_store_si512(out.sc[g], widened(scales + g * kHalf));
  unpack_mins_and_d(record, half, used, out.m, out.d, out.dmin);
}

// A row's 16 accumulators a after a record's half: a += d * scaled, then a -= dmin * mins, from the exact
// int32 scaled = sum_g sc_g * (q_g . x_g) and mins = sum_g m_g * sum(x_g). Both kernel paths end a record
// here, so a row's float operations are the same on either.
inline void finish_row(const float* d, const float* dmin, __m512i scaled, __m512i mins, float* a) {
  __m512 f = _mm512_loadu_ps(a);
  f = _mm512_fmadd_ps(_mm512_load_ps(d), _mm512_cvtepi32_ps(scaled), f);
  f = _mm512_fnmadd_ps(_mm512_load_ps(dmin), _mm512_cvtepi32_ps(mins), f);
  _mm512_storeu_ps(a, f);
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
    for (int r = 0; r < R; ++r) {
      __m512i mins = _mm512_setzero_si512();
      for (int64_t i = 0; i < kGroups / 2; ++i) {
        mins = _mm512_dpwssd_epi32(mins, _mm512_load_si512(w[c].m[i]), broadcast4(xsums + r * groups + 2 * i));
      }
      finish_row(w[c].d, w[c].dmin, scaled[r][c], mins, acc + r * kTile + c * kHalf);
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

#if MARSPEC_HAS_AMX
// The AMX path. A tile product sums 64 weights (two sub-blocks) at once, so the sub-block scales go
// into the weights it multiplies: with sc = 8 * hi + lo (hi, lo in 0..7), the products lo * q and
// hi * q (at most 105) are bytes, and over a super-block sum_k x_k * lo_k q_k + 8 * sum_k x_k * hi_k q_k
// = sum_g sc_g * (q_g . x_g), the VNNI path's exact int32 (each sum at most 256 * 127 * 105 in
// magnitude). Each record's codes are scaled once for all rows (a 16-bit multiply gives two bytes'
// products: neither exceeds a byte); a row then needs two sums per half.
using marspec_kernels::kChunk;
using marspec_kernels::kTileRows;
static_assert(kChunk == 2 * kGroup, "a tile product sums two sub-blocks");
constexpr int kScaleBits = 3;  // sc = hi << 3 | lo

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
void amx_unpack(const uint8_t* record, int64_t half, int64_t used, AmxHalf& out, const uint8_t* next) {
  const uint8_t* codes = record + half * used * kGroupCodeBytes;
  const uint8_t* scales = half_scales(record, half, used);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i low_bits = _mm512_set1_epi32((1 << kScaleBits) - 1);
  for (int64_t g = 0; g < used; ++g) {
    marspec_kernels::prefetch_part(next, kRecord, half * used + g, 2 * used);
    // Each column's scale part in both 16-bit words of its lane (its 4 code bytes).
    const __m512i sc = widened(scales + g * kHalf);
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
  unpack_mins_and_d(record, half, used, out.m, out.d, out.dmin);
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

// The `rows` real rows of a block from amx_products' sums: each row's scaled sum and mins, and
// finish_row, as rows_block ends.
void amx_finish(const AmxHalf* w, const int16_t* xsums, int64_t groups, int64_t rows, const int32_t* sums,
                float* acc) {
  for (int c = 0; c < 2; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i lo = _mm512_load_si512(sums + ((2 * c) * kTileRows + r) * kHalf);
      const __m512i hi = _mm512_load_si512(sums + ((2 * c + 1) * kTileRows + r) * kHalf);
      const __m512i scaled = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, kScaleBits));
      __m512i mins = _mm512_setzero_si512();
      for (int64_t i = 0; i < kGroups / 2; ++i) {
        mins = _mm512_dpwssd_epi32(mins, _mm512_load_si512(w[c].m[i]), broadcast4(xsums + r * groups + 2 * i));
      }
      finish_row(w[c].d, w[c].dmin, scaled, mins, acc + r * kTile + c * kHalf);
    }
  }
}
#undef Q4K_AMX_CHUNK
#endif

// What one thread adds per record on its share of a call's tiles: the VNNI path (all_rows), or, where
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
    const int64_t used = s + 1 < supers_ ? kGroups : last_used_;
    const auto m_rows = static_cast<int64_t>(xq.scale.size());
#if MARSPEC_HAS_AMX
    if (block_rows_ > 0) {
      const uint8_t* next = record + (s + 1 < supers_ ? kRecord : record_bytes(last_used_));
      amx_unpack(record, 0, used, amx_.halves[0], next);
      amx_unpack(record, 1, used, amx_.halves[1], next);
      const int64_t groups = k_ / kGroup;
      for (int64_t m0 = 0; m0 < m_rows; m0 += block_rows_) {
        amx_products(amx_.halves, xq.q.data() + m0 * k_ + s * kSuper, k_, used, amx_.sums);
        amx_finish(amx_.halves, xq.sums.data() + m0 * groups + s * kGroups, groups, std::min(block_rows_, m_rows - m0), amx_.sums,
                   acc + m0 * kTile);
      }
      return;
    }
#endif
    all_rows(w_, record, xq, m_rows, k_, s, used, acc);
  }

  // The AMX path's records take long enough that requesting the next one all at their start stalls
  // them (measured: 14-28% slower on the default target's layers at 12-16 rows); it spreads the
  // requests over its sub-blocks.
  bool requests_next_record() const { return block_rows_ > 0; }

 private:
  int64_t k_, supers_, last_used_, block_rows_;
  UnpackedHalf w_[2];
#if MARSPEC_HAS_AMX
  marspec_kernels::AmxThreadState<AmxHalf> amx_;
#endif
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) % kGroup == 0, "x must be [M, K], K a multiple of 32");
  const int64_t k_in = x.size(1);  // the layer's width: its last super-block may hold fewer sub-blocks
  const int64_t supers = (k_in + kSuper - 1) / kSuper;
  const int64_t k = supers * kSuper;
  const int64_t last_used = (k_in - (k - kSuper)) / kGroup;  // sub-blocks in the last super-block
  const auto amx = marspec_kernels::amx_row_blocks(x.size(0), marspec_kernels::amx_min_rows_q4k);
  return marspec_kernels::tiled_linear<kGroup>(x, k, blocks, supers, kRecord, record_bytes(last_used), out_features,
                                               bias, amx.stored_rows,
                                               [&] { return Q4KWorker(k, supers, last_used, amx.block_rows); });
}

}  // namespace

TORCH_LIBRARY(marspec_q4k, m) {
  m.def("linear(Tensor x, Tensor blocks, int out_features, Tensor? bias) -> Tensor", &linear);
}

// The AMX path's switch for the kernels that have one: whether it can run in this process, and the row
// counts from which the Q4_K and Q6_K kernels' calls take it (set_min_rows returns the counts before; 0
// turns a kernel's path off).
TORCH_LIBRARY(marspec_amx, m) {
  m.def("available() -> bool", [] { return marspec_kernels::amx_permitted(); });
  m.def("set_min_rows(int q4k, int q6k) -> int[]", [](int64_t q4k, int64_t q6k) {
    TORCH_CHECK(q4k >= 0 && q6k >= 0, "row counts must be >= 0");
    return std::vector<int64_t>{marspec_kernels::amx_min_rows_q4k.exchange(q4k),
                                marspec_kernels::amx_min_rows_q6k.exchange(q6k)};
  });
}
