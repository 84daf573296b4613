// What the attention kernels share (paged_decode.cpp, paged_prefill.cpp), and the
// experts kernel its lane sums (expert_linear.cpp): AVX2 maths,
// and the checks of their queries and caches.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvserve_cpu {

// The sum of a vector's eight floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (a score minus its row's maximum): 2^n * e^r with
// n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor series to r^6 (relative
// error ~1e-7, float32's own); below kExpFloor (where e^x leaves float32's normal
// range, -inf included) it is 0. The constants, shared with the 16-lane form
// (paged_decode_avx512.h), so both give the same float for each x:
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504f;
// ln 2 in two parts, so that r = x - n ln 2 is exact enough
constexpr float kLn2High = 0.693145751953125f, kLn2Low = 1.428606765330187e-06f;
// e^r's Taylor coefficients, r^6's first (Horner's order)
constexpr float kExpTaylor[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline __m256 exp_nonpositive(__m256 x) {
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// The largest of s[0..len), len >= 1, eight at a time (std::max_element goes one by
// one: a scalar compare-and-branch per score).
inline float max_of(const float* s, int64_t len) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  float most = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  for (; t < len; ++t) most = std::max(most, s[t]);
  return most;
}

// Softmax's numerators in place: s[t] = exp(s[t] - top) for t < len, `top` being the
// row's maximum; returns their sum.
inline float exp_shifted_in_place(float* s, int64_t len, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; t < len; ++t) sum += (s[t] = std::exp(s[t] - top));
  return sum;
}

// Checks an attention op's queries q (3-d, `q_shape` names its dims) and paged caches
// [N, block, Hkv, D]: float32 or bf16, all of one dtype; contiguous caches; a head_dim
// of a multiple of 8 (the kernels' vectors); query heads a multiple of the KV heads.
inline void check_queries_and_caches(const char* op, const char* q_shape, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": q ", q_shape, " and caches [N, block, Hkv, D], got ", q.sizes(), " and ",
              k_cache.sizes());
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  v_cache.scalar_type() == dtype && q.scalar_type() == dtype,
              op, ": float32 or bfloat16 queries and caches, all of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op,
              ": the caches must be contiguous");
  const int64_t q_heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % 8 == 0 && q_heads % kv_heads == 0, op,
              ": head_dim ", dim, " (a multiple of 8, the caches' too) and ", q_heads,
              " query heads over ", kv_heads, " KV heads");
}

}  // namespace kvserve_cpu
