// kvserve::packed_linear: y = x W^T (+ bias) on x86 CPUs with AVX2 and FMA, for
// float32 rows x (or bfloat16 ones, summed in float32) and a weight packed once at
// load (engine/kernels/cpu/packing.py).
//
// The packed weight is a run of panels, each 16 output columns wide and K deep:
// [P, K, 16], so one step along K reads 16 consecutive values of one panel. They
// are float32, or bfloat16 where every value of the weight is exact in bf16 (half
// the bytes; a bf16 checkpoint served in float32). A bf16 panel row keeps column j
// in the low half of 32-bit word j and column j + 8 in its high half, so widening
// a row to two float32 vectors is one shift and one mask. Sums are float32 either
// way: only the order of the additions differs from torch's float32 GEMMs.
//
// Quantized weights keep their own bytes, widened to float32 in registers as they
// are loaded: int8 panels [P, K, 16] with one float32 scale per output column
// (applied to the sums) or a float16 scale per group of inputs (GGUF's Q8_0), and
// int4 panels [P, K, 8] (byte j of a row: column j in its low nibble, j + 8 in its
// high one) with a float16 scale and minimum per group (GGUF's Q4_0/Q4_1, w = q *
// scale + min). Group scales are [P, K / group, 16]. A group's integer products are
// summed, then scaled once (see micro). Up to 12 rows, int4 panels of a quantized
// layer (int8_inputs) are not widened at all: x is quantized to int8 in blocks of 32
// inputs and multiplied as integers (micro_dot, llama.cpp's way with its Q8
// activations): 1.4x faster at one row than widening. On CPUs with AVX512-VNNI and
// VBMI, int4 and int8 panels of a quantized layer take integer products at any
// number of rows by vpdpbusd (vnni_dots.h, takes_dots). Elsewhere, past the rows that
// take integer products, the widening would be repeated for every block of rows, so
// each thread widens its chunk of panels once into a float32 buffer and runs the
// float32 kernel over it (x stays float32); bf16 rows past 64 on an AVX512-BF16 CPU
// go to oneDNN's bf16 GEMM over the panels widened into a plain matrix instead
// (onednn_product).
//
// Panels are taken in chunks (shared among torch's threads as chunk_schedule.h
// says; on the buffered path each thread takes a contiguous range) that stay in the
// L2 cache while every block of 6 rows of x runs over them, so a weight is read from
// memory once however many rows there are. The micro-kernel keeps a 6 x 16 tile of
// sums (12 of AVX2's 16 registers) over the whole of K; fewer rows take more
// panels a call, so one row still has 8 independent sums in flight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>
#include <torch/library.h>

#include "chunk_schedule.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_rows.h"
#include "isa_built.h"
#include "int8_inputs.h"

