// AMX tiles over bf16 pair panels (bf16_pairs.cpp): on CPUs with AMX-BF16 (Intel
// Sapphire Rapids and later) one tdpbf16ps multiplies 16 rows of x by 32 inputs of
// 16 output columns, 16x what a vdpbf16ps does, from the same layout: 16 consecutive
// pairs of one panel, [16, 32] bf16 with a 64-byte stride, are exactly AMX's "B"
// operand (its rows pairs of inputs, each holding the pair for 16 columns). So the
// weight is read in place, no second copy in oneDNN's layout.
//
// The products are those of AVX512-BF16, exact in float32; how they are added is
// not (vdpbf16ps rounds after each product, odd input first; 40% of tdpbf16ps's
// sums of 128 inputs differed from that in the last bit here): the two kernels agree
// to float32 rounding, not bit for bit. So a CPU with AMX takes it for every row
// count (bf16_pairs.cpp): a row's product never depends on how many rows share its
// batch.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// The compilers whose intrinsics know AMX (GCC 11, Clang 12); built with an older
// one, or without AVX-512 (isa_built.h), the library never takes AMX.
#include "isa_built.h"

#if KVSERVE_AVX512_BUILT && ((defined(__clang__) && __clang_major__ >= 12) || \
                             (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KVSERVE_AMX_BUILT 1
#else
#define KVSERVE_AMX_BUILT 0
#endif

namespace kvserve_amx {

constexpr int64_t kTileRows = 16;   // rows of x (and of sums) one tile holds
constexpr int64_t kTilePairs = 16;  // pairs of inputs (32 bf16, 64 bytes) a tile row holds

#if KVSERVE_AMX_BUILT
#define KVSERVE_AMX_TARGET "amx-tile,amx-bf16,avx512f"

// Whether this CPU has AMX-BF16 and Linux lets this process use its tile registers
// (their 8 KiB of state is granted on request, once, for every thread).
inline bool amx_here() {
  static const bool here = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return here;
}

// Palette 1 with every tile 16 rows of 64 bytes: tiles 0-3 sums, then x, then weight.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) bytes_per_row[t] = 64, rows[t] = kTileRows;
  }
};

// Binds the tile configuration on this thread (another library's kernels may have
// left theirs); its end releases the tiles, so a context switch saves no tile state
// between calls.
struct Tiles {
  __attribute__((target(KVSERVE_AMX_TARGET))) Tiles() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  __attribute__((target(KVSERVE_AMX_TARGET))) ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// The weight tiles kPrefetchSteps steps ahead of pairs k, NT panels' worth, for
// blocks of 32 rows (4 KiB ahead a panel: at 64-512 rows 4-7% faster than the
// hardware prefetcher alone, bench/bf16_pairs.py; 16 KiB ahead was slower again).
// Not for 16 rows or fewer, memory-bound: there the default model's batch-1 layers
// took 1.01x AVX512-BF16's time without, 1.07x with (bench/bf16_pairs_ab.py).
constexpr int64_t kPrefetchSteps = 4;
template <int NT>
__attribute__((target(KVSERVE_AMX_TARGET))) inline void prefetch(const uint32_t* w,
                                                                  int64_t panel_stride,
                                                                  int64_t k, int64_t pairs16) {
  const int64_t ahead = k + kPrefetchSteps * kTilePairs;
  if (ahead >= pairs16) return;
  for (int j = 0; j < NT; ++j) {
    const char* tile = reinterpret_cast<const char*>(w + j * panel_stride + ahead * 16);
    for (int line = 0; line < 16; ++line) _mm_prefetch(tile + 64 * line, _MM_HINT_T0);
  }
}

// The sums of MT x NT tiles: MT * 16 rows of x (MT row tiles, each with its own
// pointer, so the last may come from a padded copy) times NT panels, over the
// pairs [0, pairs16) (a multiple of 16), stored as float32 to sums[MT * 16][ldc]
// (panel j's columns at 16 j). GCC's tile intrinsics take the tile's number as
// a literal, hence one branch per shape. Tiles: sums 0-3, x from 4, weight after.
template <int MT, int NT>
__attribute__((target(KVSERVE_AMX_TARGET))) void block(
    const uint32_t* const (&x)[MT], int64_t ldx, const uint32_t* w, int64_t panel_stride,
    int64_t pairs16, float* sums, int64_t ldc) {
  static_assert((MT == 2 && NT <= 2) || (MT == 1 && NT <= 3), "8 tiles");
  const int64_t xs = ldx * 4, cs = ldc * 4;
  float* lower = sums + kTileRows * ldc;  // the second row tile's sums
  if constexpr (MT == 2) {  // sums: 0 = x0 w0, 1 = x0 w1, 2 = x1 w0, 3 = x1 w1
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (NT == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < pairs16; k += kTilePairs) {
      prefetch<NT>(w, panel_stride, k, pairs16);
      _tile_loadd(4, x[0] + k, xs);
      _tile_loadd(5, x[1] + k, xs);
      _tile_loadd(6, w + k * 16, 64);
      if constexpr (NT == 2) _tile_loadd(7, w + panel_stride + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) {
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums, cs);
    _tile_stored(2, lower, cs);
    if constexpr (NT == 2) {
      _tile_stored(1, sums + 16, cs);
      _tile_stored(3, lower + 16, cs);
    }
  } else {  // sums: j = x0 wj
    _tile_zero(0);
    if constexpr (NT >= 2) _tile_zero(1);
    if constexpr (NT >= 3) _tile_zero(2);
    for (int64_t k = 0; k < pairs16; k += kTilePairs) {
      _tile_loadd(4, x[0] + k, xs);
      _tile_loadd(5, w + k * 16, 64);
      if constexpr (NT >= 2) _tile_loadd(6, w + panel_stride + k * 16, 64);
      if constexpr (NT >= 3) _tile_loadd(7, w + 2 * panel_stride + k * 16, 64);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (NT >= 2) _tile_dpbf16ps(1, 4, 6);
      if constexpr (NT >= 3) _tile_dpbf16ps(2, 4, 7);
    }
    _tile_stored(0, sums, cs);
    if constexpr (NT >= 2) _tile_stored(1, sums + 16, cs);
    if constexpr (NT >= 3) _tile_stored(2, sums + 32, cs);
  }
}

#else  // no AMX in this compiler: never taken (amx_here), only there to be called
inline bool amx_here() { return false; }
struct Tiles {};
template <int MT, int NT>
void block(const uint32_t* const (&)[MT], int64_t, const uint32_t*, int64_t, int64_t, float*,
           int64_t) {}
#endif

}  // namespace kvserve_amx
