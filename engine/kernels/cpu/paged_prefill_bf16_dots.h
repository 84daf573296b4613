// paged_prefill's scores over a bf16 cache where the CPU has AVX512-BF16 (included by
// paged_prefill.cpp inside its namespace): the bf16 queries and keys multiplied as
// they lie by _mm512_dpbf16_ps, two dims an instruction, a product of two bf16 values
// exact in float32, instead of widened to float32 and multiplied-added one dim at a
// time on 8 lanes. Each K^T tile is then 16 keys' dims in pairs: [D / 2][16] 32-bit
// words, word (p, i) key i's dims 2p and 2p + 1; a query row is D / 2 such words,
// unscaled (q * scale rounded to bf16 would not be exact), the scale applied to the
// sums. The scores are float32 dot products summed in another order than the AVX2
// tiles': they differ from theirs in the last bits. The softmax and the values'
// products stay the AVX2 ones, on float32 probabilities.
#pragma once

#include "attention_isa.h"

// S[r][0, 16) for rows r < R (rows `q_stride` words apart): the scaled dot products
// with the 16 keys of the pair tile kt, over `pairs` pairs of dims.
template <int R>
__attribute__((target(KVSERVE_AVX512_BF16_DOTS))) inline void score_tile_pairs(
    const uint32_t* q, int64_t q_stride, const uint32_t* kt, int64_t pairs, float scale,
    float* s, int64_t s_stride) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + p * kKeyTile);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(
          acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * q_stride + p])), k);
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(acc[r], sc));
}

// S[r][0, n) for rows r < R, n a multiple of 16: every pair tile of K^T (kt).
template <int R>
__attribute__((target(KVSERVE_AVX512_BF16_DOTS))) void scores_pairs(
    const uint32_t* q, int64_t pairs, const uint32_t* kt, int64_t n, float scale, float* s,
    int64_t s_stride) {
  for (int64_t t = 0; t < n; t += kKeyTile)
    score_tile_pairs<R>(q, pairs, kt + t * pairs, pairs, scale, s + t, s_stride);
}

void scores_rows_pairs(const uint32_t* q, int64_t rows, int64_t pairs, const uint32_t* kt,
                       int64_t n, float scale, float* s, int64_t s_stride) {
  int64_t r = 0;
  for (; r + kRowTile <= rows; r += kRowTile)
    scores_pairs<kRowTile>(q + r * pairs, pairs, kt, n, scale, s + r * s_stride, s_stride);
  const uint32_t* rest = q + r * pairs;
  float* out = s + r * s_stride;
  switch (rows - r) {
    case 5: scores_pairs<5>(rest, pairs, kt, n, scale, out, s_stride); break;
    case 4: scores_pairs<4>(rest, pairs, kt, n, scale, out, s_stride); break;
    case 3: scores_pairs<3>(rest, pairs, kt, n, scale, out, s_stride); break;
    case 2: scores_pairs<2>(rest, pairs, kt, n, scale, out, s_stride); break;
    case 1: scores_pairs<1>(rest, pairs, kt, n, scale, out, s_stride); break;
    default: break;
  }
}
