// paged_decode's two passes over a bf16 cache (the keys, then the values) on 512-bit
// registers, for CPUs with AVX-512 (included by paged_decode.cpp inside its namespace,
// after Decode and prefetch). The same float32 maths as the AVX2 passes in another
// order: each key or value is widened once, 16 values an instruction, and shared by
// the query heads of its KV head (the AVX2 passes widen it again for each, 8 values at
// a time), and a score is one multiply-add chain of head_dim / 16 and one reduction.
// On bf16 caches the AVX2 passes were bound by those instructions, not by the bytes:
// 8-13 GB/s of KV on the 2-core Zen 4 where float32 caches, twice the bytes, ran 14-20
// (bench/results/cpu_paged_decode_avx512_2026-11-27.md). Compiled for AVX-512 alone
// and called only where the CPU has it, not with $KVSERVE_CPU_ISA=avx2 (the tests'
// way to reach the AVX2 passes there).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>

#define KVSERVE_AVX512_ATTENTION "avx512f,avx512bw,avx512vl,avx512dq"

bool avx512_attention_here() {
  static const bool here = [] {
    const char* isa = std::getenv("KVSERVE_CPU_ISA");
    __builtin_cpu_init();
    return !(isa != nullptr && std::strcmp(isa, "avx2") == 0) &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return here;
}

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

// The two passes for a head of `dim` values (avx512_passes_take said yes).
inline void score_keys_avx512(const Decode<at::BFloat16>& a, int64_t b, int64_t h0,
                              int64_t h1, int64_t t0, int64_t len, float* scores) {
  if (a.head_dim == 64) return score_keys_avx512<4>(a, b, h0, h1, t0, len, scores);
  score_keys_avx512<8>(a, b, h0, h1, t0, len, scores);
}

inline void sum_values_avx512(const Decode<at::BFloat16>& a, int64_t b, int64_t h0,
                              int64_t h1, int64_t t0, int64_t len, const float* probs,
                              float* acc) {
  if (a.head_dim == 64) return sum_values_avx512<4>(a, b, h0, h1, t0, len, probs, acc);
  sum_values_avx512<8>(a, b, h0, h1, t0, len, probs, acc);
}
