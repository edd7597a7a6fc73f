// The linear kernels' inner loop, written once for every weight format (q4k_format.h, q6k_format.h) and
// every instruction set (simd.h): a block of activation rows against one record (one super-block of a
// tile of 32 output columns), exact integer sums, then the format's float finish. Torch-free, so the
// standalone harness runs it too.
//
// A format F gives: kGroup (weights a sub-block: one scale), kGroups (sub-blocks a super-block), kChunks
// and kChunkSteps (a sub-block's codes come in kChunks chunks of kChunkSteps steps of 4 weights), Half
// (a record's half unpacked: codes[g][step][64 bytes], sc[g][16] and its own fields), and
//   unpack(record, half, used, out, with_codes): a half's scales (and codes) into a Half;
//   kCostlyCodes: whether unpacking its codes takes many operations a step (codes_from_record);
//   chunk_codes(record, half, used, g, chunk, out[kChunkSteps]): a chunk's codes read from the record;
//   group_start(xsum): a sub-block's dot product's start from its activations' sum;
//   finish(half, scaled, xsums, acc): the 16 columns' floats after the record, from the exact int32
//     scaled = sum_g sc_g * (group_start + codes . x) and the row's sub-block sums xsums.
// Every output column gets the same operations, the integer ones exact, in the same order, whatever the
// number of rows, the row block, the codes' source or the instruction set: a row's output is the same
// bits in any call on any path.

#pragma once

#include "rows.h"

#include <array>
#include <cstdint>
#include <utility>

