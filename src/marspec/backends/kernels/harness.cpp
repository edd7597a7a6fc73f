// A standalone check of the kernels' arithmetic, without torch: the same sources the operators run
// (rows.h, tile_rows.h, the formats, attention_core.h with float32 and fp16 caches, the simd reductions, vocab_core.h,
// dequant_core.h, pack_core.h, the native layer's vector_math.h), on
// inputs made by a fixed generator, so that paths that cannot load torch here (ARM NEON, run under qemu-user on an x86 machine)
// are compared bit for bit with the others. It prints one hash per kernel (FNV-1a over the outputs' bytes) and exits 1
// if a row's output differs between a call of many rows and a call of its own, or a thread's requests for
// its weights ahead leave a gap in its stream.
//
// Build: c++ -std=c++17 -O2 -ffp-contract=off <path's flags> -D<path's ISA macro> harness.cpp
// (tests/test_cpu_paths.py builds it for every path and compares the hashes).

#include "attention_core.h"
#include "dequant_core.h"
#include "pack_core.h"
#include "q4k_format.h"
#include "q6k_format.h"
#include "tile_rows.h"
#include "vector_math.h"
#include "vocab_core.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace marspec_kernels;

struct Generator {  // a 64-bit LCG: the same numbers on every machine
  uint64_t state;
  uint32_t next() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(state >> 32);
  }
  float uniform() { return static_cast<float>(next() >> 8) / 16777216.0f * 2.0f - 1.0f; }  // [-1, 1)
};

struct Hash {
  uint64_t h = 1469598103934665603ULL;
  void add(const void* p, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  }
};

bool failed = false;

