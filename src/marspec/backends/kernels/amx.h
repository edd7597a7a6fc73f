// AMX int8 tiles for the kernels: whether this process may run them, the row count from which the
// kernels take them, and a thread's tile configuration held for a scope.
//
// AMX's tile multiply (TDPBSUD: signed int8 rows x unsigned int8 columns, summed exactly in int32) does
// in one instruction what 64 AVX-512 VNNI instructions do, so once a call has several rows the
// products stop being the work, and the VNNI kernels' instructions around their products (broadcasts,
// unpacking) go with them. Its int32 sums are the VNNI kernels' exact sums, and the kernels scale them
// with the same float operations, so a row's output is the same bits on either path: the path can be
// chosen by the call's row count without a row's answer depending on the rows beside it.
//
// Linux gives a process the tiles' 8 KB of register state only once asked (arch_prctl), once per
// process; the first call that could use them asks. Only the AVX-512 path's library has it (every CPU
// with AMX has AVX-512); compilers without AMX's intrinsics (g++ < 11, clang < 12) build it without.

#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#if defined(MARSPEC_ISA_AVX512) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                     (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11))
#define MARSPEC_HAS_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MARSPEC_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#else
#define MARSPEC_HAS_AMX 0
#endif

namespace marspec_kernels {

// Each kernel's calls with at least this many rows take the AMX path where it runs (0: never); only
// speed depends on it. Measured on the default pair's layers (docs/results.md): both gain from 8 rows
// (at 6 some layers gain and some lose, and the forwards lose).
inline std::atomic<int64_t> amx_min_rows_q4k{8};
inline std::atomic<int64_t> amx_min_rows_q6k{8};

constexpr int64_t kTileRows = 16;  // rows a tile holds

#if MARSPEC_HAS_AMX

// The CPU has AMX tiles and int8 products, the OS saves their state, and Linux granted this process
// their use (asked once).
inline bool amx_permitted() {
  static const bool permitted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, int8 = (d >> 25) & 1u;
    if (!tile || !int8) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE: xgetbv may run
    uint32_t xcr0_low = 0, xcr0_high = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    if (((xcr0_low >> 17) & 3u) != 3u) return false;  // XTILECFG and XTILEDATA enabled by the OS
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether a call of `rows` rows takes the AMX path, from `min_rows` rows on.
inline bool amx_takes(int64_t rows, const std::atomic<int64_t>& min_rows) {
  const int64_t from = min_rows.load(std::memory_order_relaxed);
  return from > 0 && rows >= from && amx_permitted();
}

// Palette 1's tile configuration (64 bytes, as LDTILECFG reads it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

constexpr int64_t kChunk = 64;  // weights one tile product sums (a 64-byte row of activations)

// The kernels' tiles for blocks of `rows` rows: four of int32 sums (rows x 16 columns: C 0-3), two of
// activations (rows x 64 int8: A 4, 5) and two of weights (64 weights x 16 columns, 4 consecutive
// weights of a column side by side: B 6, 7).
inline TileConfig chunk_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(t < 6 ? rows : kChunk / 4);
    config.colsb[t] = 64;
  }
  return config;
}

// The products of a block of rows over `chunks` chunks of 64 weights, each half's low and high parts
// (C 0, 1: half 0's; C 2, 3: half 1's): for chunk i, the rows' activations at xq + 64 i (rows k bytes
// apart) against weights(i, half, high), each a tile B of 64 weights x 16 columns (unsigned bytes; the
// high ones signed where kSignedHigh); then the four stored to sums[half][low, high][row][column].
// Tile numbers are macro arguments: the intrinsics paste them into their assembly.
#define MARSPEC_AMX_CHUNK(A)                                                                  \
  _tile_loadd(A, xq + i * kChunk, k);                                                         \
  _tile_loadd(6, weights(i, 0, false), 64);                                                   \
  _tile_dpbsud(0, A, 6);                                                                      \
  _tile_loadd(7, weights(i, 0, true), 64);                                                    \
  if constexpr (kSignedHigh) _tile_dpbssd(1, A, 7); else _tile_dpbsud(1, A, 7);               \
  _tile_loadd(6, weights(i, 1, false), 64);                                                   \
  _tile_dpbsud(2, A, 6);                                                                      \
  _tile_loadd(7, weights(i, 1, true), 64);                                                    \
  if constexpr (kSignedHigh) _tile_dpbssd(3, A, 7); else _tile_dpbsud(3, A, 7);

template <bool kSignedHigh, class Weights>
MARSPEC_AMX_TARGET inline void chunk_products(const int8_t* xq, int64_t k, int64_t chunks, Weights weights,
                                              int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < chunks; ++i) {
    if (i % 2 == 0) {  // even and odd chunks' activations in two tiles: a load need not wait for the last products
      MARSPEC_AMX_CHUNK(4)
    } else {
      MARSPEC_AMX_CHUNK(5)
    }
  }
  constexpr int64_t kSums = kTileRows * 16;
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kSums, 64);
  _tile_stored(2, sums + 2 * kSums, 64);
  _tile_stored(3, sums + 3 * kSums, 64);
}
#undef MARSPEC_AMX_CHUNK

// A thread's tiles configured as `config` while it lives, released after (so a context switch saves no
// tile state, and a library that configures tiles its own way, oneDNN, finds them released).
class HeldTiles {
 public:
  MARSPEC_AMX_TARGET explicit HeldTiles(const TileConfig& config) { _tile_loadconfig(&config); }
  MARSPEC_AMX_TARGET ~HeldTiles() { _tile_release(); }
  HeldTiles(const HeldTiles&) = delete;
  HeldTiles& operator=(const HeldTiles&) = delete;
};

// What a thread holds on the AMX path while it works on its share of a call: its tiles, configured for
// blocks of block_rows rows (none where block_rows is 0: the call takes the VNNI path), a record's two
// halves unpacked for the tiles (a kernel's Half), and a block's sums from chunk_products.
template <class Half>
struct AmxThreadState {
  explicit AmxThreadState(int64_t block_rows) {
    if (block_rows > 0) tiles.emplace(chunk_tiles(block_rows));
  }
  std::optional<HeldTiles> tiles;
  Half halves[2];
  alignas(64) int32_t sums[4 * kTileRows * 16];  // [half][low, high][row][column]
};

#else

inline bool amx_permitted() { return false; }
inline bool amx_takes(int64_t, const std::atomic<int64_t>&) { return false; }

#endif

// How a call's rows go through the tiles: blocks of block_rows rows (at most a tile's, all of one size:
// 13 rows, one of 13; 20, two of 10), the last padded with zero rows to stored_rows. block_rows 0: the
// call does not take the AMX path (stored_rows: its rows).
struct RowBlocks {
  int64_t block_rows;
  int64_t stored_rows;
};

// A call of `rows` rows' blocks, for a kernel whose calls take the AMX path from `min_rows` rows.
inline RowBlocks amx_row_blocks(int64_t rows, const std::atomic<int64_t>& min_rows) {
  if (!amx_takes(rows, min_rows)) return {0, rows};
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows;
  const int64_t block_rows = (rows + blocks - 1) / blocks;
  return {block_rows, blocks * block_rows};
}

}  // namespace marspec_kernels