namespace marspec_kernels {

// R rows against one record, sub-block after sub-block. Each 4-weight step's products go into int32
// (dot_u8s8) from the sub-block's start, then times its scale (mullo); or, where the path sums in int16
// pairs (kPairSums) and the format allows it (kPairSteps > 0, sub-blocks starting from zero), F::kPairSteps
// steps' pairs are added in int16 and widened by the scale in one dot_i16: the same integers. One body,
// not helpers: split into functions taking the sums by pointer, an AVX2 build kept them on the stack (its
// Q6_K layers 20-30% slower), and always inlined, the AVX-512 build's 13-row calls ran ~10% slower.
template <class F, int R, bool kFromRecord>
void rows_block(const typename F::Half* w, const uint8_t* record, const int8_t* xq, int64_t k, const int16_t* xsums,
                int64_t groups, int64_t used, float* acc, bool requests) {
  constexpr bool kPairs = kPairSums && F::kPairSteps > 0;
  static_assert(!kPairs || (F::kChunks * F::kChunkSteps) % F::kPairSteps == 0);
  I32 scaled[R][2];
  for (int r = 0; r < R; ++r) scaled[r][0] = scaled[r][1] = zero();
  const int64_t record_bytes = F::record_bytes(used);
  for (int64_t g = 0; g < used; ++g) {
    if (requests) {  // the stream kRecordsAhead records on, a part a sub-block (spreads_requests)
      const Requested ahead = requested_ahead(record, record_bytes, F::kRecord);
      if constexpr (kPrefetchLevel == 1) prefetch_part(ahead.start, ahead.bytes, g, used);
      else prefetch_part_l2(ahead.start, ahead.bytes, g, used);
    }
    I32 s[R][2];
    I32 sc[2];  // kPairs: the scale in both int16 of each lane
    if constexpr (kPairs) {
      for (int c = 0; c < 2; ++c) {
        const I32 v = load(w[c].sc[g]);
        sc[c] = or_(and_(v, set1(0xFFFF)), slli32<16>(v));
      }
    } else {
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = F::group_start(xsums[r * groups + g]);
    }
    for (int ch = 0; ch < F::kChunks; ++ch) {
      I32 codes[2][F::kChunkSteps];  // [half][step]
      for (int c = 0; c < 2; ++c) {
        if constexpr (kFromRecord) {
          F::chunk_codes(record, c, used, g, ch, codes[c]);
        } else {
          for (int i = 0; i < F::kChunkSteps; ++i) codes[c][i] = load(w[c].codes[g][ch * F::kChunkSteps + i]);
        }
      }
      for (int i = 0; i < F::kChunkSteps; ++i) {
        const int step = ch * F::kChunkSteps + i;
        for (int r = 0; r < R; ++r) {
          const I32 x = broadcast4(xq + r * k + g * F::kGroup + step * 4);
          if constexpr (kPairs) {
            for (int c = 0; c < 2; ++c) {
              const I32 pairs = pairs_u8s8(codes[c][i], x);
              s[r][c] = step % F::kPairSteps == 0 ? pairs : add16(s[r][c], pairs);
            }
          } else {
            s[r][0] = dot_u8s8(s[r][0], codes[0][i], x);
            s[r][1] = dot_u8s8(s[r][1], codes[1][i], x);
          }
        }
        if constexpr (kPairs) {
          if (step % F::kPairSteps == F::kPairSteps - 1) {
            for (int r = 0; r < R; ++r) {
              for (int c = 0; c < 2; ++c) scaled[r][c] = dot_i16(scaled[r][c], s[r][c], sc[c]);
            }
          }
        }
      }
    }
    if constexpr (!kPairs) {
      for (int c = 0; c < 2; ++c) {
        const I32 scale = load(w[c].sc[g]);
        for (int r = 0; r < R; ++r) scaled[r][c] = add(scaled[r][c], mullo(s[r][c], scale));
      }
    }
  }
  for (int c = 0; c < 2; ++c) {
    for (int r = 0; r < R; ++r) F::finish(w[c], scaled[r][c], xsums + r * groups, acc + r * kTileColumns + c * kLanes);
  }
}

template <class F>
using RowsBlockFn = void (*)(const typename F::Half*, const uint8_t*, const int8_t*, int64_t, const int16_t*, int64_t,
                             int64_t, float*, bool);

template <class F, bool kFromRecord, int... R>
constexpr std::array<RowsBlockFn<F>, sizeof...(R) + 1> rows_blocks(std::integer_sequence<int, R...>) {
  return {nullptr, rows_block<F, R + 1, kFromRecord>...};
}

// Up to this many blocks of rows each read the codes from the record (unpacking them in registers); more
// share them unpacked once into a buffer (measured on AVX-512: the first is faster up to ~16 rows).
#ifdef MARSPEC_BLOCKS_FROM_RECORD  // a build that tries another (benchmarks/kernel_variants.py)
constexpr int64_t kBlocksFromRecord = MARSPEC_BLOCKS_FROM_RECORD;
#else
constexpr int64_t kBlocksFromRecord = 3;
#endif

// A format whose codes are costly to unpack (F::kCostlyCodes: Q6_K's, ~4 operations a step from three
// vectors, against Q4_K's 1.5) on a path of two-row blocks (AVX2, NEON): a block's rows do too little work
// to hide the unpacking, so past the first block the rows share the codes unpacked once into the buffer
// (AVX2 on AMD EPYC Zen 4, Q6_K layers at 3-5 rows: 0.80-0.93x the time). With blocks of 6 rows (AVX-512)
// the two measured level.
#ifdef MARSPEC_COSTLY_BLOCKS_FROM_RECORD  // a build that tries another (benchmarks/kernel_variants.py)
constexpr int64_t kCostlyBlocksFromRecord = MARSPEC_COSTLY_BLOCKS_FROM_RECORD;
#else
constexpr int64_t kCostlyBlocksFromRecord = kRowBlock <= 2 ? 1 : kBlocksFromRecord;
#endif

// The blocks of rows that m_rows rows take (as few as fit the registers).
inline int64_t row_blocks(int64_t m_rows) { return (m_rows + kRowBlock - 1) / kRowBlock; }

// Whether all_rows reads m_rows rows' codes from the record in each block of rows (a few rows), rather
// than unpacking them once into a buffer (many: a prompt's chunk).
template <class F>
inline bool codes_from_record(int64_t m_rows) {
  return row_blocks(m_rows) <= (F::kCostlyCodes ? kCostlyBlocksFromRecord : kBlocksFromRecord);
}

// Whether all_rows requests the weights kRecordsAhead records on itself, spread over the first block of
// rows' sub-blocks (rows.h's kSpreadRequests): for a step's or a verification's rows (up to 16, the
// longest verification the draft length is chosen from). For a prompt's chunk a record's work is long;
// spread over its first block there, the requests measured 1.1-1.2x slower than all at the record's
// start on Q6_K layers at 64-256 rows (kernel_variants.py).
constexpr int64_t kSpreadRows = 16;
inline bool spreads_requests(int64_t m_rows) { return kSpreadRequests && m_rows <= kSpreadRows; }

// Every row (m_rows of them, quantised in xq, rows k apart) against one record (super-block s, its first
// `used` sub-blocks holding weights), in as few blocks as fit the registers, of sizes that differ by one
// at most (13 rows in blocks of 6: 5, 4, 4); the sums added to acc [m_rows, 32]. w: a thread's two Halves.
template <class F>
void all_rows(typename F::Half* w, const uint8_t* record, const QuantisedRows& xq, int64_t m_rows, int64_t k,
              int64_t s, int64_t used, float* acc) {
  static constexpr auto kFromRecordRows = rows_blocks<F, true>(std::make_integer_sequence<int, kRowBlock>{});
  static constexpr auto kUnpackedRows = rows_blocks<F, false>(std::make_integer_sequence<int, kRowBlock>{});
  const int64_t groups = k / F::kGroup;
  const int64_t blocks = row_blocks(m_rows);
  const bool from_record = codes_from_record<F>(m_rows);
  const bool requests = spreads_requests(m_rows);
  F::unpack(record, 0, used, w[0], !from_record);
  F::unpack(record, 1, used, w[1], !from_record);
  const RowsBlockFn<F>* fns = from_record ? kFromRecordRows.data() : kUnpackedRows.data();
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = m_rows / blocks + (b < m_rows % blocks ? 1 : 0);
    fns[rows](w, record, xq.q.data() + m0 * k + s * F::kSuper, k, xq.sums.data() + m0 * groups + s * F::kGroups,
              groups, used, acc + m0 * kTileColumns, requests && b == 0);
    m0 += rows;
  }
}

}  // namespace marspec_kernels