namespace {

using kvserve_cpu::kDotBlock;
using kvserve_cpu::quantize_for_dot;
using kvserve_cpu::store_bf16_rows;

constexpr int64_t kPanel = 16;            // output columns a panel holds
constexpr int64_t kMaxRows = 6;           // rows of x a micro-kernel call takes
constexpr int64_t kChunkBytes = 192 << 10;  // panels a thread keeps hot in L2
// Each panel kind says how far ahead of its loads its stream is prefetched
// (kPrefetchRows, in panel rows: 2-4 KiB ahead measured best on a 2-core Zen 3; the
// hardware prefetcher alone left batch-16 steps 10-15% slower; int8 and int4 panels
// at one row ran 10-25% faster 4 KiB ahead than 2), once per 64-byte line
// (kRowsPerLine rows).

struct F32Panel {
  using T = float;
  static constexpr int64_t kRowElems = 16, kRowsPerLine = 1, kPrefetchRows = 64;
  static constexpr bool kIntegers = false, kGroupScales = false, kMins = false;
  static inline void load(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
};

struct BF16Panel {
  using T = uint16_t;
  static constexpr int64_t kRowElems = 16, kRowsPerLine = 1, kPrefetchRows = 64;
  static constexpr bool kIntegers = false, kGroupScales = false, kMins = false;
  static inline void load(const uint16_t* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
  }
};

// A panel row of int8 weights, widened; scaled by its group's scales where it has them.
struct I8Panel {
  using T = int8_t;
  static constexpr int64_t kRowElems = 16, kRowsPerLine = 4, kPrefetchRows = 256;
  static constexpr bool kIntegers = true, kGroupScales = false, kMins = false;
  static inline void load(const int8_t* p, __m256& lo, __m256& hi) {
    // Each half widened straight from memory (vpmovsxbd ymm, m64): no shuffle.
    lo = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
};

struct I8GroupPanel : I8Panel {
  static constexpr bool kGroupScales = true;
};

struct U4Panel {
  using T = uint8_t;
  static constexpr int64_t kRowElems = 8, kRowsPerLine = 8, kPrefetchRows = 512;
  static constexpr bool kIntegers = true, kGroupScales = true, kMins = true;
  static inline void load(const uint8_t* p, __m256& lo, __m256& hi) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
};

// The same int4 panels multiplied by x quantized to int8 (micro_dot), not widened;
// on CPUs with AVX512-VNNI and VBMI, by their dot-product instruction (micro_dot_vnni).
// int8 panels likewise, by VNNI only (micro_dot_i8_vnni).
struct U4DotPanel : U4Panel {};
struct U4VnniPanel : U4Panel {};
struct I8VnniPanel : I8Panel {};
struct I8GroupVnniPanel : I8GroupPanel {};

template <typename Panel>
constexpr bool kVnni = std::is_same_v<Panel, U4VnniPanel>;
template <typename Panel>
constexpr bool kI8Vnni = std::is_same_v<Panel, I8VnniPanel> ||
                         std::is_same_v<Panel, I8GroupVnniPanel>;
template <typename Panel>
constexpr bool kDot = std::is_same_v<Panel, U4DotPanel> || kVnni<Panel> || kI8Vnni<Panel>;

// Per-group float16 scales (and minimums), [P, groups, 16], for grouped panels.
struct Groups {
  const uint16_t* scales = nullptr;
  // int4 panels' minimums; null for symmetric ones (GGUF's Q4_0, --quantization
  // int4-sym: w = (q - 8) * scale), whose minimum is -8 * scale (int4_min).
  const uint16_t* mins = nullptr;
  int64_t len = 0;  // inputs a group spans (K for ungrouped panels)
  // With minimums: each row's sum of x over each group, [rows, K / len], from the
  // micro-kernel's first row on.
  const float* x_sums = nullptr;
  // For integer products (micro_dot): each row's inputs as int8, [rows, K], and the
  // step of each block of kDotBlock of them, [rows, K / kDotBlock].
  const int8_t* x_q = nullptr;
  const float* x_step = nullptr;
  // For int8 panels' integer products: the sum of each block's x_q, [rows, K / kDotBlock].
  const int32_t* x_q_sums = nullptr;
};

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Eight columns' minimums of an int4 group at `at`: stored, or -8 times the group's
// scale (already widened) where the panels are symmetric. -8 * scale is exact in
// float32, and float16 holds it exactly wherever the stored form would (pack_int4
// drops only minimums equal to it), so either form gives the same sums bit for bit;
// the symmetric one reads a tenth fewer bytes (4.5 bits a weight, not 5).
inline __m256 int4_min(const uint16_t* mins, int64_t at, __m256 scale) {
  return mins != nullptr ? half8(mins + at) : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
}

// Every register of a tile of sums (rows x panels x two halves of 16 columns) set to zero.
template <int MR, int NP, typename V>
inline void clear(V (&sums)[MR][NP][2], V zero) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) sums[m][p][0] = sums[m][p][1] = zero;
}

// A group's sums (part: rows x panels x two halves of 16 columns) added into the
// tile's, scaled by the group's scales and with its minimums' share where it has them.
template <int MR, int NP, typename Panel>
inline void fold_group(const __m256 (&part)[MR][NP][2], float (&acc)[MR][NP][kPanel],
                       const Groups& g, int64_t gi, int64_t groups) {
  if constexpr (!Panel::kGroupScales) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          float* sum = acc[m][p] + 8 * h;
          _mm256_store_ps(sum, _mm256_add_ps(_mm256_load_ps(sum), part[m][p][h]));
        }
  } else {
    __m256 x_sum[MR];
    if constexpr (Panel::kMins) {
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) x_sum[m] = _mm256_set1_ps(g.x_sums[m * groups + gi]);
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const int64_t at = (p * groups + gi) * kPanel;
      const __m256 scale[2] = {half8(g.scales + at), half8(g.scales + at + 8)};
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          float* sum = acc[m][p] + 8 * h;
          __m256 total = _mm256_fmadd_ps(part[m][p][h], scale[h], _mm256_load_ps(sum));
          if constexpr (Panel::kMins)
            total = _mm256_fmadd_ps(x_sum[m], int4_min(g.mins, at + 8 * h, scale[h]), total);
          _mm256_store_ps(sum, total);
        }
    }
  }
}

// The tile's sums into C, scaled per column where col_scale is given, bias added.
// n_left: output columns from the first panel on (the last panel may be partial).
template <int MR, int NP>
inline void store_tile(const float (&acc)[MR][NP][kPanel], float* __restrict c, int64_t ldc,
                       const float* __restrict col_scale, const float* __restrict bias,
                       int64_t n_left) {
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t cols = std::min(kPanel, n_left - p * kPanel);
    if (cols <= 0) break;
    float add[kPanel] = {0}, mul[kPanel];
    std::fill(mul, mul + kPanel, 1.0f);
    if (bias != nullptr) std::memcpy(add, bias + p * kPanel, sizeof(float) * cols);
    if (col_scale != nullptr) std::memcpy(mul, col_scale + p * kPanel, sizeof(float) * cols);
    const __m256 add_lo = _mm256_loadu_ps(add), add_hi = _mm256_loadu_ps(add + 8);
    const __m256 mul_lo = _mm256_loadu_ps(mul), mul_hi = _mm256_loadu_ps(mul + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      float* out = c + m * ldc + p * kPanel;
      const __m256 lo = _mm256_fmadd_ps(_mm256_load_ps(acc[m][p]), mul_lo, add_lo);
      const __m256 hi = _mm256_fmadd_ps(_mm256_load_ps(acc[m][p] + 8), mul_hi, add_hi);
      if (cols == kPanel) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
      } else {
        float tile[kPanel];
        _mm256_storeu_ps(tile, lo);
        _mm256_storeu_ps(tile + 8, hi);
        std::memcpy(out, tile, sizeof(float) * cols);
      }
    }
  }
}

