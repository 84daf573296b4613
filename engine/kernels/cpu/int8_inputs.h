// x quantized to int8 for integer products with int8 or 4-bit weights, as llama.cpp
// quantizes activations (its Q8 blocks): each row in blocks of kDotBlock inputs, one
// float32 step a block. Shared by packed_gemm.cpp (int4 panels, micro_dot) and
// expert_linear.cpp (int8 experts).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvserve_cpu {

// Inputs that share one int8 step when x is quantized for integer products.
constexpr int64_t kDotBlock = 32;

// Each row of x [rows, k] in blocks of kDotBlock inputs: the block's step
// max|x| / 127 and its inputs as integers, x * (127 / max|x|) rounded half to even
// (all in float32; packing.quantized_for_dot is the reference).
inline void quantize_for_dot(const float* x, int64_t rows, int64_t k, int8_t* x_q, float* x_step) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k0 = 0; k0 < k; k0 += kDotBlock) {
      const float* v = x + r * k + k0;
      __m256 in[4], top = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        in[i] = _mm256_loadu_ps(v + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, in[i]));
      }
      __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      half = _mm_max_ps(half, _mm_movehl_ps(half, half));
      half = _mm_max_ss(half, _mm_movehdup_ps(half));
      const float largest = _mm_cvtss_f32(half);
      const __m256 inv = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
      x_step[(r * k + k0) / kDotBlock] = largest / 127.0f;
      __m256i n[4];
      for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(in[i], inv));
      // packs work within 128-bit lanes: the permutation puts the 32 bytes in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                               _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_q + r * k + k0),
                          _mm256_permutevar8x32_epi32(bytes, order));
    }
}

// Each row's float32 sum of x [rows, k] over each group of `group` inputs, [rows,
// k / group]: the share of the weights' minimums in an int4 product. Each group's sum
// is still one add after another in input order (the same float as ever), but eight
// groups' chains run side by side: one chain at a time, a serial add a cycle's
// latency apart, left the sums 15% of a 512-row product of a 2048 x 2048 int4 layer,
// one thread busy and the other waiting (2-core Zen 5).
inline void group_sums(const float* x, int64_t rows, int64_t k, int64_t group, float* sums) {
  constexpr int64_t kChains = 8;
  const int64_t groups = k / group;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    float* out = sums + r * groups;
    int64_t gi = 0;
    for (; gi + kChains <= groups; gi += kChains) {
      float total[kChains] = {};
      for (int64_t i = 0; i < group; ++i)
        for (int64_t j = 0; j < kChains; ++j) total[j] += row[(gi + j) * group + i];
      for (int64_t j = 0; j < kChains; ++j) out[gi + j] = total[j];
    }
    for (; gi < groups; ++gi) {
      float total = 0.0f;
      for (int64_t i = 0; i < group; ++i) total += row[gi * group + i];
      out[gi] = total;
    }
  }
}

}  // namespace kvserve_cpu
