// The kernels' vector operations on ARM NEON with the dot-product extension (Armv8.2-A+dotprod: Apple
// M1 and later, Graviton 2 and later, Ampere Altra): each 16-lane vector is four 128-bit registers
// (lanes 0-3, 4-7, 8-11, 12-15). See simd.h for what every operation computes.
//
// sdot multiplies signed bytes: the kernels' codes (0..15, 0..63) are non-negative int8 as they are, so
// its sums are the unsigned-by-signed sums of the x86 paths.

#pragma once

#include <arm_neon.h>

#include <cstdint>

namespace marspec_simd {

constexpr const char* kPathName = "neon";
constexpr int kRowBlock = 2;
// sdot sums four products straight into int32: no int16 pair sums.
constexpr bool kPairSums = false;

struct I32 {
  int32x4_t q[4];
};
struct F32 {
  float32x4_t q[4];
};


inline I32 zero() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline I32 load(const void* p) {
  const auto* b = static_cast<const int32_t*>(p);
  return {{vld1q_s32(b), vld1q_s32(b + 4), vld1q_s32(b + 8), vld1q_s32(b + 12)}};
}
inline void store(void* p, I32 a) {
  auto* b = static_cast<int32_t*>(p);
  for (int i = 0; i < 4; ++i) vst1q_s32(b + 4 * i, a.q[i]);
}
inline I32 set1(int32_t x) { return {{vdupq_n_s32(x), vdupq_n_s32(x), vdupq_n_s32(x), vdupq_n_s32(x)}}; }
inline I32 set1_bytes(uint8_t x) {
  const int32x4_t v = vreinterpretq_s32_u8(vdupq_n_u8(x));
  return {{v, v, v, v}};
}
#define MARSPEC_LANEWISE(name, body)      \
  inline I32 name(I32 a, I32 b) {         \
    I32 r;                                \
    for (int i = 0; i < 4; ++i) r.q[i] = body; \
    return r;                             \
  }
MARSPEC_LANEWISE(and_, vandq_s32(a.q[i], b.q[i]))
MARSPEC_LANEWISE(or_, vorrq_s32(a.q[i], b.q[i]))
MARSPEC_LANEWISE(add, vaddq_s32(a.q[i], b.q[i]))
MARSPEC_LANEWISE(mullo, vmulq_s32(a.q[i], b.q[i]))
#undef MARSPEC_LANEWISE
template <int N> inline I32 srli16(I32 a) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vreinterpretq_s32_u16(vshrq_n_u16(vreinterpretq_u16_s32(a.q[i]), N));
  return r;
}
template <int N> inline I32 slli16(I32 a) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vreinterpretq_s32_u16(vshlq_n_u16(vreinterpretq_u16_s32(a.q[i]), N));
  return r;
}
template <int N> inline I32 slli32(I32 a) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vshlq_n_s32(a.q[i], N);
  return r;
}
inline I32 dot_u8s8(I32 acc, I32 u, I32 s) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vdotq_s32(acc.q[i], vreinterpretq_s8_s32(u.q[i]), vreinterpretq_s8_s32(s.q[i]));
  return r;
}
// Pairs of int16: acc + a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in each int32 lane (exact products).
inline I32 dot_i16(I32 acc, I32 a, I32 b) {
  I32 r;
  for (int i = 0; i < 4; ++i) {
    const int16x8_t x = vreinterpretq_s16_s32(a.q[i]), y = vreinterpretq_s16_s32(b.q[i]);
    const int32x4_t even = vmovl_s16(vmovn_s32(vreinterpretq_s32_s16(x)));
    const int32x4_t odd = vshrq_n_s32(vreinterpretq_s32_s16(x), 16);
    const int32x4_t even_b = vmovl_s16(vmovn_s32(vreinterpretq_s32_s16(y)));
    const int32x4_t odd_b = vshrq_n_s32(vreinterpretq_s32_s16(y), 16);
    r.q[i] = vaddq_s32(acc.q[i], vaddq_s32(vmulq_s32(even, even_b), vmulq_s32(odd, odd_b)));
  }
  return r;
}
// Products of u's unsigned and s's signed bytes (each fits int16), added in pairs (exact where a pair fits).
inline I32 pairs_u8s8(I32 u, I32 s) {
  I32 r;
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t a = vreinterpretq_u8_s32(u.q[i]);
    const int8x16_t b = vreinterpretq_s8_s32(s.q[i]);
    const int16x8_t lo = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(a))), vmovl_s8(vget_low_s8(b)));
    const int16x8_t hi = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(a))), vmovl_s8(vget_high_s8(b)));
    r.q[i] = vreinterpretq_s32_s16(vpaddq_s16(lo, hi));
  }
  return r;
}
inline I32 add16(I32 a, I32 b) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vreinterpretq_s32_s16(vaddq_s16(vreinterpretq_s16_s32(a.q[i]), vreinterpretq_s16_s32(b.q[i])));
  return r;
}
inline I32 widen_u8(const uint8_t* p) {
  const uint8x16_t v = vld1q_u8(p);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_u8(vget_high_u8(v));
  return {{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo))),
           vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi)))}};
}
inline I32 widen_i8(const int8_t* p) {
  const int8x16_t v = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
  return {{vmovl_s16(vget_low_s16(lo)), vmovl_s16(vget_high_s16(lo)), vmovl_s16(vget_low_s16(hi)),
           vmovl_s16(vget_high_s16(hi))}};
}
inline int32_t reduce_add(I32 a) {
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.q[0], a.q[2]), vaddq_s32(a.q[1], a.q[3])));  // exact: any order
}