// Rows [0, MR) of x times NP consecutive panels: C[m, p*16 + j] (see store_tile).
// g: the panels' group scales, if any, from the first panel's. Grouped panels are
// summed a group at a time over their integers, then scaled: sum_k x_k (q_k s + m)
// = s sum_k x_k q_k + m sum_k x_k, so the inner loop holds no scales (widening them
// in registers instead left too few registers for the sums, which then went through
// memory every step: 3x slower).
template <int MR, int NP, typename Panel>
inline void micro(const float* __restrict a, int64_t lda, const typename Panel::T* __restrict b,
                  int64_t k_len, const Groups& g, float* __restrict c, int64_t ldc,
                  const float* __restrict col_scale, const float* __restrict bias,
                  int64_t n_left) {
  const int64_t panel_stride = k_len * Panel::kRowElems;
  const int64_t group_len = Panel::kGroupScales ? g.len : k_len;
  const int64_t groups = group_len > 0 ? k_len / group_len : 0;
  // The sums of the groups so far live in memory (L1): touched once a group, they
  // leave the registers to the group's own sums.
  alignas(32) float acc[MR][NP][kPanel] = {};
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[MR][NP][2];
    clear(part, _mm256_setzero_ps());
    // One step of K: every row times one row of each panel, into the group's sums.
    auto step = [&](int64_t k) __attribute__((always_inline)) {
      __m256 w[NP][2];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
        Panel::load(b + p * panel_stride + k * Panel::kRowElems, w[p][0], w[p][1]);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          part[m][p][0] = _mm256_fmadd_ps(x, w[p][0], part[m][p][0]);
          part[m][p][1] = _mm256_fmadd_ps(x, w[p][1], part[m][p][1]);
        }
      }
    };
    auto prefetch = [&](int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(b + p * panel_stride +
                                                   (k + Panel::kPrefetchRows) * Panel::kRowElems),
                     _MM_HINT_T0);
    };
    const int64_t k0 = gi * group_len, k1 = k0 + group_len;
    int64_t k = k0;
    if constexpr (Panel::kRowsPerLine == 1) {
      // Two steps of K a loop turn: the loop's own instructions then cost half as
      // much beside its 12 FMAs a step (5-15% faster at 28 and 512 rows, Zen 3).
#pragma GCC unroll 2
      for (; k < k1; ++k) {
        prefetch(k);
        step(k);
      }
    } else {
      // A cache line of rows a turn, one prefetch each: no branch inside the turn,
      // which let the compiler spill sums across it.
      for (; k + Panel::kRowsPerLine <= k1; k += Panel::kRowsPerLine) {
        prefetch(k);
#pragma GCC unroll 8
        for (int64_t j = 0; j < Panel::kRowsPerLine; ++j) step(k + j);
      }
      for (; k < k1; ++k) step(k);
    }
    fold_group<MR, NP, Panel>(part, acc, g, gi, groups);
  }
  store_tile<MR, NP>(acc, c, ldc, col_scale, bias, n_left);
}

