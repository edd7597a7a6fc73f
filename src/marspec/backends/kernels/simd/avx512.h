// The kernels' vector operations on AVX-512 (F, BW, VL, VNNI): each vector is one zmm. See simd.h for
// what every operation computes; every path computes exactly that, so a row's bits do not depend on it.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace marspec_simd {

constexpr const char* kPathName = "avx512_vnni";
// Rows whose int32 sums stay in the 32 vector registers (4 a row, and the codes beside them).
#ifdef MARSPEC_ROW_BLOCK  // a build that tries another (benchmarks/kernel_variants.py)
constexpr int kRowBlock = MARSPEC_ROW_BLOCK;
#else
constexpr int kRowBlock = 6;
#endif
// vpdpbusd sums four products straight into int32, as fast as maddubs makes pairs: no int16 pair sums
// (widened by vpdpwssd, measured on AMD EPYC Zen 4: 13-row Q4_K calls 1.09-1.23x the time, Q6_K level).
#ifdef MARSPEC_PAIR_SUMS  // a build that tries the other (benchmarks/kernel_variants.py)
constexpr bool kPairSums = MARSPEC_PAIR_SUMS;
#else
constexpr bool kPairSums = false;
#endif

struct I32 {
  __m512i v;
};
struct F32 {
  __m512 v;
};

inline I32 zero() { return {_mm512_setzero_si512()}; }
inline I32 load(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void store(void* p, I32 a) { _mm512_storeu_si512(p, a.v); }
inline I32 set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I32 set1_bytes(uint8_t x) { return {_mm512_set1_epi8(static_cast<char>(x))}; }
inline I32 and_(I32 a, I32 b) { return {_mm512_and_si512(a.v, b.v)}; }
inline I32 or_(I32 a, I32 b) { return {_mm512_or_si512(a.v, b.v)}; }
template <int N> inline I32 srli16(I32 a) { return {_mm512_srli_epi16(a.v, N)}; }
template <int N> inline I32 slli16(I32 a) { return {_mm512_slli_epi16(a.v, N)}; }
template <int N> inline I32 slli32(I32 a) { return {_mm512_slli_epi32(a.v, N)}; }
inline I32 add(I32 a, I32 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I32 mullo(I32 a, I32 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline I32 dot_u8s8(I32 acc, I32 u, I32 s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
inline I32 dot_i16(I32 acc, I32 a, I32 b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
inline I32 pairs_u8s8(I32 u, I32 s) { return {_mm512_maddubs_epi16(u.v, s.v)}; }
inline I32 add16(I32 a, I32 b) { return {_mm512_add_epi16(a.v, b.v)}; }
inline I32 widen_u8(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline I32 widen_i8(const int8_t* p) {
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline int32_t reduce_add(I32 a) { return _mm512_reduce_add_epi32(a.v); }

inline F32 zerof() { return {_mm512_setzero_ps()}; }
inline F32 loadf(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void storef(float* p, F32 a) { _mm512_storeu_ps(p, a.v); }
inline F32 set1f(float x) { return {_mm512_set1_ps(x)}; }
inline F32 to_float(I32 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F32 halfs(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void store_halfs(uint16_t* p, F32 a) {
  const __m256i h = _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
inline F32 addf(F32 a, F32 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32 subf(F32 a, F32 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32 mulf(F32 a, F32 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32 divf(F32 a, F32 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F32 fnmadd(F32 a, F32 b, F32 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F32 maxf(F32 a, F32 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F32 absf(F32 a) { return {_mm512_abs_ps(a.v)}; }
inline F32 round_even(F32 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for whole n in [-126, 127] (exact powers of two: one rounding, as scalef's).
inline F32 times_pow2(F32 a, F32 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// Rounded to the nearest int32 (ties to even), then saturated to int8, stored as 16 bytes; the int32s returned.
inline I32 store_int8(int8_t* p, F32 a) {
  const __m512i i = _mm512_cvtps_epi32(a.v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(i));
  return {i};
}

// The sum of the 16 lanes in a fixed tree, the same on every path: lanes i and i + 8, then i and i + 4,
// then i and i + 2, then the two left.
inline float reduce_addf(F32 a) {
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  const __m256 eight = _mm256_add_ps(lo, hi);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}
// Lane j: reduce_addf(v[j]), the same tree for each of the 16 vectors, taken four levels at a time for
// all of them (a lane's pairs are added as reduce_addf adds them; only the shuffles that line them up differ).
inline F32 reduce_addf16(const F32* v) {
  __m512 eight[8];  // vector p: v[2p]'s lanes i + i + 8 in lanes 0-7, v[2p + 1]'s in lanes 8-15
  for (int p = 0; p < 8; ++p) {
    const __m512 a = v[2 * p].v, b = v[2 * p + 1].v;
    eight[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 four[4];  // vector r, quarter k: v[4r + k]'s four sums
  for (int r = 0; r < 4; ++r) {
    const __m512 a = eight[2 * r], b = eight[2 * r + 1];
    four[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  __m512 two[2];  // vector s, quarter k: v[8s + k]'s two sums, then v[8s + 4 + k]'s
  for (int s = 0; s < 2; ++s) {
    const __m512 a = four[2 * s], b = four[2 * s + 1];
    two[s] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Quarter k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k]; then each put in its own lane.
  const __m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, one)};
}
// The largest lane (no lane a NaN).
inline float reduce_maxf(F32 a) { return _mm512_reduce_max_ps(a.v); }

struct Mask {
  __mmask16 m;
};
inline Mask greaterf(F32 a, F32 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline Mask unorderedf(F32 a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}; }
inline Mask or_mask(Mask a, Mask b) { return {static_cast<__mmask16>(a.m | b.m)}; }
inline bool any(Mask a) { return a.m != 0; }
inline F32 selectf(Mask m, F32 a, F32 b) { return {_mm512_mask_blend_ps(m.m, b.v, a.v)}; }
inline I32 select(Mask m, I32 a, I32 b) { return {_mm512_mask_blend_epi32(m.m, b.v, a.v)}; }
inline I32 lane_indices() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }

}  // namespace marspec_simd
