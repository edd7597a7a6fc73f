// attention_rows: attention of query rows of one sequence, each row against its own prefix of the keys
// and values; attention_segments: the same for the rows of several sequences packed one after the other.
//
// Every (row, head) is computed as if alone (attention_core.h; the query heads that share a key head by one
// thread together, so their keys and values are read once), in an order that depends only on its own
// prefix length: a row's output is the same bits whatever other rows the call holds, so a
// verification forward scores each token as the one-token step does (marspec/backends/row_attention.py),
// and on every instruction set. One call attends all rows and heads of a layer; torch's SDPA called once
// per row costs ~30 us a call here.
//
// query [H, Q, D] float32, keys and values [H_kv, >= max visible, D] float32 or float16, both the same
// (any strides, the last dimension contiguous), visible int64 [Q] (row i attends positions 0 ..
// visible[i] - 1), D a multiple of 16 up to 256; head h reads key/value head h / (H / H_kv). Output [Q, H, D].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "attention_tasks.h"
#include "ops.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace {

using marspec_kernels::attend_rows;
using marspec_kernels::check_cpu;
using marspec_kernels::kMaxHeadDim;
using marspec_kernels::kv_data;
using marspec_kernels::RowKeys;
using marspec_kernels::with_kv_type;
using marspec_kernels::write_kv;
using marspec_simd::kLanes;

void check_head_size(int64_t d) {
  TORCH_CHECK(d > 0 && d % kLanes == 0 && d <= kMaxHeadDim, "head size ", d, " is not a multiple of 16 from 16 to 256");
}

// The rows of query [H, Q, D] attended (attend_rows), row i reading keys_of(i, key head): out [Q, H, D].
template <typename Keys>
at::Tensor attend(const at::Tensor& query, int64_t kv_heads, int64_t longest, double scale, Keys keys_of) {
  const int64_t heads = query.size(0), q_rows = query.size(1), d = query.size(2);
  at::Tensor out = at::empty({q_rows, heads, d}, query.options());
  const float* q_p = query.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t head_stride = query.stride(0), row_stride = query.stride(1);
  attend_rows(
      q_rows, heads, kv_heads, d, longest, static_cast<float>(scale),
      [&](int64_t i, int64_t h) { return q_p + h * head_stride + i * row_stride; },
      [&](int64_t i, int64_t h) { return out_p + (i * heads + h) * d; }, keys_of);
  return out;
}

at::Tensor rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                double scale) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&keys, "keys"}, {&values, "values"}, {&visible, "visible"}}) {
    check_cpu(*t, name);
  }
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "query [H, Q, D], keys and values [H_kv, L, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && values.scalar_type() == keys.scalar_type(),
              "a float32 query, and keys and values of one type");
  const int64_t heads = query.size(0), q_rows = query.size(1), d = query.size(2);
  const int64_t kv_heads = keys.size(0);
  check_head_size(d);
  TORCH_CHECK(keys.size(2) == d && values.size(2) == d && values.size(0) == kv_heads && values.size(1) == keys.size(1),
              "keys and values must match each other and the query's head size");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " key heads");
  TORCH_CHECK(query.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "the head dimension contiguous");
  TORCH_CHECK(keys.stride(1) == values.stride(1) && keys.stride(0) == values.stride(0),
              "keys and values laid out alike");
  TORCH_CHECK(visible.scalar_type() == at::kLong && visible.dim() == 1 && visible.size(0) == q_rows,
              "visible must be int64 [Q]");
  const at::Tensor lengths = visible.contiguous();
  const int64_t* length_p = lengths.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < q_rows; ++i) {
    TORCH_CHECK(length_p[i] >= 1 && length_p[i] <= keys.size(1), "row ", i, " sees ", length_p[i],
                " positions of ", keys.size(1));
    longest = length_p[i] > longest ? length_p[i] : longest;
  }
  const int64_t kv_head_stride = keys.stride(0), position_stride = keys.stride(1);
  return with_kv_type(keys.scalar_type(), "keys and values", [&](auto kind) {
    using KV = decltype(kind);
    const KV* k_p = kv_data<KV>(keys);
    const KV* v_p = kv_data<KV>(values);
    return attend(query, kv_heads, longest, scale, [&](int64_t i, int64_t kv) {
      return RowKeys<KV>{k_p + kv * kv_head_stride, v_p + kv * kv_head_stride, position_stride, length_p[i]};
    });
  });
}