// micro for int4 panels and x quantized to int8 in blocks of kDotBlock inputs (x_k ~
// step * x_q[k], g.x_q and g.x_step): a block's products are summed as integers,
// 32 an instruction (vpmaddubsw: unsigned 4-bit weights times signed 8-bit inputs,
// two K rows summed into 16 bits) instead of 8 a fused multiply-add after widening
// each weight to float32, which left the one-row GEMV bound by the widening rather
// than by memory. The sums stay within int16 for a whole block: each 16-bit sum
// takes 16 of its 32 products, at most 16 * 15 * 127 = 30480. Blocks are then
// scaled by their step, groups by their scale, and the minimums' share is taken
// from the float sums of x (exact).
//
// Four K rows of a panel are one 32-byte load: 128-bit lane 0 holds rows k and k + 1,
// lane 1 rows k + 2 and k + 3, each as 8 bytes of (column j, column j + 8) nibbles.
// Shuffling each lane's bytes to (row k, row k + 1) of column j side by side pairs
// them for vpmaddubsw; the low nibbles are then columns 0-7 and the high ones 8-15,
// and each lane sums its own two rows (added together once a block).
template <int MR, int NP>
inline void micro_dot(int64_t lda, const uint8_t* __restrict b, int64_t k_len,
                      const Groups& g, float* __restrict c, int64_t ldc,
                      const float* __restrict col_scale, const float* __restrict bias,
                      int64_t n_left) {
  const int64_t panel_stride = k_len * U4Panel::kRowElems;
  const int64_t groups = k_len / g.len, blocks = k_len / kDotBlock;
  const __m256i row_pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                             0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  // x_q[k..k+3] broadcast as (k, k + 1) pairs in lane 0 and (k + 2, k + 3) in lane 1
  const __m256i x_pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  const __m256i nibble = _mm256_set1_epi8(15);
  alignas(32) float acc[MR][NP][kPanel] = {};
  const int64_t blocks_per_group = g.len / kDotBlock;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[MR][NP][2];
    clear(part, _mm256_setzero_ps());
    for (int64_t bi = gi * blocks_per_group; bi < (gi + 1) * blocks_per_group; ++bi) {
      __m256i sum[MR][NP][2];
      clear(sum, _mm256_setzero_si256());
      const int64_t k0 = bi * kDotBlock;
      // Eight steps of four K rows; one prefetch per 64-byte line (two steps).
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + kDotBlock; k += 4) {
        if ((k - k0) % 8 == 0) {
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            const uint8_t* ahead =
                b + p * panel_stride + (k + U4Panel::kPrefetchRows) * U4Panel::kRowElems;
            _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
          }
        }
        __m256i lo[NP], hi[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const __m256i v = _mm256_shuffle_epi8(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                  b + p * panel_stride + k * U4Panel::kRowElems)),
              row_pairs);
          lo[p] = _mm256_and_si256(v, nibble);
          hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          int32_t four;
          std::memcpy(&four, g.x_q + m * lda + k, sizeof(four));
          const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(four), x_pairs);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            sum[m][p][0] = _mm256_add_epi16(sum[m][p][0], _mm256_maddubs_epi16(lo[p], x));
            sum[m][p][1] = _mm256_add_epi16(sum[m][p][1], _mm256_maddubs_epi16(hi[p], x));
          }
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 step = _mm256_set1_ps(g.x_step[m * blocks + bi]);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i s = sum[m][p][h];
            const __m256i both = _mm256_add_epi32(
                _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
            part[m][p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), step, part[m][p][h]);
          }
      }
    }
    fold_group<MR, NP, U4Panel>(part, acc, g, gi, groups);
  }
  store_tile<MR, NP>(acc, c, ldc, col_scale, bias, n_left);
}

// The micro-kernels for CPUs with AVX512-VNNI (they use clear, fold_group and
// store_tile above).
#include "vnni_dots.h"

struct Problem {
  const float* x;
  int64_t rows, k_len;
  const void* weight;
  Groups groups;
  int64_t n;
  const float* col_scale;  // int8 weights with one scale per output column
  const float* bias;
  float* out;
  bool int8_inputs;  // int4 panels may take x quantized to int8 (micro_dot)
};

// MR rows of x over panels [p0, p1), NP panels a call. `weight` and `groups` point
// at panel 0 (a thread's buffer of widened panels may hold only [p0, p1)).
template <int MR, int NP, typename Panel>
void sweep(const Problem& q, const typename Panel::T* weight, const Groups& groups,
           int64_t row, int64_t p0, int64_t p1) {
  const float* a = q.x + row * q.k_len;
  float* c = q.out + row * q.n;
  const int64_t panel_stride = q.k_len * Panel::kRowElems;
  const int64_t group_stride = groups.len > 0 ? q.k_len / groups.len * kPanel : 0;
  auto call = [&](auto np, int64_t p) {
    Groups g = groups;
    if (g.x_sums != nullptr) g.x_sums += row * (q.k_len / g.len);
    if constexpr (Panel::kGroupScales) {
      g.scales += p * group_stride;
      if constexpr (Panel::kMins) if (g.mins != nullptr) g.mins += p * group_stride;
    }
    const float* col_scale = q.col_scale ? q.col_scale + p * kPanel : nullptr;
    const float* bias = q.bias ? q.bias + p * kPanel : nullptr;
    if constexpr (kDot<Panel>) {
      g.x_q += row * q.k_len;
      g.x_step += row * (q.k_len / kDotBlock);
      if (g.x_q_sums != nullptr) g.x_q_sums += row * (q.k_len / kDotBlock);
    }
    if constexpr (kI8Vnni<Panel>) {
      using Base = std::conditional_t<Panel::kGroupScales, I8GroupPanel, I8Panel>;
      micro_dot_i8_vnni<MR, decltype(np)::value, Base>(
          q.k_len, weight + p * panel_stride, q.k_len, g, c + p * kPanel, q.n, col_scale,
          bias, q.n - p * kPanel);
    } else if constexpr (kVnni<Panel> && MR == 1) {
      micro_dot_vnni_row<decltype(np)::value>(weight + p * panel_stride, q.k_len, g,
                                              c + p * kPanel, q.n, col_scale, bias,
                                              q.n - p * kPanel);
    } else if constexpr (kVnni<Panel>) {
      micro_dot_vnni<MR, decltype(np)::value>(q.k_len, weight + p * panel_stride, q.k_len, g,
                                              c + p * kPanel, q.n, col_scale, bias,
                                              q.n - p * kPanel);
    } else if constexpr (kDot<Panel>) {
      micro_dot<MR, decltype(np)::value>(q.k_len, weight + p * panel_stride, q.k_len, g,
                                         c + p * kPanel, q.n, col_scale, bias,
                                         q.n - p * kPanel);
    } else {
      micro<MR, decltype(np)::value, Panel>(a, q.k_len, weight + p * panel_stride, q.k_len, g,
                                            c + p * kPanel, q.n, col_scale, bias,
                                            q.n - p * kPanel);
    }
  };
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) call(std::integral_constant<int, NP>{}, p);
  for (; p < p1; ++p) call(std::integral_constant<int, 1>{}, p);
}

