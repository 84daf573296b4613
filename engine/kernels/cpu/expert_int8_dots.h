// int8 experts (a scale per output row) times x quantized to int8 in blocks of
// kDotBlock inputs (int8_inputs.h), for kvserve::expert_linear: a block's 32
// products summed as integers, then scaled by the block's step, as llama.cpp
// multiplies its Q8_0 weights by Q8 activations. Widening every int8 weight to
// float32 for an FMA left decode steps' experts compute-bound at ~14 GB/s.
//
// Included twice by expert_linear.cpp, each time inside a namespace of its own:
// with KV_VNNI 0 for AVX2 (vpmaddubsw takes |w| as unsigned bytes and x with w's
// sign, vpmaddwd sums the pairs), and with KV_VNNI 1 under `#pragma GCC target` for
// AVX-512 VNNI (vpdpbusd takes x + 128 as unsigned bytes and w as signed ones, four
// products a lane added to the lane's int32; 128 * the weights' sum, taken the same
// way once a weight block, is subtracted). Either way lane i of a block's sum holds
// inputs 4i..4i+3 exactly, so both give the same float32 results, bit for bit.
// (No include guard: it is meant to be included twice. expert_linear.cpp includes
// what it needs first, Int8Expert included.)

// Output rows [n0, n0 + NR) for MR rows of x (from x_row on).
template <int MR, int NR>
inline void int8_dots(const Int8Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0) {
  const int64_t blocks = k_len / kDotBlock;
  const int8_t* w = e.weight + n0 * k_len;
  const int8_t* xq = e.x_q + x_row * k_len;
  const float* step = e.x_step + x_row * blocks;
  const char* ahead = reinterpret_cast<const char*>(w + kAheadRows * k_len);
  const __m256i zero = _mm256_setzero_si256();
#if KV_VNNI
  const __m256i offset = _mm256_set1_epi8(char(0x80));  // x + 128, read unsigned
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k = b * kDotBlock;
    if (k % 64 == 0) {  // one line a row every 64 inputs (see dots)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + j * k_len + k, _MM_HINT_T0);
    }
    __m256i wv[NR], prep[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k_len + k));
#if KV_VNNI
      prep[j] = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, offset, wv[j]));
#else
      prep[j] = _mm256_abs_epi8(wv[j]);
      (void)zero;
#endif
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k_len + k));
#if KV_VNNI
      xv = _mm256_xor_si256(xv, offset);
#endif
      const __m256 s = _mm256_set1_ps(step[m * blocks + b]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
#if KV_VNNI
        const __m256i sum = _mm256_dpbusd_epi32(prep[j], xv, wv[j]);
#else
        // |w| * (x with w's sign): pairs at most 2 * 128 * 127, within int16
        const __m256i sum = _mm256_madd_epi16(
            _mm256_maddubs_epi16(prep[j], _mm256_sign_epi8(xv, wv[j])), ones);
#endif
        acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float sums[NR];
    lane_sums<NR>(acc[m], sums);
    for (int j = 0; j < NR; ++j) e.out[(x_row + m) * n + n0 + j] = sums[j] * e.scales[n0 + j];
  }
}

// Output rows [n0, n1) for every row of x: NR weight rows at a time (AVX2's 16
// registers hold 2 x 4 sums beside the four rows and their prepared forms; AVX-512's
// 32 hold 3 x 4), then one at a time.
template <int MR>
inline void int8_rows(const Int8Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0, int64_t n1) {
  int64_t j = n0;
  for (; j + 4 <= n1; j += 4) int8_dots<MR, 4>(e, k_len, n, x_row, j);
  for (; j < n1; ++j) int8_dots<MR, 1>(e, k_len, n, x_row, j);
}

constexpr int64_t kInt8Rows = KV_VNNI ? 3 : 2;  // rows of x a call takes

inline void int8_block(const Int8Expert& e, int64_t k_len, int64_t n, int64_t n0, int64_t n1) {
  for (int64_t row = 0; row < e.rows; row += kInt8Rows) {
    switch (std::min(kInt8Rows, e.rows - row)) {
#if KV_VNNI
      case 3: int8_rows<3>(e, k_len, n, row, n0, n1); break;
#endif
      case 2: int8_rows<2>(e, k_len, n, row, n0, n1); break;
      default: int8_rows<1>(e, k_len, n, row, n0, n1);
    }
  }
}

// Every (expert, block of kBlockRows weight rows) item (expert_linear.cpp's
// for_each_block).
inline void int8_grouped(const std::vector<Int8Expert>& experts, int64_t k_len, int64_t n) {
  for_each_block(experts, n, [&](const Int8Expert& e, int64_t n0, int64_t n1) {
    int8_block(e, k_len, n, n0, n1);
  });
}
