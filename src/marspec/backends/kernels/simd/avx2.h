// The kernels' vector operations on AVX2 with FMA and F16C (every x86-64 CPU since 2013-2015), and with
// AVX-VNNI's 256-bit dot products where MARSPEC_AVX_VNNI is defined: each 16-lane vector is two ymm
// (lanes 0-7, 8-15). See simd.h for what every operation computes.
//
// Without VNNI, dot_u8s8 is maddubs (pairs of u8 x s8 into saturating int16) then madd by ones (pairs of
// int16 into int32). It is exact wherever the kernels use it: a pair of products is at most
// 2 * 63 * 127 = 16002 in magnitude (Q6_K's 6-bit codes; Q4_K's 4-bit: 3810), inside int16. So the
// kernels rather add several steps' pairs in int16 first (kPairSums) and widen them once, by the
// sub-block scale, in one madd: the same exact sums with about half the multiplies on Q4_K.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace marspec_simd {

#ifdef MARSPEC_AVX_VNNI
constexpr const char* kPathName = "avx_vnni";
#else
constexpr const char* kPathName = "avx2";
#endif
// 16 ymm registers: one row's sums (both halves) and the codes fit.
#ifdef MARSPEC_ROW_BLOCK  // a build that tries another (benchmarks/kernel_variants.py)
constexpr int kRowBlock = MARSPEC_ROW_BLOCK;
#else
constexpr int kRowBlock = 2;
#endif
#if defined(MARSPEC_AVX_VNNI)
constexpr bool kPairSums = false;
#elif defined(MARSPEC_PAIR_SUMS)  // a build that tries the other (benchmarks/kernel_variants.py)
constexpr bool kPairSums = MARSPEC_PAIR_SUMS;
#else
constexpr bool kPairSums = true;
#endif

struct I32 {
  __m256i lo, hi;
};
struct F32 {
  __m256 lo, hi;
};


