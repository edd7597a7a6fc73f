// One (row, head) of attention, written once in the kernels' vector operations (simd.h) and torch-free
// (the standalone harness runs it): the same bits on every path.
//
// Per (row, head), over the row's `length` visible positions:
//   s_j = (q . k_j) * scale   (the dot in 16 float lanes, then the fixed reduction tree)
//   p_j = exp(s_j - max_j s_j) (vector_math.h's polynomial exp, the same operations on every lane)
//   out = (sum_j p_j v_j) / sum_j p_j   (the sums in position order; the normaliser lane-wise, then reduced)

#pragma once

#include "simd.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace marspec_kernels {

using namespace marspec_simd;

constexpr int64_t kMaxHeadDim = 256;

// One (row, head): q [d], keys and values of `length` positions (position stride `stride`), out [d];
// scores: room for length + 16 floats.
inline void attend_one(const float* q, const float* keys, const float* values, int64_t stride, int64_t length,
                       int64_t d, float scale, float* scores, float* out) {
  const int64_t chunks = d / kLanes;
  F32 qv[kMaxHeadDim / kLanes];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = loadf(q + c * kLanes);
  float peak = -INFINITY;
  for (int64_t j = 0; j < length; ++j) {
    const float* k = keys + j * stride;
    F32 acc = mulf(qv[0], loadf(k));
    for (int64_t c = 1; c < chunks; ++c) acc = fmadd(qv[c], loadf(k + c * kLanes), acc);
    const float s = reduce_addf(acc) * scale;
    scores[j] = s;
    peak = s > peak ? s : peak;
  }
  // The weights, 16 at a time (past the end: zeros), and their sum lane by lane.
  const F32 top = set1f(peak);
  F32 total = zerof();
  const int64_t whole = length / kLanes * kLanes;
  for (int64_t j = 0; j < length; j += kLanes) {
    float window[kLanes] = {};
    const int64_t width = std::min<int64_t>(length - j, kLanes);
    std::copy(scores + j, scores + j + width, window);
    F32 p = exp_clamped(subf(loadf(window), top));
    if (j >= whole) {
      float kept[kLanes] = {};
      storef(window, p);
      std::copy(window, window + width, kept);
      p = loadf(kept);
    }
    storef(window, p);
    std::copy(window, window + width, scores + j);
    total = addf(total, p);
  }
  F32 acc[kMaxHeadDim / kLanes];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = zerof();
  for (int64_t j = 0; j < length; ++j) {
    const F32 p = set1f(scores[j]);
    const float* v = values + j * stride;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = fmadd(p, loadf(v + c * kLanes), acc[c]);
  }
  const F32 inv = set1f(1.0f / reduce_addf(total));
  for (int64_t c = 0; c < chunks; ++c) storef(out + c * kLanes, mulf(acc[c], inv));
}

}  // namespace marspec_kernels
