// paged_decode's two passes over a bf16 cache (the keys, then the values) on 512-bit
// registers, for CPUs with AVX-512 (included by paged_decode.cpp inside its namespace,
// after Decode and prefetch). The same float32 maths as the AVX2 passes in another
// order: each key or value is widened once, 16 values an instruction, and shared by
// the query heads of its KV head (the AVX2 passes widen it again for each, 8 values at
// a time), and a score is one multiply-add chain of head_dim / 16 and one reduction.
// On bf16 caches the AVX2 passes were bound by those instructions, not by the bytes:
// 8-13 GB/s of KV on the 2-core Zen 4 where float32 caches, twice the bytes, ran 14-20
// (bench/results/cpu_paged_decode_avx512_2026-11-27.md). Where the CPU has AVX512-BF16
// too, the keys pass takes its dot products of bf16 pairs instead (score_keys_dots), and
// the softmax runs here on 16 lanes whatever the keys pass. Compiled for AVX-512 alone
// and called only where the CPU has it, not with $KVSERVE_CPU_ISA=avx2 (the tests'
// way to reach the AVX2 passes there).
#pragma once

#include <algorithm>
#include <utility>

#include "attention_isa.h"

using kvserve_cpu::avx512_attention_here;
using kvserve_cpu::bf16_dots_here;

// Whether the passes below take a bf16 cache's heads of `dim` values: 64 or 128 (the
// templates' instances; others, and float32 caches, bound by their bytes already,
// take the AVX2 passes).
bool avx512_passes_take(int64_t dim) {
  return (dim == 64 || dim == 128) && avx512_attention_here();
}

// Sixteen bf16 values as float32 (a bf16's 16 bits are a float32's high half).
__attribute__((target(KVSERVE_AVX512_ATTENTION), always_inline)) inline __m512 load16(
    const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// score_keys on 512-bit registers, a head of 16 * D16 values.
template <int D16>
__attribute__((target(KVSERVE_AVX512_ATTENTION))) void score_keys_avx512(
    const Decode<at::BFloat16>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
    int64_t len, float* scores) {
  constexpr int64_t dim = 16 * D16;
  const int64_t groups = a.q_heads / a.kv_heads, span_values = (h1 - h0) * dim;
  const float* q = a.q + (b * a.q_heads + h0 * groups) * dim;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    if (i + kPrefetchAhead < len)
      prefetch(a.k_cache + a.at(b, h0, t + kPrefetchAhead), span_values);
    const at::BFloat16* k = a.k_cache + a.at(b, h0, t);
    for (int64_t kv = 0; kv < h1 - h0; ++kv) {
      __m512 key[D16];
#pragma GCC unroll 8
      for (int j = 0; j < D16; ++j) key[j] = load16(k + kv * dim + 16 * j);
      for (int64_t head = kv * groups; head < (kv + 1) * groups; ++head) {
        const float* qh = q + head * dim;
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qh), key[0]);
#pragma GCC unroll 8
        for (int j = 1; j < D16; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), key[j], s);
        scores[head * len + i] = _mm512_reduce_add_ps(s) * a.scale;
      }
    }
  }
}

// Sixteen vectors' sums, one a lane: lane u is the sum of v[u]'s sixteen. A tree of
// 15 adds and 30 shuffles, where sixteen _mm512_reduce_add_ps take 64 and 64.
__attribute__((target(KVSERVE_AVX512_ATTENTION), always_inline)) inline __m512 sums16(
    const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: v[2k]'s and v[2k+1]'s sums of two
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: v[4k..4k+3]'s sums of four, in order
    quads[k] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], 0xEE));
  for (int k = 0; k < 2; ++k)  // two 128-bit lanes a vector of four
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * k], quads[2 * k + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * k], quads[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// The keys pass with AVX512-BF16's dot products, a head of 32 * D32 values: the bf16
// queries and keys multiplied as they lie (a product of two bf16 values is exact in
// float32), so no key is widened, and 16 positions' scores summed at once (sums16).
// Each position's key is loaded once per query head that shares it, from L1 after
// the first. The scores are float32 dot products, summed in another order than the
// widening pass's: they differ from its in the last bits.
template <int D32>
__attribute__((target(KVSERVE_AVX512_BF16_DOTS))) void score_keys_dots(
    const Decode<at::BFloat16>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
    int64_t len, float* scores) {
  constexpr int64_t dim = 32 * D32;
  const int64_t groups = a.q_heads / a.kv_heads, span_values = (h1 - h0) * dim;
  const at::BFloat16* q = a.q_given + (b * a.q_heads + h0 * groups) * dim;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t i0 = 0; i0 < len; i0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - i0));
    const at::BFloat16* k[16];  // past the end: the last position again, never stored
    for (int u = 0; u < 16; ++u) k[u] = a.k_cache + a.at(b, h0, t0 + i0 + std::min(u, n - 1));
    for (int64_t i = i0 + 16; i < std::min(i0 + 32, len); ++i)
      prefetch(a.k_cache + a.at(b, h0, t0 + i), span_values);
    const __mmask16 stored = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t kv = 0; kv < h1 - h0; ++kv) {
      for (int64_t head = kv * groups; head < (kv + 1) * groups; ++head) {
        __m512bh qh[D32];
        for (int j = 0; j < D32; ++j)
          qh[j] = (__m512bh)_mm512_loadu_si512(q + head * dim + 32 * j);
        __m512 dots[16];
#pragma GCC unroll 16
        for (int u = 0; u < 16; ++u) {
          dots[u] = _mm512_setzero_ps();
#pragma GCC unroll 4
          for (int j = 0; j < D32; ++j)
            dots[u] = _mm512_dpbf16_ps(
                dots[u], qh[j], (__m512bh)_mm512_loadu_si512(k[u] + kv * dim + 32 * j));
        }
        _mm512_mask_storeu_ps(scores + head * len + i0, stored,
                              _mm512_mul_ps(sums16(dots), scale));
      }
    }
  }
}

