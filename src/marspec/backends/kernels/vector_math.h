// Float functions written once in the kernels' vector operations (simd.h), torch-free: the same bits on
// every path (each step an exactly rounded operation, none fused unless spelled).

#pragma once

#include "simd.h"

namespace marspec_kernels {

using namespace marspec_simd;

// exp(x), x clamped to [-87, 88] first (below: ~0; above: ~1.7e38, finite), Cephes' single-precision
// polynomial: x = n ln2 + r, |r| <= ln2 / 2, exp(r) from a degree-7 polynomial, times 2^n.
inline F32 exp_clamped(F32 x) {
  x = maxf(x, set1f(-87.0f));
  x = subf(zerof(), maxf(subf(zerof(), x), set1f(-88.0f)));  // min(x, 88)
  const F32 n = round_even(mulf(x, set1f(1.44269504088896341f)));
  F32 r = fnmadd(n, set1f(0.693359375f), x);
  r = fnmadd(n, set1f(-2.12194440e-4f), r);
  F32 p = set1f(1.9875691500e-4f);
  p = fmadd(p, r, set1f(1.3981999507e-3f));
  p = fmadd(p, r, set1f(8.3334519073e-3f));
  p = fmadd(p, r, set1f(4.1665795894e-2f));
  p = fmadd(p, r, set1f(1.6666665459e-1f));
  p = fmadd(p, r, set1f(5.0000001201e-1f));
  p = fmadd(p, mulf(r, r), addf(r, set1f(1.0f)));
  return times_pow2(p, n);
}

// silu(g) * u = g / (1 + exp(-g)) * u, lane by lane.
inline F32 silu_times(F32 g, F32 u) {
  const F32 e = exp_clamped(subf(zerof(), g));
  return mulf(divf(g, addf(set1f(1.0f), e)), u);
}

// gelu(g) * u with GELU's tanh form (PyTorch's approximate="tanh", Gemma's activation): 0.5 g (1 + tanh(y)),
// y = sqrt(2 / pi) (g + 0.044715 g^3), tanh(y) = 1 - 2 / (exp(2y) + 1) (its error absolute, never above
// float's near 1), lane by lane.
inline F32 gelu_tanh_times(F32 g, F32 u) {
  const F32 cube = mulf(mulf(g, g), g);
  const F32 y = mulf(set1f(0.7978845608028654f), addf(g, mulf(set1f(0.044715f), cube)));
  const F32 e = exp_clamped(addf(y, y));
  const F32 t = subf(set1f(1.0f), divf(set1f(2.0f), addf(e, set1f(1.0f))));
  return mulf(mulf(mulf(set1f(0.5f), g), addf(set1f(1.0f), t)), u);
}

// The mean of the squares of n values (n a multiple of 16): squares summed lane by lane in order, the
// lanes by the fixed tree, then divided by n.
inline float mean_square(const float* x, int64_t n) {
  F32 acc = zerof();
  for (int64_t i = 0; i < n; i += kLanes) {
    const F32 v = loadf(x + i);
    acc = addf(acc, mulf(v, v));
  }
  return reduce_addf(acc) / static_cast<float>(n);
}

}  // namespace marspec_kernels
