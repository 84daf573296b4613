// packed_gemm.cpp's micro-kernels for CPUs with AVX512-VNNI and VBMI: integer
// products of int4 and int8 panels with x quantized to int8 (vpdpbusd). Included by
// packed_gemm.cpp inside its namespace, after the helpers they share (clear,
// fold_group, store_tile); each is compiled for those instructions alone and called
// only where the CPU has them (vnni_here). Their loops over groups and blocks repeat
// micro_dot's: a step compiled for VNNI cannot be inlined into a loop that is not,
// and a call per step of four K rows would cost more than the step.
#pragma once

// What micro_dot_vnni is compiled for; called only where the CPU has it (vnni_here),
// and not where $KVSERVE_NO_VNNI is set (the tests' way to reach micro_dot there).
#define KVSERVE_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"

bool vnni_here() {
  static const bool here = std::getenv("KVSERVE_NO_VNNI") == nullptr &&
                           __builtin_cpu_supports("avx512vnni") &&
                           __builtin_cpu_supports("avx512vbmi") &&
                           __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bw");
  return here;
}

// micro_dot with AVX512-VNNI (vpdpbusd on 256-bit registers: four unsigned 4-bit
// weights times four signed 8-bit inputs summed into each 32-bit lane, 32 products an
// instruction with no 16-bit intermediate) where micro_dot needs vpmaddubsw, a 16-bit
// add and a widening at the end of the block. A 32-byte load holds K rows k..k+3 as
// 8 bytes each; one byte permutation (vpermb) puts each column's four rows side by
// side, so lane j holds column j's low nibbles (columns 0-7) or high ones (8-15).
// Cheap enough per row that it pays for many rows, not only a decode's few (at 16-64
// rows the widening path's float32 FMAs are the limit). No lambdas here: they would
// not inherit the function's target.
template <int MR, int NP>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_vnni(
    int64_t lda, const uint8_t* __restrict b, int64_t k_len, const Groups& g,
    float* __restrict c, int64_t ldc, const float* __restrict col_scale,
    const float* __restrict bias, int64_t n_left) {
  const int64_t panel_stride = k_len * U4Panel::kRowElems;
  const int64_t groups = k_len / g.len, blocks = k_len / kDotBlock;
  const __m256i quads = _mm256_setr_epi8(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11,
                                         19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22,
                                         30, 7, 15, 23, 31);
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
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + kDotBlock; k += 4) {
        if ((k - k0) % 8 == 0) {
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p)
            _mm_prefetch(reinterpret_cast<const char*>(
                             b + p * panel_stride + (k + U4Panel::kPrefetchRows) * U4Panel::kRowElems),
                         _MM_HINT_T0);
        }
        __m256i lo[NP], hi[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const __m256i v = _mm256_permutexvar_epi8(
              quads, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                         b + p * panel_stride + k * U4Panel::kRowElems)));
          lo[p] = _mm256_and_si256(v, nibble);
          hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          int32_t four;
          std::memcpy(&four, g.x_q + m * lda + k, sizeof(four));
          const __m256i x = _mm256_set1_epi32(four);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            sum[m][p][0] = _mm256_dpbusd_epi32(sum[m][p][0], lo[p], x);
            sum[m][p][1] = _mm256_dpbusd_epi32(sum[m][p][1], hi[p], x);
          }
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 step = _mm256_set1_ps(g.x_step[m * blocks + bi]);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            part[m][p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][p][h]), step, part[m][p][h]);
      }
    }
    fold_group<MR, NP, U4Panel>(part, acc, g, gi, groups);
  }
  store_tile<MR, NP>(acc, c, ldc, col_scale, bias, n_left);
}


