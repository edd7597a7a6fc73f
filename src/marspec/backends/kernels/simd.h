// The vector operations the kernels are written in, one header per instruction set (simd/*.h), chosen by
// the macro the build defines: MARSPEC_ISA_AVX512 (AVX-512 F/BW/VL/VNNI; the AMX path rides on it),
// MARSPEC_ISA_AVX2 (AVX2, FMA, F16C; with MARSPEC_AVX_VNNI, AVX-VNNI's dot products) or MARSPEC_ISA_NEON
// (Armv8.2-A with dotprod). This is the kernels' interface to the machine: every path implements each
// operation below with the same result, bit for bit, so a kernel written once in them gives the same bits
// on every CPU.
//
// I32: 16 int32 lanes (64 bytes; also read as 64 bytes or 32 int16). F32: 16 float lanes.
//   zero, load (64 unaligned bytes), store, set1 (int32), set1_bytes, and_, or_,
//   srli16<N> / slli16<N> (each 16-bit word shifted, zeros in), slli32<N>, add, mullo (low 32 bits),
//   dot_u8s8(acc, u, s): acc + the sum of the 4 products of u's unsigned and s's signed bytes in each
//     lane, exact where each pair of products fits in int16 (the kernels' codes: at most 63 * 127 * 2),
//   dot_i16(acc, a, b): acc + the 2 products of a's and b's int16 pairs in each lane,
//   pairs_u8s8(u, s): each int16 of the result the sum of 2 products of u's unsigned and s's signed bytes
//     (byte pairs 2i, 2i + 1), exact where that fits in int16; add16 (int16 lanes, wrapping),
//   widen_u8 / widen_i8 (16 bytes -> 16 lanes), reduce_add (exact integer sum);
//   zerof, loadf, storef, set1f, to_float (int32 -> float, rounded to nearest), halfs (16 fp16 -> float),
//   store_halfs (16 floats -> fp16, rounded to nearest, ties to even: IEEE's conversion, as torch's),
//   addf, subf, mulf, divf, maxf (no NaN lanes), absf, fmadd(a, b, c) = a * b + c and fnmadd(a, b, c) =
//   c - a * b (fused: one rounding), round_even (to a whole float, ties to even), times_pow2(a, n)
//   (a * 2^n, n whole in [-126, 127]), store_int8 (rounded to int32 as round_even, saturated to int8,
//   16 bytes stored; the int32s returned), reduce_addf (the fixed tree: lanes i and i + 8, then i and
//   i + 4, then i and i + 2, then the last two), reduce_addf16(v) (lane j: reduce_addf(v[j]) of 16 vectors),
//   reduce_maxf (no NaN lanes).
// Mask: a true or false per lane. greaterf(a, b): a > b (false where either is NaN), unorderedf(a): the NaN
//   lanes, or_mask, any (whether a lane is true), selectf / select(m, a, b): a's lane where m, else b's
//   (F32 / I32), lane_indices: the I32 0, 1, ..., 15.
// kRowBlock: how many activation rows a kernel keeps in registers at once (speed only).
// kPairSums: whether the kernels add products in int16 pairs (pairs_u8s8, add16) over several steps and
//   widen them once (dot_i16), rather than dot_u8s8 each step (speed only: the sums are the same integers).
// kPathName: the path's name, as marspec calls it (backends/kernels/paths.py).

#pragma once

#if defined(MARSPEC_ISA_AVX512)
#include "simd/avx512.h"
#elif defined(MARSPEC_ISA_AVX2)
#include "simd/avx2.h"
#elif defined(MARSPEC_ISA_NEON)
#include "simd/neon.h"
#else
#error "define MARSPEC_ISA_AVX512, MARSPEC_ISA_AVX2 or MARSPEC_ISA_NEON"
#endif

#include <cstdint>
#include <cstring>

namespace marspec_simd {

constexpr int kLanes = 16;

// The 4 bytes at p in every 32-bit lane.
inline I32 broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return set1(v);
}

// Requests the 64-byte cache line at p (past a tensor's end a prefetch does not fault): into every cache
// level, or into the core's second level only (prefetch_line_l2).
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_line_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace marspec_simd
