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

// Blocks of kDotBlock inputs a weight row is read in at a time, each summed on its
// own (the same count for both instruction sets: their sums are added in the same
// order, so their results stay the same bits). One row at a time, front to back: a
// thread's reads are one sequential stream, as in expert_bf16_dots.h.
constexpr int kInt8Steps = 2;

// Weight row j against MR rows of x (from x_row on): each row's float32 sums, lane
// by lane, in sums[m], before the row's scale.
template <int MR>
inline void int8_row(const Int8Expert& e, int64_t k_len, int64_t x_row, int64_t j,
                     __m256 (&sums)[MR]) {
  const int64_t blocks = k_len / kDotBlock;
  const int8_t* w = e.weight + j * k_len;
  const int8_t* xq = e.x_q + x_row * k_len;
  const float* step = e.x_step + x_row * blocks;
#if KV_VNNI
  const __m256i zero = _mm256_setzero_si256();
  const __m256i offset = _mm256_set1_epi8(char(0x80));  // x + 128, read unsigned
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[MR][kInt8Steps];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int s = 0; s < kInt8Steps; ++s) acc[m][s] = _mm256_setzero_ps();
  // One block into acc[.][s]: its 32 products summed as integers, scaled by x's step.
  auto block = [&](int64_t b, int s) {
    const int64_t k = b * kDotBlock;
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
#if KV_VNNI
    const __m256i prep = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, offset, wv));
#else
    const __m256i prep = _mm256_abs_epi8(wv);
#endif
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k_len + k));
#if KV_VNNI
      const __m256i sum = _mm256_dpbusd_epi32(prep, _mm256_xor_si256(xv, offset), wv);
#else
      // |w| * (x with w's sign): pairs at most 2 * 128 * 127, within int16
      const __m256i sum = _mm256_madd_epi16(
          _mm256_maddubs_epi16(prep, _mm256_sign_epi8(xv, wv)), ones);
#endif
      acc[m][s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                  _mm256_set1_ps(step[m * blocks + b]), acc[m][s]);
    }
  };
  const int64_t steps = blocks / kInt8Steps * kInt8Steps;
  for (int64_t b = 0; b < steps; b += kInt8Steps) {
#pragma GCC unroll 2
    for (int s = 0; s < kInt8Steps; ++s) block(b + s, s);
  }
  for (int64_t b = steps; b < blocks; ++b) block(b, 0);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) sums[m] = _mm256_add_ps(acc[m][0], acc[m][1]);
}

// Output rows [n0, n1) for MR rows of x (from x_row on).
template <int MR>
inline void int8_rows(const Int8Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0, int64_t n1) {
  rows_in_order<MR>(
      n0, n1, [&](int64_t j, __m256(&sums)[MR]) { int8_row<MR>(e, k_len, x_row, j, sums); },
      [&](int m, int64_t j, float sum) { e.out[(x_row + m) * n + j] = sum * e.scales[j]; });
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
