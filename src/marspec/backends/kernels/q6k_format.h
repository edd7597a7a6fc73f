// GGUF Q6_K weights as the kernels read them (torch-free): the packed record's layout and the format's
// part of the inner loop (tile_rows.h).
//
// Per 256-weight super-block, sum_j sc_j * (q_j . x_j - 32 * sum(x_j)) over its sixteen 16-weight
// sub-blocks j (sc_j the signed int8 scales, q the 6-bit codes 0..63) is exact in int32 (|.| < 2^28);
// then y += d * float(that) in float32, super-block after super-block.
//
// Packed layout (built in marspec/backends/q6k.py from GGUF Q6_K blocks): blocks, uint8
// [T, S, 6720] for T = ceil(N / 32) tiles of 32 output columns and S = K / 256 super-blocks. A tile's
// records follow each other, so a thread reads one sequential stream. A record is the super-block of
// two halves of 16 columns (16 lanes), each field for half 0 then half 1:
//   codes  2 x 3072 bytes: per sub-block j (16), 192 bytes: two 64-byte nibble vectors p (0, 1) whose
//          byte 4*c + b holds the low 4 bits of column c's code for weight 16j + 8p + b in its low
//          nibble and for 16j + 8p + 4 + b in its high nibble, then one 64-byte vector whose byte
//          4*c + b holds the top 2 bits of the codes for weights 16j + 4i + b in its bits 2i, 2i + 1
//          (i = 0..3); so a few ANDs and shifts give the dot product's 4 consecutive weights of 16 columns;
//   scales 2 x 256 bytes: the int8 sub-block scales sc [16][16];
//   d      2 x 32 bytes: fp16 (little-endian) d [16].
// A weight is d * sc * (q - 32) (ggml's Q6_K). 210 bytes a 256-weight column: the GGUF's own 6.5625
// bits a weight.

#pragma once

#include "rows.h"

#include <cstdint>

namespace marspec_kernels {

struct Q6K {
  static constexpr int64_t kHalf = kLanes;
  static constexpr int64_t kSuper = 256;
  static constexpr int64_t kGroup = 16;
  static constexpr int64_t kGroups = kSuper / kGroup;
  static constexpr int kChunks = 1;       // a sub-block's codes come in one piece: 3 vectors, 4 steps
  static constexpr int kChunkSteps = 4;
  static constexpr int64_t kGroupCodeBytes = 3 * 64;
  static constexpr int64_t kCodeBytes = kGroups * kGroupCodeBytes;  // a half's codes in a record
  static constexpr int64_t kScaleBytes = kGroups * kHalf;           // a half's sc
  static constexpr int64_t kDBytes = kHalf * 2;                     // a half's d (fp16)
  static constexpr int64_t kRecord = 2 * (kCodeBytes + kScaleBytes + kDBytes);
  static constexpr int64_t record_bytes(int64_t) { return kRecord; }  // every record holds all its sub-blocks
  static_assert(kRecord == 32 * 210, "a record holds the GGUF's bytes of its 32 columns");
  static constexpr int32_t kOffset = 32;  // a weight is sc * (q - 32)
  static constexpr bool kCostlyCodes = true;  // a step's codes from three vectors: 4-5 operations

  struct Half {
    alignas(64) uint8_t codes[kGroups][kChunkSteps][64];  // [sub-block][4-weight step][16 columns x 4 codes]
    alignas(64) int32_t sc[kGroups][kHalf];
    alignas(64) float d[kHalf];
  };

  static const uint8_t* codes_of(const uint8_t* record, int half) { return record + half * kCodeBytes; }
  static const uint8_t* scales_of(const uint8_t* record, int half) { return record + 2 * kCodeBytes + half * kScaleBytes; }
  static const uint16_t* d_of(const uint8_t* record, int half) {
    return reinterpret_cast<const uint16_t*>(record + 2 * (kCodeBytes + kScaleBytes) + half * kDBytes);
  }

  // Step i's codes (weights 4i..4i+3 of a sub-block) from the sub-block's nibble and top-bit vectors.
  template <int kStep>
  static I32 step_codes(const I32 nibbles[2], I32 top) {
    const I32 v = nibbles[kStep / 2];
    const I32 low = (kStep % 2 == 0) ? and_(v, set1_bytes(0x0F)) : and_(srli16<4>(v), set1_bytes(0x0F));
    // The step's 2 bits moved to bits 4-5 of each byte (16-bit shifts: the masked bits are the byte's own).
    I32 high;
    if constexpr (kStep == 0) high = slli16<4>(top);
    else if constexpr (kStep == 1) high = slli16<2>(top);
    else if constexpr (kStep == 2) high = top;
    else high = srli16<2>(top);
    return or_(and_(high, set1_bytes(0x30)), low);
  }

  static void group_codes(const uint8_t* group, I32 out[kChunkSteps]) {
    const I32 nibbles[2] = {load(group), load(group + 64)};
    const I32 top = load(group + 128);
    out[0] = step_codes<0>(nibbles, top);
    out[1] = step_codes<1>(nibbles, top);
    out[2] = step_codes<2>(nibbles, top);
    out[3] = step_codes<3>(nibbles, top);
  }

  static void chunk_codes(const uint8_t* record, int half, int64_t, int64_t g, int, I32 out[kChunkSteps]) {
    group_codes(codes_of(record, half) + g * kGroupCodeBytes, out);
  }

  static void unpack(const uint8_t* record, int half, int64_t, Half& out, bool with_codes) {
    const auto* scales = reinterpret_cast<const int8_t*>(scales_of(record, half));
    for (int64_t j = 0; j < kGroups; ++j) store(out.sc[j], widen_i8(scales + j * kHalf));
    storef(out.d, halfs(d_of(record, half)));
    if (!with_codes) return;
    for (int64_t j = 0; j < kGroups; ++j) {
      I32 steps[kChunkSteps];
      group_codes(codes_of(record, half) + j * kGroupCodeBytes, steps);
      for (int i = 0; i < kChunkSteps; ++i) store(out.codes[j][i], steps[i]);
    }
  }

  // Each sub-block's dot product starts from -32 * sum(x_j) (rather than a chain of offsets after the
  // record's last dot product: 11% faster at 13 rows): |q_j . x_j - 32 * sum(x_j)| <= 16 * 32 * 127.
  static I32 group_start(int16_t xsum) { return set1(-kOffset * xsum); }
  // Its dot products go into int32 each step on every path (kPairSteps 0): two steps at most would fit
  // in int16 pairs (2 * 2 * 63 * 127), and no measurement yet says that pays on AVX2.
  static constexpr int kPairSteps = 0;

  template <class H>
  static void finish(const H& w, I32 scaled, const int16_t*, float* acc) {
    storef(acc, fmadd(loadf(w.d), to_float(scaled), loadf(acc)));
  }
};

}  // namespace marspec_kernels