// The rows of several sequences packed one after the other (a packed forward, marspec/backends/packed.py):
// query [H, Q, D] and the rows' own keys and values new_keys, new_values [H_kv, Q, D]; sequence s's rows
// are starts[s] .. starts[s + 1] - 1 (starts int64 [S + 1], from 0 to Q), and its cache is caches_k[s],
// caches_v[s] ([1, H_kv, capacity, D], the head dimension contiguous; all float32 or all float16). Row i is
// at position visible[i] - 1 of its sequence: its key and value are written there first (rounded to the
// cache's type as torch's copy rounds them), then each (row, head) is
// attended as rows() attends it, over positions 0 .. visible[i] - 1 of its own cache: the same bits as
// the sequence's cache written and its rows attended in calls of their own.
at::Tensor segments(const at::Tensor& query, const at::Tensor& new_keys, const at::Tensor& new_values,
                    at::TensorList caches_k, at::TensorList caches_v, const at::Tensor& starts,
                    const at::Tensor& visible, double scale) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&new_keys, "new_keys"}, {&new_values, "new_values"},
                                {&starts, "starts"}, {&visible, "visible"}}) {
    check_cpu(*t, name);
  }
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1,
              "query must be float32 [H, Q, D], the head dimension contiguous");
  const int64_t heads = query.size(0), q_rows = query.size(1), d = query.size(2);
  check_head_size(d);
  TORCH_CHECK(new_keys.dim() == 3 && new_values.sizes() == new_keys.sizes() && new_keys.size(1) == q_rows &&
                  new_keys.size(2) == d && new_keys.scalar_type() == at::kFloat &&
                  new_values.scalar_type() == at::kFloat && new_keys.stride(2) == 1 && new_values.stride(2) == 1,
              "new_keys and new_values must be float32 [H_kv, Q, D], the head dimension contiguous");
  const int64_t kv_heads = new_keys.size(0);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " key heads");
  const int64_t sequences = static_cast<int64_t>(caches_k.size());
  TORCH_CHECK(sequences >= 1 && static_cast<int64_t>(caches_v.size()) == sequences, "one cache per sequence");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.size(0) == sequences + 1,
              "starts must be int64 [sequences + 1]");
  TORCH_CHECK(visible.scalar_type() == at::kLong && visible.dim() == 1 && visible.size(0) == q_rows,
              "visible must be int64 [Q]");
  const at::Tensor starts_c = starts.contiguous(), lengths = visible.contiguous();
  const int64_t* start_p = starts_c.data_ptr<int64_t>();
  const int64_t* length_p = lengths.data_ptr<int64_t>();
  TORCH_CHECK(start_p[0] == 0 && start_p[sequences] == q_rows, "starts must run from 0 to the query's rows");
  for (int64_t s = 0; s < sequences; ++s) {  // all of them before any row is read
    TORCH_CHECK(start_p[s] <= start_p[s + 1], "starts must not decrease");
  }
  std::vector<int64_t> sequence_of(q_rows);
  // Each cache's strides, read once here rather than per row and head below.
  std::vector<int64_t> head_strides(sequences), position_strides(sequences);
  const at::ScalarType cache_type = caches_k[0].scalar_type();
  int64_t longest = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const at::Tensor& k = caches_k[s];
    const at::Tensor& v = caches_v[s];
    check_cpu(k, "caches_k");
    check_cpu(v, "caches_v");
    TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.size(1) == kv_heads && k.size(3) == d && v.sizes() == k.sizes() &&
                    k.scalar_type() == cache_type && v.scalar_type() == cache_type,
                "each cache must be [1, H_kv, capacity, D] like the new keys, all of one type");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == v.stride(2) && k.stride(1) == v.stride(1),
                "caches laid out alike, the head dimension contiguous");
    for (int64_t i = start_p[s]; i < start_p[s + 1]; ++i) {
      TORCH_CHECK(length_p[i] >= 1 && length_p[i] <= k.size(2), "row ", i, " sees ", length_p[i], " positions of ",
                  k.size(2));
      longest = length_p[i] > longest ? length_p[i] : longest;
      sequence_of[i] = s;
    }
    head_strides[s] = k.stride(1);
    position_strides[s] = k.stride(2);
  }
  return with_kv_type(cache_type, "the caches", [&](auto kind) {
    using KV = decltype(kind);
    std::vector<KV*> k_ptrs(sequences), v_ptrs(sequences);
    for (int64_t s = 0; s < sequences; ++s) {
      k_ptrs[s] = kv_data<KV>(caches_k[s]);
      v_ptrs[s] = kv_data<KV>(caches_v[s]);
    }
    // Every row's key and value into its cache (rounded to the cache's type) before any row reads a cache.
    const float* nk_p = new_keys.data_ptr<float>();
    const float* nv_p = new_values.data_ptr<float>();
    for (int64_t i = 0; i < q_rows; ++i) {
      const int64_t s = sequence_of[i];
      const int64_t position = length_p[i] - 1;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t to = h * head_strides[s] + position * position_strides[s];
        write_kv(k_ptrs[s] + to, nk_p + h * new_keys.stride(0) + i * new_keys.stride(1), d);
        write_kv(v_ptrs[s] + to, nv_p + h * new_values.stride(0) + i * new_values.stride(1), d);
      }
    }
    return attend(query, kv_heads, longest, scale, [&](int64_t i, int64_t kv) {
      const int64_t s = sequence_of[i], offset = kv * head_strides[s];
      return RowKeys<KV>{k_ptrs[s] + offset, v_ptrs[s] + offset, position_strides[s], length_p[i]};
    });
  });
}

}  // namespace

// segments writes each row's key and value into its sequence's cache: the schema says so (a!, b!).
MARSPEC_LIBRARY(m) {
  m.def("attention_rows(Tensor query, Tensor keys, Tensor values, Tensor visible, float scale) -> Tensor", &rows);
  m.def(
      "attention_segments(Tensor query, Tensor new_keys, Tensor new_values, Tensor(a!)[] caches_k, "
      "Tensor(b!)[] caches_v, Tensor starts, Tensor visible, float scale) -> Tensor",
      &segments);
}