// sum_values on 512-bit registers, a head of 16 * D16 values. Positions are taken
// kSteps at a time (as many as keep their widened values in 16 registers): each
// head's sums are loaded and stored once for them, not once a position (a chain
// through memory that bounded the pass), and multiplied-added in position order as
// one at a time would, so the sums are the same.
template <int D16>
__attribute__((target(KVSERVE_AVX512_ATTENTION))) void sum_values_avx512(
    const Decode<at::BFloat16>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
    int64_t len, const float* probs, float* acc) {
  constexpr int64_t dim = 16 * D16;
  constexpr int kSteps = D16 <= 4 ? 4 : 2;
  const int64_t groups = a.q_heads / a.kv_heads, span_values = (h1 - h0) * dim;
  for (int64_t i0 = 0; i0 < len; i0 += kSteps) {
    const int steps = static_cast<int>(std::min<int64_t>(kSteps, len - i0));
    const at::BFloat16* v[kSteps];
    for (int u = 0; u < kSteps; ++u) {
      const int64_t i = i0 + std::min(u, steps - 1);  // (past the end: unused)
      if (i + kPrefetchAhead < len)
        prefetch(a.v_cache + a.at(b, h0, t0 + i + kPrefetchAhead), span_values);
      v[u] = a.v_cache + a.at(b, h0, t0 + i);
    }
    for (int64_t kv = 0; kv < h1 - h0; ++kv) {
      __m512 value[kSteps][D16];
#pragma GCC unroll 4
      for (int u = 0; u < kSteps; ++u)
#pragma GCC unroll 8
        for (int j = 0; j < D16; ++j) value[u][j] = load16(v[u] + kv * dim + 16 * j);
      for (int64_t head = kv * groups; head < (kv + 1) * groups; ++head) {
        float* o = acc + head * dim;
        const float* p = probs + head * len + i0;
#pragma GCC unroll 8
        for (int j = 0; j < D16; ++j) {
          __m512 sum = _mm512_loadu_ps(o + 16 * j);
#pragma GCC unroll 4
          for (int u = 0; u < kSteps; ++u)
            if (u < steps) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[u]), value[u][j], sum);
          _mm512_storeu_ps(o + 16 * j, sum);
        }
      }
    }
  }
}

// exp_nonpositive (attention_shared.h) on 16 lanes: its steps and constants, so each
// exponential is the same float.
__attribute__((target(KVSERVE_AVX512_ATTENTION), always_inline)) inline __m512
exp_nonpositive16(__m512 x) {
  using namespace kvserve_cpu;
  const __mmask16 too_small = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  const __m512i scale = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~too_small), p,
                             _mm512_castsi512_ps(scale));
}

// The softmax's numerators of one head's scores in place, 16 at a time (the last
// ones under a mask): their maximum, then s[t] = exp(s[t] - maximum); returns the
// maximum and the numerators' sum. The AVX2 way took a scalar std::max_element and
// eight lanes: a fifth of the step's attention at 16 requests of 200 positions.
__attribute__((target(KVSERVE_AVX512_ATTENTION))) inline std::pair<float, float>
softmax_numerators_avx512(float* s, int64_t len) {
  const int64_t whole = len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - whole)) - 1);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < whole; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, tail, s + whole));
  const float most = _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(most);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < whole; t += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), shift));
  _mm512_mask_storeu_ps(s + whole, tail, e);
  total = _mm512_mask_add_ps(total, tail, total, e);
  return {most, _mm512_reduce_add_ps(total)};
}

// The two passes for a head of `dim` values (avx512_passes_take said yes).
inline void score_keys_avx512(const Decode<at::BFloat16>& a, int64_t b, int64_t h0,
                              int64_t h1, int64_t t0, int64_t len, float* scores) {
  if (bf16_dots_here()) {
    if (a.head_dim == 64) return score_keys_dots<2>(a, b, h0, h1, t0, len, scores);
    return score_keys_dots<4>(a, b, h0, h1, t0, len, scores);
  }
  if (a.head_dim == 64) return score_keys_avx512<4>(a, b, h0, h1, t0, len, scores);
  score_keys_avx512<8>(a, b, h0, h1, t0, len, scores);
}

inline void sum_values_avx512(const Decode<at::BFloat16>& a, int64_t b, int64_t h0,
                              int64_t h1, int64_t t0, int64_t len, const float* probs,
                              float* acc) {
  if (a.head_dim == 64) return sum_values_avx512<4>(a, b, h0, h1, t0, len, probs, acc);
  sum_values_avx512<8>(a, b, h0, h1, t0, len, probs, acc);
}