// micro_dot_vnni for one row of x (a batch-1 decode, bound by the weight's bytes) on
// 512-bit registers: a 64-byte load is K rows k..k+7 of the panel, and one vpermb
// puts byte j of rows k..k+3 in 32-bit lane 2j and of rows k+4..k+7 in lane 2j + 1,
// which x's eight inputs broadcast as one 64-bit word meet; adjacent lanes are added
// at the end of each block. Half the instructions a byte of micro_dot_vnni<1, 2>, and
// the stream prefetched into L2 (T1), not L1: on the 2-core Zen 4 a 1B model's int4
// layers of one step (608 MB) took 0.88x the time (median of 40 alternating steps,
// 22.3 against 25.4 ms; the prefetch alone 0.95x), the same sums bit for bit.
template <int NP>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_vnni_row(
    const uint8_t* __restrict b, int64_t k_len, const Groups& g, float* __restrict c,
    int64_t ldc, const float* __restrict col_scale, const float* __restrict bias,
    int64_t n_left) {
  constexpr int64_t kPrefetchBytes = 4096;
  const int64_t panel_stride = k_len * U4Panel::kRowElems;
  const int64_t groups = k_len / g.len;
  alignas(64) uint8_t order[64];
  for (int col = 0; col < 8; ++col)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        order[4 * (2 * col + h) + r] = static_cast<uint8_t>(8 * (4 * h + r) + col);
  const __m512i quads = _mm512_load_si512(order);
  const __m512i nibble = _mm512_set1_epi8(15);
  alignas(32) float acc[1][NP][kPanel] = {};
  const int64_t blocks_per_group = g.len / kDotBlock;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[1][NP][2];
    clear(part, _mm256_setzero_ps());
    for (int64_t bi = gi * blocks_per_group; bi < (gi + 1) * blocks_per_group; ++bi) {
      __m512i sum[NP][2];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) sum[p][0] = sum[p][1] = _mm512_setzero_si512();
      const int64_t k0 = bi * kDotBlock;
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + kDotBlock; k += 8) {
        int64_t eight;
        std::memcpy(&eight, g.x_q + k, sizeof(eight));
        const __m512i x = _mm512_set1_epi64(eight);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const uint8_t* rows = b + p * panel_stride + k * U4Panel::kRowElems;
          _mm_prefetch(reinterpret_cast<const char*>(rows + kPrefetchBytes), _MM_HINT_T1);
          const __m512i v = _mm512_permutexvar_epi8(quads, _mm512_loadu_si512(rows));
          sum[p][0] = _mm512_dpbusd_epi32(sum[p][0], _mm512_and_si512(v, nibble), x);
          sum[p][1] = _mm512_dpbusd_epi32(
              sum[p][1], _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), x);
        }
      }
      const __m256 step = _mm256_set1_ps(g.x_step[bi]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          // lane 2j + lane 2j + 1 into the low half of each 64-bit word, kept (vpmovqd)
          const __m512i s = _mm512_add_epi32(sum[p][h], _mm512_srli_epi64(sum[p][h], 32));
          part[0][p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(s)), step,
                                          part[0][p][h]);
        }
    }
    fold_group<1, NP, U4Panel>(part, acc, g, gi, groups);
  }
  store_tile<1, NP>(acc, c, ldc, col_scale, bias, n_left);
}

// int8 panels ([K, 16] signed bytes: I8Panel with a scale per column, I8GroupPanel
// with one per group of whole blocks) times x quantized to int8. vpdpbusd takes one
// unsigned operand: x is given as x_q + 128 (g.x_q holds those bytes, see dot_gemm),
// so each lane sums (x + 128) w and the block's sum of w times 128 comes off at its
// end: sum x w = sum (x + 128) w - 128 sum w. The weights' sums take one vpdpbusd a
// panel row (against ones), shared by every row of x. A 64-byte load is K rows
// k..k+3 of the panel; one vpermb on the 512-bit register puts each column's four
// rows in its own 32-bit lane, columns 0-15 in order.
template <int MR, int NP, typename Base>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_i8_vnni(
    int64_t lda, const int8_t* __restrict b, int64_t k_len, const Groups& g,
    float* __restrict c, int64_t ldc, const float* __restrict col_scale,
    const float* __restrict bias, int64_t n_left) {
  const int64_t panel_stride = k_len * I8Panel::kRowElems;
  const int64_t group_len = Base::kGroupScales ? g.len : k_len;
  const int64_t groups = k_len / group_len, blocks = k_len / kDotBlock;
  alignas(64) uint8_t order[64];
  for (int j = 0; j < 16; ++j)
    for (int r = 0; r < 4; ++r) order[4 * j + r] = static_cast<uint8_t>(16 * r + j);
  const __m512i quads = _mm512_load_si512(order);
  const __m512i ones = _mm512_set1_epi8(1);
  alignas(32) float acc[MR][NP][kPanel] = {};
  const int64_t blocks_per_group = group_len / kDotBlock;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[MR][NP][2];
    clear(part, _mm256_setzero_ps());
    for (int64_t bi = gi * blocks_per_group; bi < (gi + 1) * blocks_per_group; ++bi) {
      __m512i sum[MR][NP], w_sum[NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        w_sum[p] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) sum[m][p] = _mm512_setzero_si512();
      }
      const int64_t k0 = bi * kDotBlock;
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + kDotBlock; k += 4) {
        __m512i w[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const int8_t* row = b + p * panel_stride + k * I8Panel::kRowElems;
          _mm_prefetch(reinterpret_cast<const char*>(row + I8Panel::kPrefetchRows *
                                                               I8Panel::kRowElems),
                       _MM_HINT_T0);
          w[p] = _mm512_permutexvar_epi8(quads, _mm512_loadu_si512(row));
          w_sum[p] = _mm512_dpbusd_epi32(w_sum[p], ones, w[p]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          int32_t four;
          std::memcpy(&four, g.x_q + m * lda + k, sizeof(four));
          const __m512i x = _mm512_set1_epi32(four);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) sum[m][p] = _mm512_dpbusd_epi32(sum[m][p], x, w[p]);
        }
      }
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const __m512i offset = _mm512_slli_epi32(w_sum[p], 7);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m][p], offset));
          const __m256 step = _mm256_set1_ps(g.x_step[m * blocks + bi]);
          const __m256 lo = _mm512_castps512_ps256(dot);
          const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dot), 1));
          part[m][p][0] = _mm256_fmadd_ps(lo, step, part[m][p][0]);
          part[m][p][1] = _mm256_fmadd_ps(hi, step, part[m][p][1]);
        }
      }
    }
    fold_group<MR, NP, Base>(part, acc, g, gi, groups);
  }
  store_tile<MR, NP>(acc, c, ldc, col_scale, bias, n_left);
}
