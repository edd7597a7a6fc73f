// One (row, head) of attention, written once in the kernels' vector operations (simd.h) and torch-free
// (the standalone harness runs it): the same bits on every path.
//
// Per (row, head), over the row's `length` visible positions:
//   s_j = (q . k_j) * scale   (the dot in 16 float lanes, then the fixed reduction tree)
//   p_j = exp(s_j - max_j s_j) (vector_math.h's polynomial exp, the same operations on every lane)
//   out = (sum_j p_j v_j) / sum_j p_j   (the sums in position order; the normaliser lane-wise, then reduced)
//
// Keys and values are float32 or fp16 (uint16_t bits: a cache of half the bytes, rounded once when written,
// write_kv). An fp16 key is widened to float32 exactly, so attending fp16 keys and values gives the same
// bits as attending their widened float32 copies: the rounding is in what the cache holds, never in how
// a row reads it.

#pragma once

#include "simd.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace marspec_kernels {

using namespace marspec_simd;

constexpr int64_t kMaxHeadDim = 256;

// 16 keys' or values' components as float32 lanes: float32 as they are, fp16 widened (exact).
inline F32 load_kv(const float* p) { return loadf(p); }
inline F32 load_kv(const uint16_t* p) { return halfs(p); }

// A row's d components (d a multiple of 16) into a cache of float32 (as they are) or fp16 (rounded to
// nearest, ties to even: what torch's float-to-half copy gives, so every writer of a cache agrees).
inline void write_kv(float* to, const float* from, int64_t d) { std::copy(from, from + d, to); }
inline void write_kv(uint16_t* to, const float* from, int64_t d) {
  for (int64_t i = 0; i < d; i += kLanes) store_halfs(to + i, loadf(from + i));
}

constexpr int64_t kMaxGroup = 16;  // query heads one call of attend_heads takes
constexpr int64_t kBlock = 32;     // positions a block: its keys (then values) stay in L1 while each head reads them

// Query heads sharing one key/value head, each computed exactly as attend_one computes it alone (the same
// operations in the same order per head; only the order in which heads take turns differs), so that the
// keys and values are read from memory once for all of them rather than once per head.
// q[h], out[h]: head h's query and output [d], h < heads <= kMaxGroup; keys and values of `length`
// positions (position stride `stride`); scores: room for heads * (length + 16) floats; sums: heads * d.
template <typename KV>
inline void attend_heads(const float* const* q, int64_t heads, const KV* keys, const KV* values, int64_t stride,
                         int64_t length, int64_t d, float scale, float* scores, float* sums, float* const* out) {
  const int64_t chunks = d / kLanes;
  const int64_t row = length + kLanes;  // a head's scores in `scores`
  const F32 scale_v = set1f(scale);
  float peak[kMaxGroup];
  F32 peak_v[kMaxGroup];  // the largest of a head's scores taken 16 at a time, lane by lane
  for (int64_t h = 0; h < heads; ++h) {
    peak[h] = -INFINITY;
    peak_v[h] = set1f(-INFINITY);
  }
  // s_j = (q . k_j) * scale, block by block, each head in turn over the block's keys: 16 keys' dot
  // products reduced together (reduce_addf16: each one's bits as reduce_addf gives them), the rest one by
  // one. The largest score is the same whichever way it is found (no score is a NaN).
  for (int64_t j0 = 0; j0 < length; j0 += kBlock) {
    const int64_t j1 = std::min(length, j0 + kBlock);
    for (int64_t h = 0; h < heads; ++h) {
      F32 qv[kMaxHeadDim / kLanes];
      for (int64_t c = 0; c < chunks; ++c) qv[c] = loadf(q[h] + c * kLanes);
      float* head_scores = scores + h * row;
      int64_t j = j0;
      for (; j + kLanes <= j1; j += kLanes) {
        F32 dots[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) {
          const KV* k = keys + (j + i) * stride;
          F32 acc = mulf(qv[0], load_kv(k));
          for (int64_t c = 1; c < chunks; ++c) acc = fmadd(qv[c], load_kv(k + c * kLanes), acc);
          dots[i] = acc;
        }
        const F32 s = mulf(reduce_addf16(dots), scale_v);
        storef(head_scores + j, s);
        peak_v[h] = maxf(s, peak_v[h]);
      }
      float top = peak[h];
      for (; j < j1; ++j) {
        const KV* k = keys + j * stride;
        F32 acc = mulf(qv[0], load_kv(k));
        for (int64_t c = 1; c < chunks; ++c) acc = fmadd(qv[c], load_kv(k + c * kLanes), acc);
        const float s = reduce_addf(acc) * scale;
        head_scores[j] = s;
        top = s > top ? s : top;
      }
      peak[h] = top;
    }
  }
  // Each head's weights, 16 at a time (past the end: zeros), and their sum lane by lane.
  float inverse[kMaxGroup];
  const int64_t whole = length / kLanes * kLanes;
  for (int64_t h = 0; h < heads; ++h) {
    float* head_scores = scores + h * row;
    const F32 top = set1f(std::max(peak[h], reduce_maxf(peak_v[h])));
    F32 total = zerof();
    for (int64_t j = 0; j < whole; j += kLanes) {
      const F32 p = exp_clamped(subf(loadf(head_scores + j), top));
      storef(head_scores + j, p);
      total = addf(total, p);
    }
    if (whole < length) {
      float window[kLanes] = {};
      const int64_t width = length - whole;
      std::copy(head_scores + whole, head_scores + length, window);
      const F32 p = exp_clamped(subf(loadf(window), top));
      float kept[kLanes] = {};
      storef(window, p);
      std::copy(window, window + width, kept);
      std::copy(window, window + width, head_scores + whole);
      total = addf(total, loadf(kept));
    }
    inverse[h] = 1.0f / reduce_addf(total);
  }
  // sum_j p_j v_j in position order, block by block, each head's sums kept in `sums` between blocks.
  for (int64_t i = 0; i < heads * d; i += kLanes) storef(sums + i, zerof());
  for (int64_t j0 = 0; j0 < length; j0 += kBlock) {
    const int64_t j1 = std::min(length, j0 + kBlock);
    for (int64_t h = 0; h < heads; ++h) {
      const float* head_scores = scores + h * row;
      F32 acc[kMaxHeadDim / kLanes];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = loadf(sums + h * d + c * kLanes);
      for (int64_t j = j0; j < j1; ++j) {
        const F32 p = set1f(head_scores[j]);
        const KV* v = values + j * stride;
        for (int64_t c = 0; c < chunks; ++c) acc[c] = fmadd(p, load_kv(v + c * kLanes), acc[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) storef(sums + h * d + c * kLanes, acc[c]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const F32 inv = set1f(inverse[h]);
    for (int64_t c = 0; c < chunks; ++c) storef(out[h] + c * kLanes, mulf(loadf(sums + h * d + c * kLanes), inv));
  }
}

// One (row, head): q [d], keys and values of `length` positions (position stride `stride`), out [d];
// scores: room for length + 16 floats; sums: d floats.
template <typename KV>
inline void attend_one(const float* q, const KV* keys, const KV* values, int64_t stride, int64_t length,
                       int64_t d, float scale, float* scores, float* sums, float* out) {
  attend_heads(&q, 1, keys, values, stride, length, d, scale, scores, sums, &out);
}

}  // namespace marspec_kernels