inline F32 zerof() { return {{vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)}}; }
inline F32 loadf(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void storef(float* p, F32 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.q[i]);
}
inline F32 set1f(float x) { return {{vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x)}}; }
inline F32 to_float(I32 a) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcvtq_f32_s32(a.q[i]);
  return r;
}
inline F32 halfs(const uint16_t* p) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
  return r;
}
// vcvt_f16_f32 rounds as the FPCR says: to nearest, ties to even, unless a program changes it (none does).
inline void store_halfs(uint16_t* p, F32 a) {
  for (int i = 0; i < 4; ++i) vst1_u16(p + 4 * i, vreinterpret_u16_f16(vcvt_f16_f32(a.q[i])));
}
#define MARSPEC_LANEWISE_F(name, body)          \
  inline F32 name(F32 a, F32 b) {               \
    F32 r;                                      \
    for (int i = 0; i < 4; ++i) r.q[i] = body;  \
    return r;                                   \
  }
MARSPEC_LANEWISE_F(addf, vaddq_f32(a.q[i], b.q[i]))
MARSPEC_LANEWISE_F(subf, vsubq_f32(a.q[i], b.q[i]))
MARSPEC_LANEWISE_F(mulf, vmulq_f32(a.q[i], b.q[i]))
MARSPEC_LANEWISE_F(divf, vdivq_f32(a.q[i], b.q[i]))
MARSPEC_LANEWISE_F(maxf, vmaxq_f32(a.q[i], b.q[i]))
#undef MARSPEC_LANEWISE_F
// a * b + c and c - a * b, fused (one rounding), as FMA3's vfmadd and vfnmadd.
inline F32 fmadd(F32 a, F32 b, F32 c) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]);
  return r;
}
inline F32 fnmadd(F32 a, F32 b, F32 c) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmsq_f32(c.q[i], a.q[i], b.q[i]);
  return r;
}
inline F32 absf(F32 a) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vabsq_f32(a.q[i]);
  return r;
}
inline F32 round_even(F32 a) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vrndnq_f32(a.q[i]);
  return r;
}
inline F32 times_pow2(F32 a, F32 n) {
  F32 r;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23);
    r.q[i] = vmulq_f32(a.q[i], vreinterpretq_f32_s32(bits));
  }
  return r;
}
inline I32 store_int8(int8_t* p, F32 a) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcvtnq_s32_f32(a.q[i]);  // to nearest, ties to even
  const int16x8_t lo = vcombine_s16(vqmovn_s32(r.q[0]), vqmovn_s32(r.q[1]));
  const int16x8_t hi = vcombine_s16(vqmovn_s32(r.q[2]), vqmovn_s32(r.q[3]));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
  return r;
}
inline float reduce_addf(F32 a) {
  const float32x4_t four = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
  const float32x2_t two = vadd_f32(vget_low_f32(four), vget_high_f32(four));
  return vget_lane_f32(two, 0) + vget_lane_f32(two, 1);
}
// Lane j: reduce_addf(v[j]), the same tree for each of the 16 vectors (a lane's pairs are added as
// reduce_addf adds them; only the moves that line them up differ).
inline F32 reduce_addf16(const F32* v) {
  F32 out;
  for (int m = 0; m < 4; ++m) {  // keys 4m .. 4m + 3
    float32x4_t two[2];  // keys 4m + 2t and 4m + 2t + 1: their two sums each
    for (int t = 0; t < 2; ++t) {
      const F32 a = v[4 * m + 2 * t], b = v[4 * m + 2 * t + 1];
      const float64x2_t fa = vreinterpretq_f64_f32(vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3])));
      const float64x2_t fb = vreinterpretq_f64_f32(vaddq_f32(vaddq_f32(b.q[0], b.q[2]), vaddq_f32(b.q[1], b.q[3])));
      two[t] = vaddq_f32(vreinterpretq_f32_f64(vzip1q_f64(fa, fb)), vreinterpretq_f32_f64(vzip2q_f64(fa, fb)));
    }
    out.q[m] = vpaddq_f32(two[0], two[1]);
  }
  return out;
}
inline float reduce_maxf(F32 a) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[2]), vmaxq_f32(a.q[1], a.q[3])));
}

struct Mask {  // all ones in a true lane
  uint32x4_t q[4];
};
inline Mask greaterf(F32 a, F32 b) {
  Mask r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcgtq_f32(a.q[i], b.q[i]);
  return r;
}
inline Mask unorderedf(F32 a) {
  Mask r;
  for (int i = 0; i < 4; ++i) r.q[i] = vmvnq_u32(vceqq_f32(a.q[i], a.q[i]));
  return r;
}
inline Mask or_mask(Mask a, Mask b) {
  Mask r;
  for (int i = 0; i < 4; ++i) r.q[i] = vorrq_u32(a.q[i], b.q[i]);
  return r;
}
inline bool any(Mask a) { return vmaxvq_u32(vorrq_u32(vorrq_u32(a.q[0], a.q[1]), vorrq_u32(a.q[2], a.q[3]))) != 0; }
inline F32 selectf(Mask m, F32 a, F32 b) {
  F32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vbslq_f32(m.q[i], a.q[i], b.q[i]);
  return r;
}
inline I32 select(Mask m, I32 a, I32 b) {
  I32 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vbslq_s32(m.q[i], a.q[i], b.q[i]);
  return r;
}
inline I32 lane_indices() {
  alignas(16) static constexpr int32_t kIndices[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return load(kIndices);
}


}  // namespace marspec_simd
