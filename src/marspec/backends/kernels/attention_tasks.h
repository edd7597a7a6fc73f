// The torch side of attention (attention.cpp, layer.cpp): every (row, query head) of a call, the query
// heads that share a key/value head taken together (attention_core.h's attend_heads), split among threads.

#pragma once

#include <ATen/Parallel.h>

#include "attention_core.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace marspec_kernels {

// What row i reads of one key/value head: its keys and values (position stride `stride`) and how many
// positions it sees.
struct RowKeys {
  const float* keys;
  const float* values;
  int64_t stride;
  int64_t length;
};

// Attention of `rows` rows of `heads` query heads over `kv_heads` key/value heads of size d: query(i, h)
// and output(i, h) point at row i's head h, keys(i, kv) is what row i reads of key head kv, longest the
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
      const RowKeys seen = keys(i, kv);
      if (first < last) {
        attend_heads(queries, last - first, seen.keys, seen.values, seen.stride, seen.length, d, scale, scores.data(),
                     sums.data(), outputs);
      }
    }
  });
}

}  // namespace marspec_kernels
