// GGUF quantised blocks to float32, exactly as gguf-py's numpy dequantizers compute them (torch-free).
//
// Each format's value is the same float32 operations in the same order as gguf-py's `dequantize_blocks`
// (a multiply, then an add or subtract: two roundings, never a fused multiply-add, which the build's
// -ffp-contract=off keeps the compiler from making), so a tensor converted here is bit for bit the tensor
// gguf-py gives. A half (float16) converts to float32 exactly.
//
// Formats (ggml's names; bytes a block; weights a block):
//   Q4_0 (18; 32)  d, 16 bytes of 4-bit codes: w = d * (q - 8)
//   Q4_1 (20; 32)  d, m, codes:                 w = d * q + m
//   Q5_0 (22; 32)  d, 32 high bits, codes:      w = d * (q - 16)
//   Q5_1 (24; 32)  d, m, high bits, codes:      w = d * q + m
//   Q8_0 (34; 32)  d, 32 int8:                  w = q * d
//   Q4_K (144; 256) d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes: per 32-weight
//                   sub-block g, w = (d * sc_g) * q - dmin * m_g
//   Q5_K (176; 256) as Q4_K with 32 bytes of high bits before the codes
//   Q6_K (210; 256) 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d: per 16 weights,
//                   w = (d * sc) * (q - 32)

#pragma once

#include <cstdint>
#include <cstring>

namespace marspec_kernels {

// ggml's type numbers (gguf's GGMLQuantizationType) of the formats dequantize_row takes.
enum class GgmlType : int {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

struct BlockFormat {
  int64_t bytes;    // a block's bytes
  int64_t weights;  // a block's weights
};

// The format of ggml type `type`, or {0, 0} for a type not taken here.
inline BlockFormat block_format(int type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kQ4_0: return {18, 32};
    case GgmlType::kQ4_1: return {20, 32};
    case GgmlType::kQ5_0: return {22, 32};
    case GgmlType::kQ5_1: return {24, 32};
    case GgmlType::kQ8_0: return {34, 32};
    case GgmlType::kQ4_K: return {144, 256};
    case GgmlType::kQ5_K: return {176, 256};
    case GgmlType::kQ6_K: return {210, 256};
  }
  return {0, 0};
}

// IEEE half (little-endian bytes at p) to float, exactly: normals, subnormals, zeros, infinities, NaNs.
inline float half_at(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t u32_at(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

// A 32-weight block's 4-bit code j: the low nibbles hold weights 0-15, the high ones 16-31.
inline int nibble32(const uint8_t* codes, int j) { return j < 16 ? codes[j] & 0x0F : codes[j - 16] >> 4; }

// Q4_K and Q5_K: sub-block g's 6-bit scale and min from the 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int g, int* scale, int* min) {
  if (g < 4) {
    *scale = s[g] & 0x3F;
    *min = s[g + 4] & 0x3F;
  } else {
    *scale = (s[g + 4] & 0x0F) | ((s[g - 4] >> 2) & 0x30);
    *min = (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30);
  }
}

// Q4_K and Q5_K: weight l (0-31) of sub-block g's low 4 bits: the 32-byte chunk g / 2, low nibbles for even g.
inline int k_nibble(const uint8_t* codes, int g, int l) { return (codes[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0F; }

inline void dequantize_block(GgmlType type, const uint8_t* b, float* out) {
  switch (type) {
    case GgmlType::kQ4_0: {
      const float d = half_at(b);
      for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(nibble32(b + 2, j) - 8);
      return;
    }
    case GgmlType::kQ4_1: {
      const float d = half_at(b), m = half_at(b + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(nibble32(b + 4, j)) + m;
      return;
    }
    case GgmlType::kQ5_0: {
      const float d = half_at(b);
      const uint32_t high = u32_at(b + 2);
      for (int j = 0; j < 32; ++j) {
        const int q = nibble32(b + 6, j) | static_cast<int>(((high >> j) & 1u) << 4);
        out[j] = d * static_cast<float>(q - 16);
      }
      return;
    }
    case GgmlType::kQ5_1: {
      const float d = half_at(b), m = half_at(b + 2);
      const uint32_t high = u32_at(b + 4);
      for (int j = 0; j < 32; ++j) {
        const int q = nibble32(b + 8, j) | static_cast<int>(((high >> j) & 1u) << 4);
        out[j] = d * static_cast<float>(q) + m;
      }
      return;
    }
    case GgmlType::kQ8_0: {
      const float d = half_at(b);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      return;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = type == GgmlType::kQ5_K;
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* high = b + 16;
      const uint8_t* codes = five ? b + 48 : b + 16;
      for (int g = 0; g < 8; ++g) {
        int sc, m;
        k_scale_min(scales, g, &sc, &m);
        const float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) {
          const int q = k_nibble(codes, g, l) | (five ? ((high[l] >> g) & 1) << 4 : 0);
          out[g * 32 + l] = dg * static_cast<float>(q) - mg;
        }
      }
      return;
    }
    case GgmlType::kQ6_K: {
      const uint8_t* low = b;
      const uint8_t* high = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int v = 0; v < 256; ++v) {
        const int half = v / 128, r = v % 128;
        const int lo = (low[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (high[half * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        const float dv = d * static_cast<float>(scales[v / 16]);
        out[v] = dv * static_cast<float>((lo | (hi << 4)) - 32);
      }
      return;
    }
  }
}

// One row of `blocks` blocks of `type` (a type block_format takes) into blocks * weights floats.
inline void dequantize_row(int type, const uint8_t* row, int64_t blocks, float* out) {
  const BlockFormat format = block_format(type);
  for (int64_t i = 0; i < blocks; ++i) {
    dequantize_block(static_cast<GgmlType>(type), row + i * format.bytes, out + i * format.weights);
  }
}

}  // namespace marspec_kernels
