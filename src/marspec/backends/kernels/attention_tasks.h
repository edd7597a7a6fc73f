// The torch side of attention (attention.cpp, layer.cpp): every (row, query head) of a call, the query
// heads that share a key/value head taken together (attention_core.h's attend_heads), split among threads.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "attention_core.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace marspec_kernels {

// What row i reads of one key/value head: its keys and values (float32 or fp16 bits, attention_core.h;
// position stride `stride`) and how many positions it sees.
template <typename KV>
struct RowKeys {
  const KV* keys;
  const KV* values;
  int64_t stride;
  int64_t length;
};

// Calls body(KV{}) with KV the element type of a key/value cache of scalar type `type`: float for
// float32, uint16_t (fp16 bits) for float16; refuses another type in one line naming `what`.
template <typename Body>
decltype(auto) with_kv_type(at::ScalarType type, const char* what, Body body) {
  TORCH_CHECK(type == at::kFloat || type == at::kHalf, what, " must be float32 or float16, not ", type);
  if (type == at::kHalf) return body(uint16_t{});
  return body(float{});
}

// A cache tensor's elements as KV (float32, or float16's bits).
template <typename KV>
KV* kv_data(const at::Tensor& t) {
  if constexpr (std::is_same_v<KV, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<KV*>(t.data_ptr<at::Half>());
  }
}

// Attention of `rows` rows of `heads` query heads over `kv_heads` key/value heads of size d: query(i, h)
// and output(i, h) point at row i's head h, keys(i, kv) is what row i reads of key head kv (a RowKeys), longest the
// most positions any row sees. Each (row, key head)'s query heads go in parts of at most kMaxGroup, and
// in as many parts as keep every thread busy (one row of a model with fewer key heads than threads
// would otherwise leave threads idle); a head's output is the same bits however the heads are grouped.
template <typename Query, typename Output, typename Keys>
void attend_rows(int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t longest, float scale, Query query,
                 Output output, Keys keys) {
  const int64_t group = heads / kv_heads;
  int64_t parts = (group + kMaxGroup - 1) / kMaxGroup;
  const int64_t threads = at::get_num_threads();
  while (parts < group && rows * kv_heads * parts < threads) ++parts;
  const int64_t size = (group + parts - 1) / parts;
  at::parallel_for(0, rows * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(size * (longest + kLanes)), sums(size * d);
    const float* queries[kMaxGroup];
    float* outputs[kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (kv_heads * parts), kv = task / parts % kv_heads, part = task % parts;
      const int64_t first = kv * group + part * size, last = std::min((kv + 1) * group, first + size);
      for (int64_t h = first; h < last; ++h) {
        queries[h - first] = query(i, h);
        outputs[h - first] = output(i, h);
      }
      const auto seen = keys(i, kv);
      if (first < last) {
        attend_heads(queries, last - first, seen.keys, seen.values, seen.stride, seen.length, d, scale, scores.data(),
                     sums.data(), outputs);
      }
    }
  });
}

}  // namespace marspec_kernels