// Panels a micro-kernel call takes for MR rows: as many as keep 8-12 sums in
// registers. Integer panels take fewer: widening them takes registers of its own,
// and with too few left the compiler keeps some sums in memory.
template <typename Panel, int MR>
constexpr int panels_per_call() {
  // VNNI: one 512-bit register of sums a row and panel; two panels a call for up to
  // 3 rows (more chains of dot products in flight), one past that (faster at 4-6 rows
  // than two: the group's float sums then stay in registers too)
  if constexpr (kVnni<Panel>) return MR <= 3 ? 2 : 1;
  if constexpr (kI8Vnni<Panel>) return 2;  // 16 columns a 512-bit register
  if constexpr (kDot<Panel>) return 1;  // one row: 20% faster than two panels a call
  if constexpr (MR >= 4) return 1;
  if constexpr (Panel::kIntegers) return MR == 3 ? 1 : 2;
  return MR == 3 ? 2 : MR == 2 ? 3 : 4;
}

// The rows left after the blocks of 6, each count with its own micro-kernel.
template <typename Panel>
void sweep_rows(int64_t rows, const Problem& q, const typename Panel::T* weight,
                const Groups& groups, int64_t row, int64_t p0, int64_t p1) {
  switch (rows) {
    case 6: return sweep<6, panels_per_call<Panel, 6>(), Panel>(q, weight, groups, row, p0, p1);
    case 5: return sweep<5, panels_per_call<Panel, 5>(), Panel>(q, weight, groups, row, p0, p1);
    case 4: return sweep<4, panels_per_call<Panel, 4>(), Panel>(q, weight, groups, row, p0, p1);
    case 3: return sweep<3, panels_per_call<Panel, 3>(), Panel>(q, weight, groups, row, p0, p1);
    case 2: return sweep<2, panels_per_call<Panel, 2>(), Panel>(q, weight, groups, row, p0, p1);
    default: return sweep<1, panels_per_call<Panel, 1>(), Panel>(q, weight, groups, row, p0, p1);
  }
}

template <typename Panel>
void gemm(const Problem& q) {
  const int64_t panels = (q.n + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(
      1, kChunkBytes / (std::max<int64_t>(1, q.k_len) * Panel::kRowElems *
                        int64_t(sizeof(typename Panel::T))));
  const auto* weight = static_cast<const typename Panel::T*>(q.weight);
  kvserve_cpu::for_each_chunk(panels, chunk, [&](int64_t c0, int64_t c1) {
    for (int64_t row = 0; row < q.rows; row += kMaxRows)
      sweep_rows<Panel>(std::min(kMaxRows, q.rows - row), q, weight, q.groups, row, c0, c1);
  });
}

// Up to this many rows the quantized panels are widened in registers as each block of
// rows reads them; past it, once per chunk into a float32 buffer (measured on the
// 2-core Zen 3 for the default model's gate/up shape: in registers 15-30% faster at 8
// rows, the buffer 10-35% faster at 16-64).
constexpr int64_t kWidenInRegistersRows = 12;
// Up to as many rows, int4 panels with groups of whole blocks of kDotBlock take
// integer products (micro_dot) over x quantized to int8 where the caller allows it
// (int8_inputs: the layer was quantized, not a float checkpoint's weights found on
// a grid): at one row 1.4x the widening's speed (the default model's int4 layers,
// 2-core Zen 3), never slower up to 12. packing.py's INT4_DOT_ROWS says the same.
constexpr int64_t kDotRows = kWidenInRegistersRows;
// With AVX512-VNNI the integer products (int4 and int8 panels) are the faster way at
// any number of rows, prompt chunks included: its dot products do four multiply-adds
// a lane where bf16's do two. A 1B model's gate/up (16384 x 2048) on a 2-core Zen 4,
// bf16 rows (bench/quantized_rows.py): int8 15.7 ms at 128 rows and 61.1 at 512, int4
// 20.3 and 81.9; oneDNN's bf16 GEMM on the bf16 weights 21.2 and 78.5; the quantized
// weight widened per call for it (onednn_product) 32.1 and 93.2. The price is the
// inputs' rounding, as llama.cpp's CPU path pays it at every batch size: the default
// model's perplexity in bf16 (bench/quality.py) +1.15% from its Q4_1 file where it was
// +0.00% with float prompt rows, int8 +0.60% where it was +0.28%. packing.py's
// int4_dot_rows / int8_dot_rows say the same.

// Whether x is quantized to int8 for integer products with these panels: where the
// caller allows it (int8_inputs) and their groups (int8 per column: K) are whole
// blocks of kDotBlock; with VNNI at any number of rows, without it int4 panels only,
// up to kDotRows.
template <typename Panel>
bool takes_dots(const Problem& q) {
  const int64_t group_len = Panel::kGroupScales ? q.groups.len : q.k_len;
  if (!q.int8_inputs || q.k_len == 0 || group_len % kDotBlock != 0) return false;
  return vnni_here() || (Panel::kMins && q.rows <= kDotRows);
}

// Rows [k0, k1) of panel p widened (and group-scaled) to float32, [k1 - k0, 16].
template <typename Panel>
void widen_rows(const Problem& q, int64_t p, int64_t k0, int64_t k1, float* out) {
  const auto* src = static_cast<const typename Panel::T*>(q.weight) +
                    p * q.k_len * Panel::kRowElems;
  const int64_t groups = Panel::kGroupScales ? q.k_len / q.groups.len : 1;
  __m256 s_lo = _mm256_set1_ps(1.0f), s_hi = s_lo, m_lo = _mm256_setzero_ps(), m_hi = m_lo;
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (Panel::kGroupScales) {
      if (k == k0 || k % q.groups.len == 0) {
        const int64_t at = (p * groups + k / q.groups.len) * kPanel;
        s_lo = half8(q.groups.scales + at);
        s_hi = half8(q.groups.scales + at + 8);
        if constexpr (Panel::kMins) {
          m_lo = int4_min(q.groups.mins, at, s_lo);
          m_hi = int4_min(q.groups.mins, at + 8, s_hi);
        }
      }
    }
    __m256 lo, hi;
    Panel::load(src + k * Panel::kRowElems, lo, hi);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(lo, s_lo, m_lo));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(hi, s_hi, m_hi));
    out += kPanel;
  }
}

