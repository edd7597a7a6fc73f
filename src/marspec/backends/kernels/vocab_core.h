// A vocabulary row's largest (and second-largest) float32 value and its index, found exactly as torch's
// argmax and verify.margins.top2 find them, written once in the kernels' vector operations (simd.h) and
// torch-free (the standalone harness runs it on every path).
//
// Each of 16 lanes keeps the best and second-best value it has seen and their indices, replaced only by a
// strictly larger value (so the earliest of equal values stays), then the lanes' 32 candidates are ranked
// by (value, lower index first): the row's first maximum, and the first maximum of the rest. Comparisons
// only, so every path finds the same answer. A row holding a NaN is flagged (torch's argmax takes a NaN as
// the maximum: the caller answers such rows with torch's own operators).
//
// Written in explicit vector operations: as plain C++ over 16 lanes the compiler vectorised the loop in
// one build and not in another (the torch operator's build ran it ~5x slower than a standalone one).

#pragma once

#include "simd.h"

#include <cstdint>
#include <limits>

namespace marspec_kernels {

using namespace marspec_simd;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row's best two: values and indices (index -1: none seen), and whether it holds a NaN.
struct RowTop {
  float v1 = kNegInf;
  int64_t i1 = -1;
  float v2 = kNegInf;
  int64_t i2 = -1;
  bool nan = false;
};

// a ranks before b: larger, or equal and earlier (an index of -1 ranks after everything).
inline bool ranks_before(float va, int64_t ia, float vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

// The best (and, with kSecond, the second-best) of x[0, n), n < 2^31.
template <bool kSecond>
RowTop row_top(const float* x, int64_t n) {
  F32 v1 = set1f(kNegInf), v2 = v1;
  I32 i1 = set1(-1), i2 = i1;
  I32 index = lane_indices();
  const I32 step = set1(kLanes);
  Mask nan = unorderedf(zerof());  // none
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F32 v = loadf(x + j);
    nan = or_mask(nan, unorderedf(v));
    const Mask above1 = greaterf(v, v1);
    if constexpr (kSecond) {
      // A new best moves the old best to second place; else a value above the second takes it.
      const Mask above2 = greaterf(v, v2);
      v2 = selectf(above1, v1, selectf(above2, v, v2));
      i2 = select(above1, i1, select(above2, index, i2));
    }
    v1 = selectf(above1, v, v1);
    i1 = select(above1, index, i1);
    index = add(index, step);
  }
  float lv1[kLanes], lv2[kLanes];
  int32_t li1[kLanes], li2[kLanes];
  storef(lv1, v1);
  storef(lv2, v2);
  store(li1, i1);
  store(li2, i2);
  RowTop top;
  top.nan = any(nan);
  for (; j < n; ++j) {  // the last n % 16 values, each in its lane
    const int l = static_cast<int>(j % kLanes);
    const float v = x[j];
    const auto idx = static_cast<int32_t>(j);
    top.nan = top.nan || v != v;
    const bool above1 = v > lv1[l];
    if constexpr (kSecond) {
      const bool above2 = v > lv2[l];
      lv2[l] = above1 ? lv1[l] : (above2 ? v : lv2[l]);
      li2[l] = above1 ? li1[l] : (above2 ? idx : li2[l]);
    }
    lv1[l] = above1 ? v : lv1[l];
    li1[l] = above1 ? idx : li1[l];
  }
  // The row's best is the best lane's; its second is another lane's best or the best lane's second.
  for (int l = 0; l < kLanes; ++l) {
    if (ranks_before(lv1[l], li1[l], top.v1, top.i1)) {
      top.v1 = lv1[l];
      top.i1 = li1[l];
    }
  }
  if constexpr (kSecond) {
    for (int l = 0; l < kLanes; ++l) {
      const bool best_lane = li1[l] == top.i1;
      const float v = best_lane ? lv2[l] : lv1[l];
      const int64_t i = best_lane ? li2[l] : li1[l];
      if (ranks_before(v, i, top.v2, top.i2)) {
        top.v2 = v;
        top.i2 = i;
      }
    }
  }
  return top;
}

}  // namespace marspec_kernels
