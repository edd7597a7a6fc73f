// GGUF Q4_K weights as the kernels read them (torch-free): the packed record's layout and the format's
// part of the inner loop (tile_rows.h).
//
// Per 256-weight super-block, the sub-blocks' sums times their 6-bit scales, and the activations'
// sub-block sums times the 6-bit mins, are added exactly in int32; then y += d * float(first) -
// dmin * float(second) in float32, super-block after super-block.
//
// Packed layout (built in marspec/backends/q4k.py from GGUF Q4_K blocks): blocks, uint8 [T, bytes] for
// T = ceil(N / 32) tiles of 32 output columns of a layer K wide (a multiple of 32), each tile the
// records of its S = ceil(K / 256) super-blocks one after the other, so a thread reads one sequential
// stream. A record is the super-block of two halves of 16 columns (16 lanes), each field for half 0 then
// half 1:
//   codes  2 x 256 bytes a sub-block: per sub-block g and 8-weight chunk c (4), 64 bytes: byte 4*j + b
//          holds column j's code for weight 8*c + b in its low nibble and for 8*c + 4 + b in its high
//          nibble (so one AND / one shift give the dot product's 4 consecutive weights of 16 columns);
//   scales 2 x 256 bytes: the 6-bit sub-block scales sc [8][16], then the mins m [8][16];
//   d      2 x 128 bytes: float32 (little-endian) d [16], then dmin [16].
// A record holds the codes of the sub-blocks that hold weights: all 8 (4864 bytes), except in the last
// super-block of a layer whose width is not a multiple of 256 (the draft's 896: 3.5 super-blocks), which
// holds only its first K % 256 / 32, so no padding is stored or read. A weight is d * sc * q - dmin * m
// (ggml's Q4_K). 4.75 bits a weight.

#pragma once

#include "rows.h"

#include <cstdint>

namespace marspec_kernels {

struct Q4K {
  static constexpr int64_t kHalf = kLanes;  // output columns in a half
  static constexpr int64_t kSuper = 256;
  static constexpr int64_t kGroup = 32;
  static constexpr int64_t kGroups = kSuper / kGroup;
  static constexpr int kChunks = 4;      // 64-byte code vectors a half's sub-block
  static constexpr int kChunkSteps = 2;  // each gives two steps of 4 weights: low nibbles, high nibbles
  static constexpr bool kCostlyCodes = false;  // a step's codes: an AND, and a shift for every other
  static constexpr int64_t kGroupCodeBytes = kGroup * kHalf / 2;  // a half's codes of one sub-block
  static constexpr int64_t kScaleBytes = 2 * kGroups * kHalf;      // a half's sc and m
  static constexpr int64_t kDBytes = 2 * kHalf * 4;                // a half's d and dmin
  // A record whose first `used` sub-blocks hold weights.
  static constexpr int64_t record_bytes(int64_t used) { return 2 * (used * kGroupCodeBytes + kScaleBytes + kDBytes); }
  static constexpr int64_t kRecord = 2 * (kGroups * kGroupCodeBytes + kScaleBytes + kDBytes);

  struct Half {
    alignas(64) uint8_t codes[kGroups][8][64];  // [sub-block][4-weight step][16 columns x 4 codes]
    alignas(64) int32_t sc[kGroups][kHalf];     // the sub-block scales
    alignas(64) int32_t m[kGroups / 2][kHalf];  // the mins of sub-blocks 2i, 2i + 1 as int16 pairs
    alignas(64) float d[kHalf];
    alignas(64) float dmin[kHalf];
  };

  static const uint8_t* codes_of(const uint8_t* record, int half, int64_t used) {
    return record + half * used * kGroupCodeBytes;
  }
  // A half's scales (its sc, then its m, 8 x 16 bytes each) and d, dmin: where they start.
  static const uint8_t* scales_of(const uint8_t* record, int half, int64_t used) {
    return record + 2 * used * kGroupCodeBytes + half * kScaleBytes;
  }
  static const uint8_t* d_of(const uint8_t* record, int half, int64_t used) {
    return record + 2 * (used * kGroupCodeBytes + kScaleBytes) + half * kDBytes;
  }

  static void chunk_codes(const uint8_t* record, int half, int64_t used, int64_t g, int chunk, I32 out[2]) {
    const I32 v = load(codes_of(record, half, used) + (g * kChunks + chunk) * 64);
    const I32 low = set1_bytes(0x0F);
    out[0] = and_(v, low);
    out[1] = and_(srli16<4>(v), low);
  }

  // A half's mins as int16 pairs (sub-blocks 2i, 2i + 1), its d and dmin (the AMX path's halves too).
  template <class H>
  static void unpack_mins_and_d(const uint8_t* record, int half, int64_t used, H& out) {
    const uint8_t* mins = scales_of(record, half, used) + kGroups * kHalf;
    for (int64_t i = 0; i < kGroups / 2; ++i) {
      store(out.m[i], or_(widen_u8(mins + 2 * i * kHalf), slli32<16>(widen_u8(mins + (2 * i + 1) * kHalf))));
    }
    const auto* ds = reinterpret_cast<const float*>(d_of(record, half, used));
    storef(out.d, loadf(ds));
    storef(out.dmin, loadf(ds + kHalf));
  }

  static void unpack(const uint8_t* record, int half, int64_t used, Half& out, bool with_codes) {
    const uint8_t* scales = scales_of(record, half, used);
    for (int64_t g = 0; g < kGroups; ++g) store(out.sc[g], widen_u8(scales + g * kHalf));
    unpack_mins_and_d(record, half, used, out);
    if (!with_codes) return;
    for (int64_t g = 0; g < used; ++g) {
      for (int c = 0; c < kChunks; ++c) {
        I32 steps[2];
        chunk_codes(record, half, used, g, c, steps);
        store(out.codes[g][2 * c], steps[0]);
        store(out.codes[g][2 * c + 1], steps[1]);
      }
    }
  }

  static I32 group_start(int16_t) { return zero(); }
  // Steps of 4 weights whose products add up in int16 pairs where a path sums so (kPairSums): a whole
  // sub-block, 8 steps of |pair| <= 2 * 15 * 127, from its start, zero.
  static constexpr int kPairSteps = 8;
  static_assert(kPairSteps * 2 * 15 * 127 <= INT16_MAX);

  // acc += d * scaled, then acc -= dmin * mins, mins = sum_g m_g * sum(x_g) (exact int32).
  template <class H>
  static void finish(const H& w, I32 scaled, const int16_t* xsums, float* acc) {
    I32 mins = zero();
    for (int64_t i = 0; i < kGroups / 2; ++i) mins = dot_i16(mins, load(w.m[i]), broadcast4(xsums + 2 * i));
    F32 f = loadf(acc);
    f = fmadd(loadf(w.d), to_float(scaled), f);
    f = fnmadd(loadf(w.dmin), to_float(mins), f);
    storef(acc, f);
  }
};

}  // namespace marspec_kernels
