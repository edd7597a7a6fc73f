// GGUF Q4_K and Q6_K blocks to the records the kernels read (torch-free): the layouts q4k_format.h and
// q6k_format.h describe, byte for byte what marspec/backends/q4k.py and q6k.py's numpy packing gives
// (which stays, for a machine whose kernels do not run). Moving bytes only: no arithmetic, so every
// path packs alike.
//
// A tile is 32 GGUF rows (output columns), two halves of 16; a record is one 256-weight super-block of a
// tile. Rows past the tensor's last pad a tile as zero blocks.

#pragma once

#include "dequant_core.h"

#include <cstdint>
#include <cstring>

namespace marspec_kernels {

constexpr int64_t kPackTile = 32;  // GGUF rows a tile
constexpr int64_t kPackHalf = 16;  // columns a half
constexpr int64_t kQ4KRecord = 4864;
constexpr int64_t kQ6KRecord = 6720;

// The record's bytes for a ggml type packed here (Q4_K, Q6_K), else 0.
inline int64_t packed_record_bytes(int type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kQ4_K: return kQ4KRecord;
    case GgmlType::kQ6_K: return kQ6KRecord;
    default: return 0;
  }
}

// Q4_K: weight w (0-255) of a block's 4-bit code.
inline uint8_t q4k_code(const uint8_t* block, int w) {
  return static_cast<uint8_t>(k_nibble(block + 16, w / 32, w % 32));
}

// Q6_K: weight w (0-255) of a block's 6-bit code.
inline uint8_t q6k_code(const uint8_t* block, int w) {
  const int half = w / 128, r = w % 128;
  const int low = (block[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
  const int high = (block[128 + half * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
  return static_cast<uint8_t>(low | (high << 4));
}

// One Q4_K record from column c's block (`block`, 144 bytes) of half h: its codes, scales and d.
inline void pack_q4k_column(const uint8_t* block, int64_t h, int64_t c, uint8_t* record) {
  uint8_t q[256];
  for (int w = 0; w < 256; ++w) q[w] = q4k_code(block, w);
  // Codes: per sub-block g and 8-weight chunk, 64 bytes; byte 4c + b holds weights 8 chunk + b (low
  // nibble) and 8 chunk + 4 + b (high nibble).
  for (int64_t g = 0; g < 8; ++g) {
    for (int64_t chunk = 0; chunk < 4; ++chunk) {
      uint8_t* out = record + ((h * 8 + g) * 4 + chunk) * 64 + c * 4;
      const uint8_t* in = q + g * 32 + chunk * 8;
      for (int b = 0; b < 4; ++b) out[b] = static_cast<uint8_t>(in[b] | (in[4 + b] << 4));
    }
  }
  // Scales: sc [8][16] then m [8][16] of the half.
  for (int g = 0; g < 8; ++g) {
    int sc, m;
    k_scale_min(block + 4, g, &sc, &m);
    record[4096 + (h * 16 + g) * 16 + c] = static_cast<uint8_t>(sc);
    record[4096 + (h * 16 + 8 + g) * 16 + c] = static_cast<uint8_t>(m);
  }
  // d [16] then dmin [16], float32.
  const float d = half_at(block), dmin = half_at(block + 2);
  std::memcpy(record + 4608 + ((h * 2 + 0) * 16 + c) * 4, &d, 4);
  std::memcpy(record + 4608 + ((h * 2 + 1) * 16 + c) * 4, &dmin, 4);
}

// One Q6_K record from column c's block (`block`, 210 bytes) of half h: its codes, scales and d.
inline void pack_q6k_column(const uint8_t* block, int64_t h, int64_t c, uint8_t* record) {
  uint8_t q[256];
  for (int w = 0; w < 256; ++w) q[w] = q6k_code(block, w);
  for (int64_t j = 0; j < 16; ++j) {
    const uint8_t* in = q + j * 16;
    uint8_t* vectors = record + (h * 16 + j) * 192 + c * 4;
    for (int b = 0; b < 4; ++b) {
      // Nibble vectors p = 0, 1: weights 8p + b (low nibble) and 8p + 4 + b (high nibble), low 4 bits.
      for (int p = 0; p < 2; ++p) {
        vectors[p * 64 + b] = static_cast<uint8_t>((in[8 * p + b] & 0x0F) | ((in[8 * p + 4 + b] & 0x0F) << 4));
      }
      // The top vector: weight 4i + b's top 2 bits in bits 2i, 2i + 1.
      uint8_t top = 0;
      for (int i = 0; i < 4; ++i) top = static_cast<uint8_t>(top | ((in[4 * i + b] >> 4) << (2 * i)));
      vectors[128 + b] = top;
    }
    record[6144 + (h * 16 + j) * 16 + c] = block[192 + j];  // the int8 scale, as it is
  }
  record[6656 + (h * 16 + c) * 2] = block[208];  // d, fp16 as it is
  record[6656 + (h * 16 + c) * 2 + 1] = block[209];
}

// Super-block s of one tile: `rows` (up to 32) GGUF rows of `row_bytes` from `first`, into `record`.
inline void pack_record(int type, const uint8_t* first, int64_t rows, int64_t row_bytes, int64_t s, uint8_t* record) {
  const bool q4k = static_cast<GgmlType>(type) == GgmlType::kQ4_K;
  const int64_t block_bytes = q4k ? 144 : 210;
  static const uint8_t kZero[210] = {};
  for (int64_t r = 0; r < kPackTile; ++r) {
    const uint8_t* block = r < rows ? first + r * row_bytes + s * block_bytes : kZero;
    if (q4k) {
      pack_q4k_column(block, r / kPackHalf, r % kPackHalf, record);
    } else {
      pack_q6k_column(block, r / kPackHalf, r % kPackHalf, record);
    }
  }
}

}  // namespace marspec_kernels