// Panels [p0, p1) of quantized weights, widened (and group-scaled) to float32 panels.
template <typename Panel>
void widen(const Problem& q, int64_t p0, int64_t p1, float* out) {
  for (int64_t p = p0; p < p1; ++p, out += q.k_len * kPanel)
    widen_rows<Panel>(q, p, 0, q.k_len, out);
}

// Each row's sum of x over each group, [rows, K / group]: the minimums' share of
// every column.
std::vector<float> group_sums(const Problem& q) {
  std::vector<float> sums(q.rows * (q.k_len / q.groups.len));
  kvserve_cpu::group_sums(q.x, q.rows, q.k_len, q.groups.len, sums.data());
  return sums;
}

// Quantized panels times x quantized to int8 (micro_dot, micro_dot_vnni,
// micro_dot_i8_vnni).
template <typename DotPanel>
void dot_gemm(const Problem& q) {
  std::vector<float> sums;
  if constexpr (DotPanel::kMins) sums = group_sums(q);
  std::vector<int8_t> x_q(q.rows * q.k_len);
  std::vector<float> x_step(q.rows * q.k_len / kDotBlock);
  quantize_for_dot(q.x, q.rows, q.k_len, x_q.data(), x_step.data());
  std::vector<int32_t> x_q_sums;
  if constexpr (kI8Vnni<DotPanel>) {  // their share of (w + 128) x: see micro_dot_i8_vnni
    x_q_sums.resize(x_step.size());
    for (size_t bi = 0; bi < x_q_sums.size(); ++bi) {
      int32_t total = 0;
      for (int64_t i = 0; i < kDotBlock; ++i) total += x_q[bi * kDotBlock + i];
      x_q_sums[bi] = total;
    }
  }
  Problem dots = q;
  dots.groups.x_q_sums = x_q_sums.empty() ? nullptr : x_q_sums.data();
  dots.groups.x_sums = sums.empty() ? nullptr : sums.data();
  dots.groups.x_q = x_q.data();
  dots.groups.x_step = x_step.data();
  gemm<DotPanel>(dots);
}