inline I32 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32 load(const void* p) {
  const auto* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline void store(void* p, I32 a) {
  auto* q = reinterpret_cast<__m256i*>(p);
  _mm256_storeu_si256(q, a.lo);
  _mm256_storeu_si256(q + 1, a.hi);
}
inline I32 set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I32 set1_bytes(uint8_t x) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(x));
  return {v, v};
}
inline I32 and_(I32 a, I32 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I32 or_(I32 a, I32 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
template <int N> inline I32 srli16(I32 a) { return {_mm256_srli_epi16(a.lo, N), _mm256_srli_epi16(a.hi, N)}; }
template <int N> inline I32 slli16(I32 a) { return {_mm256_slli_epi16(a.lo, N), _mm256_slli_epi16(a.hi, N)}; }
template <int N> inline I32 slli32(I32 a) { return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)}; }
inline I32 add(I32 a, I32 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I32 mullo(I32 a, I32 b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }

#ifdef MARSPEC_AVX_VNNI
inline __m256i dot_half(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i dot16_half(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
inline __m256i dot_half(__m256i acc, __m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline __m256i dot16_half(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
inline I32 pairs_u8s8(I32 u, I32 s) { return {_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)}; }
inline I32 add16(I32 a, I32 b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
inline I32 dot_u8s8(I32 acc, I32 u, I32 s) { return {dot_half(acc.lo, u.lo, s.lo), dot_half(acc.hi, u.hi, s.hi)}; }
inline I32 dot_i16(I32 acc, I32 a, I32 b) { return {dot16_half(acc.lo, a.lo, b.lo), dot16_half(acc.hi, a.hi, b.hi)}; }
inline I32 widen_u8(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
}
inline I32 widen_i8(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
inline int32_t reduce_add(I32 a) {
  const __m256i eight = _mm256_add_epi32(a.lo, a.hi);
  __m128i four = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
  four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1));
  return _mm_cvtsi128_si32(four);
}

inline F32 zerof() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32 loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storef(float* p, F32 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F32 set1f(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F32 to_float(I32 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F32 halfs(const uint16_t* p) {
  const auto* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline void store_halfs(uint16_t* p, F32 a) {
  auto* q = reinterpret_cast<__m128i*>(p);
  _mm_storeu_si128(q, _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm_storeu_si128(q + 1, _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline F32 addf(F32 a, F32 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32 subf(F32 a, F32 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F32 mulf(F32 a, F32 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32 divf(F32 a, F32 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32 fnmadd(F32 a, F32 b, F32 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32 maxf(F32 a, F32 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F32 absf(F32 a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline F32 round_even(F32 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// a * 2^n for whole n in [-126, 127]: 2^n built in the exponent bits is exact, so one rounding, as scalef's.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F32 times_pow2(F32 a, F32 n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
inline I32 store_int8(int8_t* p, F32 a) {
  const __m256i lo = _mm256_cvtps_epi32(a.lo), hi = _mm256_cvtps_epi32(a.hi);
  // Saturating packs: int32 -> int16 -> int8, then the 128-bit lanes' interleaving undone.
  const __m256i words = _mm256_packs_epi32(lo, hi);  // lo0-3 hi0-3 | lo4-7 hi4-7
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  // bytes: lo0-3 hi0-3 lo4-7 hi4-7 -> lo0-7 hi0-7
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(bytes, 0xD8));
  return {lo, hi};
}
inline float reduce_addf(F32 a) {
  const __m256 eight = _mm256_add_ps(a.lo, a.hi);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}
// Lane j: reduce_addf(v[j]), the same tree for each of the 16 vectors, taken a level at a time for all of
// them (a lane's pairs are added as reduce_addf adds them; only the shuffles that line them up differ).
inline F32 reduce_addf16(const F32* v) {
  __m256 half[2];  // keys 0-7, then 8-15
  for (int g = 0; g < 2; ++g) {
    __m256 four[4];  // vector p: v[8g + 2p]'s four sums in lanes 0-3, v[8g + 2p + 1]'s in lanes 4-7
    for (int p = 0; p < 4; ++p) {
      const F32 a = v[8 * g + 2 * p], b = v[8 * g + 2 * p + 1];
      const __m256 ea = _mm256_add_ps(a.lo, a.hi), eb = _mm256_add_ps(b.lo, b.hi);
      four[p] = _mm256_add_ps(_mm256_permute2f128_ps(ea, eb, 0x20), _mm256_permute2f128_ps(ea, eb, 0x31));
    }
    __m256 two[2];  // vector r: keys 4r, 4r + 2 (their two sums) in lanes 0-3, keys 4r + 1, 4r + 3 in 4-7
    for (int r = 0; r < 2; ++r) {
      const __m256 a = four[2 * r], b = four[2 * r + 1];
      two[r] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // Lanes: keys 0, 2, 4, 6, 1, 3, 5, 7 (of the 8), then each put in its own lane.
    const __m256 one = _mm256_add_ps(_mm256_shuffle_ps(two[0], two[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(two[0], two[1], _MM_SHUFFLE(3, 1, 3, 1)));
    half[g] = _mm256_permutevar8x32_ps(one, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  return {half[0], half[1]};
}
inline float reduce_maxf(F32 a) {
  const __m256 eight = _mm256_max_ps(a.lo, a.hi);
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_shuffle_ps(four, four, 1)));
}

struct Mask {  // all ones in a true lane
  __m256 lo, hi;
};
inline Mask greaterf(F32 a, F32 b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)};
}
inline Mask unorderedf(F32 a) {
  return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
inline Mask or_mask(Mask a, Mask b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
inline bool any(Mask a) { return _mm256_movemask_ps(_mm256_or_ps(a.lo, a.hi)) != 0; }
inline F32 selectf(Mask m, F32 a, F32 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
inline I32 select(Mask m, I32 a, I32 b) {
  return {_mm256_blendv_epi8(b.lo, a.lo, _mm256_castps_si256(m.lo)),
          _mm256_blendv_epi8(b.hi, a.hi, _mm256_castps_si256(m.hi))};
}
inline I32 lane_indices() {
  return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}


}  // namespace marspec_simd