// Activation rows [m, k]: uniform values, a row of large ones, a zero row, a row with a NaN.
std::vector<float> activations(Generator& g, int64_t m, int64_t k) {
  std::vector<float> x(m * k);
  for (auto& v : x) v = g.uniform();
  for (int64_t i = 0; i < k; ++i) x[1 * k + i] *= 300.0f;
  std::fill(x.begin() + 2 * k, x.begin() + 3 * k, 0.0f);
  x[4 * k + 7] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

// A Q4_K tile's records of `supers` super-blocks, the last holding `last_used` sub-blocks.
std::vector<uint8_t> q4k_tile(Generator& g, int64_t supers, int64_t last_used) {
  std::vector<uint8_t> tile;
  for (int64_t s = 0; s < supers; ++s) {
    const int64_t used = s + 1 < supers ? Q4K::kGroups : last_used;
    const int64_t start = static_cast<int64_t>(tile.size());
    tile.resize(start + Q4K::record_bytes(used));
    uint8_t* r = tile.data() + start;
    const int64_t code_bytes = 2 * used * Q4K::kGroupCodeBytes;
    for (int64_t i = 0; i < code_bytes; ++i) r[i] = static_cast<uint8_t>(g.next());
    for (int64_t i = 0; i < 2 * Q4K::kScaleBytes; ++i) r[code_bytes + i] = static_cast<uint8_t>(g.next() & 0x3F);
    auto* d = reinterpret_cast<float*>(r + code_bytes + 2 * Q4K::kScaleBytes);
    for (int64_t i = 0; i < 2 * 2 * Q4K::kHalf; ++i) d[i] = g.uniform() * 0.01f;
  }
  return tile;
}

std::vector<uint8_t> q6k_tile(Generator& g, int64_t supers) {
  std::vector<uint8_t> tile(supers * Q6K::kRecord);
  for (int64_t s = 0; s < supers; ++s) {
    uint8_t* r = tile.data() + s * Q6K::kRecord;
    for (int64_t i = 0; i < 2 * (Q6K::kCodeBytes + Q6K::kScaleBytes); ++i) r[i] = static_cast<uint8_t>(g.next());
    auto* d = reinterpret_cast<uint16_t*>(r + 2 * (Q6K::kCodeBytes + Q6K::kScaleBytes));
    for (int64_t i = 0; i < 2 * Q6K::kHalf; ++i) {  // normal fp16 values of either sign, 2^-8 .. 2^-1
      d[i] = static_cast<uint16_t>(((g.next() & 1u) << 15) | ((7u + g.next() % 7u) << 10) | (g.next() & 0x3FFu));
    }
  }
  return tile;
}

// y [m, 32] of one tile for rows x [m, k_in], the operator's steps on one thread.
template <class F>
std::vector<float> tile_output(const std::vector<uint8_t>& tile, const float* x, int64_t m, int64_t k_in,
                               int64_t supers, int64_t last_used, int64_t record_bytes, const float* bias) {
  const int64_t k = supers * F::kSuper;
  const QuantisedRows xq = quantise_rows<F::kGroup>(x, m, k_in, k, m);
  std::vector<float> acc(m * kTileColumns, 0.0f), y(m * kTileColumns);
  static typename F::Half w[2];
  for (int64_t s = 0; s < supers; ++s) {
    const int64_t used = s + 1 < supers ? F::kGroups : last_used;
    all_rows<F>(w, tile.data() + s * record_bytes, xq, m, k, s, used, acc.data());
  }
  write_tile(acc.data(), xq.scale.data(), m, 0, kTileColumns, bias, y.data());
  return y;
}

// The tile's output for all rows at once, and each row alone (which must be the same bits), hashed.
template <class F>
void check_linear(const char* name, Generator& g, const std::vector<uint8_t>& tile, int64_t k_in, int64_t supers,
                  int64_t last_used, int64_t record_bytes) {
  constexpr int64_t kRows = 13;
  const std::vector<float> x = activations(g, kRows, k_in);
  std::vector<float> bias(kTileColumns);
  for (auto& b : bias) b = g.uniform();
  Hash hash;
  const float* biases[] = {nullptr, bias.data()};
  for (const float* b : biases) {
    const auto all = tile_output<F>(tile, x.data(), kRows, k_in, supers, last_used, record_bytes, b);
    hash.add(all.data(), all.size() * sizeof(float));
    for (int64_t r = 0; r < kRows; ++r) {
      const auto alone = tile_output<F>(tile, x.data() + r * k_in, 1, k_in, supers, last_used, record_bytes, b);
      if (std::memcmp(alone.data(), all.data() + r * kTileColumns, kTileColumns * sizeof(float)) != 0) {
        std::printf("%s: row %lld alone differs from the row in a call of %lld\n", name, static_cast<long long>(r),
                    static_cast<long long>(kRows));
        failed = true;
      }
    }
    bool nan_row = true;
    for (int64_t c = 0; c < kTileColumns; ++c) nan_row = nan_row && std::isnan(all[4 * kTileColumns + c]);
    if (!nan_row) {
      std::printf("%s: a row holding a NaN gave numbers\n", name);
      failed = true;
    }
  }
  std::printf("%s %016llx\n", name, static_cast<unsigned long long>(hash.h));
}

// fp16 bits widened to float32 (exact), written out from IEEE 754's definition.
float widened_half(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (exponent == 0x1F) return mantissa ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

// x rounded to fp16 by IEEE 754's rule, written out as a search: the nearest of the finite halves (ties
// to the even one), infinity from 65520 on (where rounding to nearest carries past the largest, 65504).
uint16_t half_nearest(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const float a = std::fabs(x);
  if (std::isnan(x)) return 0x7E00;
  if (a >= 65520.0f) return sign | 0x7C00;
  uint16_t lo = 0, hi = 0x7BFF;  // the largest finite half at or below a
  while (lo < hi) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (widened_half(mid) <= a) lo = mid; else hi = static_cast<uint16_t>(mid - 1);
  }
  if (lo == 0x7BFF) return sign | lo;
  const double below = a - widened_half(lo), above = widened_half(static_cast<uint16_t>(lo + 1)) - a;
  const bool up = above < below || (above == below && (lo & 1));
  return sign | static_cast<uint16_t>(lo + (up ? 1 : 0));
}

// write_kv's float32 -> fp16 rounding against IEEE 754's rule on random values of every scale and on
// the cases that test a rounding: ties between halves, subnormal halves, the overflow edge, signed zeros.
void check_halves(Generator& g) {
  std::vector<float> x;
  for (int i = 0; i < 4096; ++i) {
    const float mantissa = g.uniform();  // drawn apart: the order of a call's arguments differs by compiler
    x.push_back(std::ldexp(mantissa, static_cast<int>(g.next() % 44) - 28));
  }
  for (const float v : {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11), std::ldexp(1.0f, -25),
                        3 * std::ldexp(1.0f, -25), std::ldexp(1.0f, -26), std::ldexp(1023.5f, -24), 65504.0f,
                        65519.99f, 65520.0f, 1e9f, 0.0f, -0.0f, -2.5f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  x.resize((x.size() + kLanes - 1) / kLanes * kLanes, 0.5f);
  std::vector<uint16_t> halves(x.size());
  write_kv(halves.data(), x.data(), static_cast<int64_t>(x.size()));
  Hash hash;
  for (size_t i = 0; i < x.size(); ++i) {
    if (halves[i] != half_nearest(x[i])) {
      std::printf("halves: %.9g rounded to %04x, IEEE's nearest is %04x\n", x[i], halves[i], half_nearest(x[i]));
      failed = true;
    }
  }
  hash.add(halves.data(), halves.size() * sizeof(uint16_t));
  std::printf("halves %016llx\n", static_cast<unsigned long long>(hash.h));
}

// A uniform value times 2^e, e from -range to range; the two draws in this order on every compiler (as
// the arguments of one call their order would be the compiler's).
float scaled(Generator& g, int range) {
  const float value = g.uniform();
  return std::ldexp(value, static_cast<int>(g.next() % (2 * range + 1)) - range);
}

// reduce_addf16's lane j against reduce_addf(v[j]), on lanes of magnitudes 2^-20 .. 2^20 (where a pair
// added in another order than the tree's rounds differently): the same bits, or the harness fails.
void check_reduce16() {
  Generator g{16};  // its own numbers: the other checks' inputs stay as they were
  for (int round = 0; round < 64; ++round) {
    float lanes[kLanes][kLanes];
    F32 v[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      for (int64_t i = 0; i < kLanes; ++i) lanes[j][i] = scaled(g, 20);
      v[j] = loadf(lanes[j]);
    }
    float together[kLanes];
    storef(together, reduce_addf16(v));
    for (int64_t j = 0; j < kLanes; ++j) {
      const float alone = reduce_addf(v[j]);
      if (std::memcmp(&alone, &together[j], sizeof alone) != 0) {
        std::printf("reduce_addf16: lane %lld is %.9g, reduce_addf gives %.9g\n", static_cast<long long>(j),
                    together[j], alone);
        failed = true;
      }
    }
  }
}

void check_attention(Generator& g) {
  Hash hash;
  for (const int64_t d : {16, 64, 128}) {
    for (const int64_t length : {1, 5, 16, 17, 40, 100}) {
      // Three query heads sharing the keys: each alone, then the three together (the same bits).
      constexpr int64_t kHeads = 3;
      std::vector<float> q(kHeads * d), keys(length * d), values(length * d), scores(kHeads * (length + kLanes));
      std::vector<float> sums(kHeads * d), out(kHeads * d), together(kHeads * d);
      for (auto& v : q) v = g.uniform() * 4.0f;
      for (auto& v : keys) v = g.uniform() * 4.0f;
      for (auto& v : values) v = g.uniform();
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      const float* queries[kHeads];
      float* outputs[kHeads];
      for (int64_t h = 0; h < kHeads; ++h) {
        attend_one(q.data() + h * d, keys.data(), values.data(), d, length, d, scale, scores.data(), sums.data(),
                   out.data() + h * d);
        queries[h] = q.data() + h * d;
        outputs[h] = together.data() + h * d;
      }
      attend_heads(queries, kHeads, keys.data(), values.data(), d, length, d, scale, scores.data(), sums.data(),
                   outputs);
      if (std::memcmp(out.data(), together.data(), out.size() * sizeof(float)) != 0) {
        std::printf("attention: heads of length %lld and size %lld differ taken together\n",
                    static_cast<long long>(length), static_cast<long long>(d));
        failed = true;
      }
      hash.add(out.data(), out.size() * sizeof(float));
      // An fp16 cache: the keys and values rounded as a cache write rounds them (write_kv), attended as
      // fp16 and as their float32 widenings: the same bits.
      std::vector<uint16_t> half_keys(keys.size()), half_values(values.size());
      std::vector<float> wide_keys(keys.size()), wide_values(values.size());
      write_kv(half_keys.data(), keys.data(), static_cast<int64_t>(keys.size()));
      write_kv(half_values.data(), values.data(), static_cast<int64_t>(values.size()));
      for (size_t i = 0; i < keys.size(); ++i) {
        wide_keys[i] = widened_half(half_keys[i]);
        wide_values[i] = widened_half(half_values[i]);
      }
      std::vector<float> from_halves(kHeads * d), from_wide(kHeads * d);
      float* half_outputs[kHeads];
      for (int64_t h = 0; h < kHeads; ++h) {
        attend_one(q.data() + h * d, wide_keys.data(), wide_values.data(), d, length, d, scale, scores.data(),
                   sums.data(), from_wide.data() + h * d);
        half_outputs[h] = from_halves.data() + h * d;
      }
      attend_heads(queries, kHeads, half_keys.data(), half_values.data(), d, length, d, scale, scores.data(),
                   sums.data(), half_outputs);
      if (std::memcmp(from_halves.data(), from_wide.data(), from_wide.size() * sizeof(float)) != 0) {
        std::printf("attention: fp16 keys of length %lld and size %lld differ from their float32 widenings\n",
                    static_cast<long long>(length), static_cast<long long>(d));
        failed = true;
      }
      hash.add(from_halves.data(), from_halves.size() * sizeof(float));
    }
  }
  std::printf("attention %016llx\n", static_cast<unsigned long long>(hash.h));
}

// Rows of several lengths (whole vectors and not), with repeated maxima, -inf and a NaN: each row's
// best two against a plain loop's (the first maximum, then the first maximum of the others), hashed.
void check_vocab(Generator& g) {
  Hash hash;
  for (const int64_t n : {1, 2, 15, 16, 17, 100, 1000, 4099}) {
    for (int kind = 0; kind < 5; ++kind) {
      std::vector<float> x(n);
      for (auto& v : x) v = kind == 1 ? static_cast<float>(g.next() % 4) : g.uniform();  // kind 1: many ties
      if (kind == 2) x[g.next() % n] = -std::numeric_limits<float>::infinity();
      if (kind == 3) std::fill(x.begin(), x.end(), -std::numeric_limits<float>::infinity());
      if (kind == 4) x[g.next() % n] = std::numeric_limits<float>::quiet_NaN();
      const RowTop top = row_top<true>(x.data(), n);
      const RowTop best = row_top<false>(x.data(), n);
      int64_t i1 = -1, i2 = -1;
      bool nan = false;
      for (int64_t j = 0; j < n; ++j) {
        nan = nan || std::isnan(x[j]);
        if (x[j] > (i1 < 0 ? -std::numeric_limits<float>::infinity() : x[i1])) i1 = j;
      }
      for (int64_t j = 0; j < n; ++j) {
        if (j != i1 && x[j] > (i2 < 0 ? -std::numeric_limits<float>::infinity() : x[i2])) i2 = j;
      }
      const bool same = top.nan == nan && best.nan == nan &&
                        (nan || (top.i1 == i1 && best.i1 == i1 && (i1 < 0 || top.v1 == x[i1]) && top.i2 == i2 &&
                                 (i2 < 0 || top.v2 == x[i2])));
      if (!same) {
        std::printf("vocab: row of %lld (kind %d) gave %lld, %lld; a plain loop %lld, %lld\n",
                    static_cast<long long>(n), kind, static_cast<long long>(top.i1), static_cast<long long>(top.i2),
                    static_cast<long long>(i1), static_cast<long long>(i2));
        failed = true;
      }
      const int64_t answer[] = {top.i1, top.i2, best.i1, top.nan};
      hash.add(answer, sizeof answer);
    }
  }
  std::printf("vocab %016llx\n", static_cast<unsigned long long>(hash.h));
}

// Random blocks of every GGUF format dequant_core.h takes (their halves random bits: subnormals,
// infinities and NaNs among them), dequantized and hashed.
void check_dequant(Generator& g) {
  Hash hash;
  for (const int type : {2, 3, 6, 7, 8, 12, 13, 14}) {
    const BlockFormat format = block_format(type);
    std::vector<uint8_t> blocks(3 * format.bytes);
    for (auto& b : blocks) b = static_cast<uint8_t>(g.next() >> 24);
    std::vector<float> out(3 * format.weights);
    dequantize_row(type, blocks.data(), 3, out.data());
    hash.add(out.data(), out.size() * sizeof(float));
  }
  std::printf("dequant %016llx\n", static_cast<unsigned long long>(hash.h));
}

// Random Q4_K and Q6_K rows (35: a whole tile and a part one, 2 super-blocks) packed into records, hashed.
void check_pack(Generator& g) {
  Hash hash;
  for (const int type : {12, 14}) {
    const int64_t rows = 35, supers = 2, row_bytes = supers * block_format(type).bytes;
    std::vector<uint8_t> raw(rows * row_bytes);
    for (auto& b : raw) b = static_cast<uint8_t>(g.next() >> 24);
    const int64_t record = packed_record_bytes(type);
    std::vector<uint8_t> out(2 * supers * record);
    for (int64_t tile = 0; tile < 2; ++tile) {
      for (int64_t s = 0; s < supers; ++s) {
        const int64_t present = std::min<int64_t>(kPackTile, rows - tile * kPackTile);
        pack_record(type, raw.data() + tile * kPackTile * row_bytes, present, row_bytes, s,
                    out.data() + (tile * supers + s) * record);
      }
    }
    hash.add(out.data(), out.size());
  }
  std::printf("pack %016llx\n", static_cast<unsigned long long>(hash.h));
}

// A thread's stream of three Q4_K tiles of 4 super-blocks (the layer 1024 wide, or 896: each tile's last
// record 4 of 8 sub-blocks): the records' requests (requested_ahead) reach every byte after the first
// kRecordsAhead records, else the run fails.
void check_requests() {
  for (const int64_t last_used : {Q4K::kGroups, int64_t{4}}) {
    const int64_t supers = 4, tiles = 3;
    const int64_t tile_bytes = (supers - 1) * Q4K::kRecord + Q4K::record_bytes(last_used);
    const int64_t stream = tiles * tile_bytes;
    std::vector<uint8_t> memory(stream + 2 * kRecordsAhead * Q4K::kRecord);  // requests past the end
    std::vector<bool> requested(stream, false);
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t s = 0; s < supers; ++s) {
        const int64_t at = t * tile_bytes + s * Q4K::kRecord;
        const int64_t bytes = Q4K::record_bytes(s + 1 < supers ? Q4K::kGroups : last_used);
        const Requested r = requested_ahead(memory.data() + at, bytes, Q4K::kRecord);
        const int64_t from = r.start - memory.data();
        for (int64_t i = from; i < std::min(from + r.bytes, stream); ++i) requested[i] = true;
      }
    }
    for (int64_t i = kRecordsAhead * Q4K::kRecord; i < stream; ++i) {
      if (!requested[i]) {
        std::fprintf(stderr, "requests: byte %lld of a stream of %lld (last record %lld sub-blocks) unrequested\n",
                     static_cast<long long>(i), static_cast<long long>(stream), static_cast<long long>(last_used));
        failed = true;
        break;
      }
    }
  }
}

}  // namespace
// The native layer's float functions (vector_math.h): the MLP's gates, SiLU's and GELU's tanh form, on
// values from -100 to 100 (both ends of exp's clamp), and the norm's mean of squares.
void check_gates() {
  Generator g{17};  // its own numbers: the other checks' inputs stay as they were
  Hash hash;
  for (int round = 0; round < 64; ++round) {
    float gate[kLanes], up[kLanes], out[2][kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      gate[i] = scaled(g, 10);
      up[i] = g.uniform();
    }
    storef(out[0], silu_times(loadf(gate), loadf(up)));
    storef(out[1], gelu_tanh_times(loadf(gate), loadf(up)));
    const float mean = mean_square(gate, kLanes);
    hash.add(out, sizeof out);
    hash.add(&mean, sizeof mean);
  }
  std::printf("gates %016llx\n", static_cast<unsigned long long>(hash.h));
}

int main() {
  Generator g{20261206};
  std::printf("path %s\n", marspec_simd::kPathName);
  const auto q4k_full = q4k_tile(g, 4, Q4K::kGroups);
  check_linear<Q4K>("q4k", g, q4k_full, 1024, 4, Q4K::kGroups, Q4K::kRecord);
  const auto q4k_part = q4k_tile(g, 4, 4);  // 896 wide: the last super-block holds 4 sub-blocks
  check_linear<Q4K>("q4k_896", g, q4k_part, 896, 4, 4, Q4K::kRecord);
  const auto q6k = q6k_tile(g, 3);
  check_linear<Q6K>("q6k", g, q6k, 768, 3, Q6K::kGroups, Q6K::kRecord);
  check_attention(g);
  check_reduce16();
  check_gates();
  check_halves(g);
  check_vocab(g);
  check_dequant(g);
  check_pack(g);
  check_requests();
  return failed ? 1 : 0;
}