template <typename Panel>
void quantized_gemm(const Problem& q) {
  if (takes_dots<Panel>(q)) {
#if KVSERVE_AVX512_BUILT
    if constexpr (Panel::kMins)
      return vnni_here() ? dot_gemm<U4VnniPanel>(q) : dot_gemm<U4DotPanel>(q);
    else
      return dot_gemm<std::conditional_t<Panel::kGroupScales, I8GroupVnniPanel,
                                         I8VnniPanel>>(q);
#else  // no VNNI: only int4 panels take integer products (takes_dots)
    if constexpr (Panel::kMins) return dot_gemm<U4DotPanel>(q);
#endif
  }
  if (q.rows <= kWidenInRegistersRows) {
    if constexpr (!Panel::kMins) {
      return gemm<Panel>(q);
    } else {
      const std::vector<float> sums = group_sums(q);
      Problem with_sums = q;
      with_sums.groups.x_sums = sums.data();
      return gemm<Panel>(with_sums);
    }
  }
  const int64_t panels = (q.n + kPanel - 1) / kPanel;
  const int64_t panel_floats = std::max<int64_t>(1, q.k_len) * kPanel;
  const int64_t chunk =
      std::max<int64_t>(1, kChunkBytes / (panel_floats * int64_t(sizeof(float))));
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Kept per thread across calls: a fresh 192 KiB allocation is an mmap and its
    // page faults on every call (glibc maps blocks past 128 KiB).
    thread_local std::vector<float> buffer;
    buffer.resize(std::max<size_t>(buffer.size(), std::min(chunk, end - begin) * panel_floats));
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      widen<Panel>(q, c0, c1, buffer.data());
      // The buffer holds panels [c0, c1): seen from panel 0, it starts c0 earlier.
      const float* base = buffer.data() - c0 * panel_floats;
      for (int64_t row = 0; row < q.rows; row += kMaxRows)
        sweep_rows<F32Panel>(std::min(kMaxRows, q.rows - row), q, base, Groups{}, row, c0,
                             c1);
    }
  });
}

// Past this many rows of a bf16 model, on a CPU with AVX512-BF16, a quantized weight
// that takes no integer products (takes_dots: a CPU without VNNI, or a float
// checkpoint's weights found on a grid) is widened once a call into a plain bf16
// matrix that oneDNN's bf16 GEMM multiplies:
// its dot-product instructions do twice the work per cycle of the float32 FMAs the
// kernel's own widening feeds, which pays for the widening once the rows make the
// product bound by arithmetic, not by the weight's bytes (a prompt chunk). Measured on
// a 2-core Zen 4 for a 1B model's gate/up (16384 x 2048): int4 22.4 -> 24.0 ms at 64
// rows, 42.8 -> 34.6 ms at 128; int8 24.5 -> 22.7 ms at 64, 45.8 -> 33.6 at 128.
constexpr int64_t kOneDnnRows = 64;

bool onednn_bf16_is_fast() {
  static const bool fast = __builtin_cpu_supports("avx512bf16");
  return fast;
}

// Inputs a block of the plain matrix spans: its rows, one per input, stay few enough
// that each panel's stores touch the same pages as the panel before (a whole panel's
// K rows at once, a page a row, made the widening about twice as slow).
constexpr int64_t kMatrixBlockRows = 64;

template <typename Panel>
at::Tensor onednn_product(const Problem& q, const at::Tensor& x) {
  const int64_t panels = (q.n + kPanel - 1) / kPanel, width = panels * kPanel;
  // Kept across calls (the engine calls from one thread): a fresh matrix of tens of
  // MiB would be an mmap and its page faults at every call. It holds the widest
  // quantized layer of the model in bf16 (64 MiB for a 1B model's gate/up).
  thread_local at::Tensor matrix;
  if (!matrix.defined() || matrix.numel() < q.k_len * width)
    matrix = at::empty({q.k_len * width}, x.options());
  at::Tensor weight = matrix.narrow(0, 0, q.k_len * width).view({q.k_len, width});
  auto* dst = reinterpret_cast<uint16_t*>(weight.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float block[kMatrixBlockRows * kPanel];
    for (int64_t k0 = 0; k0 < q.k_len; k0 += kMatrixBlockRows) {
      const int64_t k1 = std::min(q.k_len, k0 + kMatrixBlockRows);
      for (int64_t p = begin; p < end; ++p) {
        widen_rows<Panel>(q, p, k0, k1, block);
        store_bf16_rows(block, k1 - k0, q.col_scale ? q.col_scale + p * kPanel : nullptr,
                        dst + k0 * width + p * kPanel, width);
      }
    }
  });
  return at::mm(x, weight).narrow(1, 0, q.n);
}

// f called with the kind of quantized panels these are (an empty value of its type):
// int4 pairs, int8 with a scale per group of inputs, or int8 with one per column.
template <typename F>
decltype(auto) with_quantized_panel(at::ScalarType type, const Groups& groups, F&& f) {
  if (type == at::kByte) return f(U4Panel{});
  if (groups.scales != nullptr) return f(I8GroupPanel{});
  return f(I8Panel{});
}

void check_groups(const at::Tensor& weight, int64_t k, const std::optional<at::Tensor>& t,
                  const char* what) {
  TORCH_CHECK(t.has_value() && t->defined() && t->scalar_type() == at::kHalf &&
                  t->dim() == 3 && t->size(0) == weight.size(0) && t->size(1) > 0 &&
                  k >= t->size(1) && k % t->size(1) == 0 && t->size(2) == kPanel &&
                  t->is_contiguous(),
              "packed_linear: ", weight.scalar_type(), " panels ", weight.sizes(),
              " need float16 group ", what, " [", weight.size(0), ", K / group, ", kPanel,
              "]");
}

// A bf16 product's float32 sums, before they are rounded to bf16, go to a buffer kept
// per thread across calls up to this size: a fresh one past glibc's largest mmap
// threshold (32 MiB; a 512-row prompt chunk of a 1B model's gate/up, 512 x 16384, is
// 32 MiB) is mapped and faulted in page by page on every call (11-15 thousand faults:
// 44 ms against 29 for the product itself, 2-core Zen 5).
constexpr int64_t kKeptSumsBytes = 128 << 20;

