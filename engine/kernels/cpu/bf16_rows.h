// Rows of a widened panel stored as bf16 in a plain [K, width] matrix: the weight a
// bf16 GEMM library multiplies (packed_gemm.cpp's onednn_product). Rounded to
// nearest even in AVX2 integer ops (weights are finite: no NaN case), so the unit
// needs no AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvserve_cpu {

// 8 float32 -> their bf16 bit patterns, in the low halves of 32-bit words.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_srli_epi32(rounded, 16);
}

// panel [k_len, 16] float32 (one widened panel: row k holds its 16 columns at input
// k) -> out[k * ld + j] in bf16, each column times col_scale[j] where given.
inline void store_bf16_rows(const float* panel, int64_t k_len, const float* col_scale,
                            uint16_t* out, int64_t ld) {
  const __m256 s_lo = col_scale ? _mm256_loadu_ps(col_scale) : _mm256_set1_ps(1.0f);
  const __m256 s_hi = col_scale ? _mm256_loadu_ps(col_scale + 8) : _mm256_set1_ps(1.0f);
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256i lo = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(panel + k * 16), s_lo));
    const __m256i hi = bf16_bits(_mm256_mul_ps(_mm256_loadu_ps(panel + k * 16 + 8), s_hi));
    // packus works within 128-bit lanes: (lo 0-3, hi 0-3, lo 4-7, hi 4-7) -> in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * ld), packed);
  }
}

}  // namespace kvserve_cpu