at::Tensor float_sums_buffer(int64_t rows, int64_t n) {
  const int64_t values = rows * n;
  if (values * int64_t(sizeof(float)) > kKeptSumsBytes) return at::empty({rows, n}, at::kFloat);
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.numel() < values) kept = at::empty({values}, at::kFloat);
  return kept.narrow(0, 0, values).view({rows, n});
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, bool int8_inputs) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "packed_linear: x must be 2-D float32 or bfloat16, got ", x.sizes(), " ",
              x.scalar_type());
  const auto type = weight.scalar_type();
  const int64_t row_elems = type == at::kByte ? kPanel / 2 : kPanel;
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == x.size(1) &&
                  weight.size(2) == row_elems && weight.size(0) * kPanel >= n &&
                  weight.is_contiguous(),
              "packed_linear: weight ", weight.sizes(), " is not packed for ", x.size(1),
              " inputs and ", n, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == n),
              "packed_linear: the bias must be ", n, " values of x's dtype");
  const bool has_scales = scales.has_value() && scales->defined();
  const bool has_mins = mins.has_value() && mins->defined();
  const int64_t k = x.size(1);
  Groups groups;
  const float* col_scale = nullptr;
  if (type == at::kFloat || type == at::kBFloat16) {
    TORCH_CHECK(!has_scales && !has_mins, "packed_linear: float panels take no scales");
  } else if (type == at::kChar && has_scales && scales->scalar_type() == at::kFloat) {
    TORCH_CHECK(!has_mins && scales->is_contiguous() && scales->numel() == weight.size(0) * kPanel,
                "packed_linear: per-column int8 scales must be ", weight.size(0) * kPanel,
                " contiguous float32 values and no minimums");
    col_scale = scales->data_ptr<float>();
  } else if (type == at::kChar) {
    check_groups(weight, k, scales, "scales");
    TORCH_CHECK(!has_mins, "packed_linear: int8 panels take no minimums");
  } else if (type == at::kByte) {
    check_groups(weight, k, scales, "scales");
    if (has_mins) {  // none: symmetric panels (Groups::mins)
      check_groups(weight, k, mins, "minimums");
      TORCH_CHECK(mins->size(1) == scales->size(1), "packed_linear: scales and minimums "
                  "of different group sizes");
    }
  } else {
    TORCH_CHECK(false, "packed_linear: packed weights are float32, bfloat16, int8 or "
                "uint8 (int4 pairs), not ", type);
  }
  if (has_scales && scales->scalar_type() == at::kHalf) {
    groups.scales = reinterpret_cast<const uint16_t*>(scales->data_ptr());
    groups.len = k / scales->size(1);
  }
  if (has_mins) groups.mins = reinterpret_cast<const uint16_t*>(mins->data_ptr());
  const bool quantized = type != at::kFloat && type != at::kBFloat16;
  if (quantized && x.scalar_type() == at::kBFloat16 && x.size(0) > kOneDnnRows && k > 0 &&
      onednn_bf16_is_fast()) {
    const Problem shape{nullptr, x.size(0), k, weight.data_ptr(), groups, n, col_scale,
                        nullptr, nullptr, int8_inputs};
    const bool dots = with_quantized_panel(
        type, groups, [&](auto panel) { return takes_dots<decltype(panel)>(shape); });
    if (!dots) {
      const at::Tensor x_rows = x.contiguous();
      at::Tensor y = with_quantized_panel(type, groups, [&](auto panel) {
        return onednn_product<decltype(panel)>(shape, x_rows);
      });
      return (has_bias ? y.add(*bias) : y).contiguous();
    }
  }
  // bfloat16 rows (a bf16 model's quantized layers) are summed in float32 like any
  // others: widened once here, the products rounded back to bf16 at the end (a
  // decode step's rows are a few KiB; the weights are what the kernel reads).
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  const at::Tensor bias32 = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = x.scalar_type() == at::kBFloat16 ? float_sums_buffer(rows.size(0), n)
                                                    : at::empty({rows.size(0), n}, rows.options());
  if (rows.size(0) == 0 || n == 0) return out.to(x.scalar_type());
  // (K = 0 needs no case of its own: the sums stay 0 and the bias is added.)
  const Problem q{rows.data_ptr<float>(), rows.size(0), k, weight.data_ptr(), groups, n,
                  col_scale, has_bias ? bias32.data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), int8_inputs};
  if (type == at::kFloat)
    gemm<F32Panel>(q);
  else if (type == at::kBFloat16)
    gemm<BF16Panel>(q);
  else
    with_quantized_panel(type, groups, [&](auto panel) { quantized_gemm<decltype(panel)>(q); });
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "packed_linear(Tensor x, Tensor weight, int n, Tensor? bias, Tensor? scales=None, "
      "Tensor? mins=None, bool int8_inputs=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("packed_linear", packed_linear); }
