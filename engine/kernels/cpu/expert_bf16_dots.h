// bf16 experts times bf16 rows of x with AVX-512 BF16 (vdpbf16ps), for
// kvserve::expert_linear: each instruction takes 16 weights as they lie and 16
// inputs, two exact products a lane added to the lane's float32 sum, where the
// float path widens every weight by a shift and takes 8 an FMA. Where the model
// runs in bf16 its activations are bf16 already, so nothing is rounded that torch's
// own bf16 GEMMs would not round.
//
// Included by expert_linear.cpp under `#pragma GCC target` with AVX-512 BF16 (and
// called only where the CPU has it), after what it needs.

struct BF16Expert {
  const uint16_t* x;  // its rows of x, [rows, K] bf16
  int64_t rows;
  const uint16_t* weight;  // [N, K] bf16
  float* out;              // its rows of the output, [rows, N]
};

inline float bf16_value(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Steps of 16 inputs a weight row is read in at a time, each summed on its own: one
// row at a time, front to back, so a thread's reads are one sequential stream the
// hardware prefetcher follows (four rows read side by side, as four short streams,
// came from memory at ~18 GB/s against ~28 read in order, 2-core Zen 4).
constexpr int kBF16Steps = 4;

// Weight row j against MR rows of x (from x_row on): each row's float32 sums, lane
// by lane, in sums[m] (K's last inputs past a whole 16 left to the caller).
template <int MR>
inline void bf16_row(const BF16Expert& e, int64_t k_len, int64_t x_row, int64_t j,
                     __m256 (&sums)[MR]) {
  const uint16_t* w = e.weight + j * k_len;
  const uint16_t* a = e.x + x_row * k_len;
  constexpr int64_t kStep = 16 * kBF16Steps;
  const int64_t steps = k_len / kStep * kStep, whole = k_len / 16 * 16;
  __m256 acc[MR][kBF16Steps];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int s = 0; s < kBF16Steps; ++s) acc[m][s] = _mm256_setzero_ps();
  for (int64_t k = 0; k < steps; k += kStep) {
    __m256bh wv[kBF16Steps];
#pragma GCC unroll 4
    for (int s = 0; s < kBF16Steps; ++s)
      wv[s] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16 * s));
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int s = 0; s < kBF16Steps; ++s)
        acc[m][s] = _mm256_dpbf16_ps(
            acc[m][s],
            (__m256bh)_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(a + m * k_len + k + 16 * s)),
            wv[s]);
  }
  for (int64_t k = steps; k < whole; k += 16) {  // whole 16s past the last step
    const __m256bh wv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      acc[m][0] = _mm256_dpbf16_ps(
          acc[m][0],
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * k_len + k)),
          wv);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
    sums[m] = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                            _mm256_add_ps(acc[m][2], acc[m][3]));
}

// Output rows [n0, n1) for MR rows of x (from x_row on).
template <int MR>
inline void bf16_rows(const BF16Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0, int64_t n1) {
  const int64_t whole = k_len / 16 * 16;
  rows_in_order<MR>(
      n0, n1, [&](int64_t j, __m256(&sums)[MR]) { bf16_row<MR>(e, k_len, x_row, j, sums); },
      [&](int m, int64_t j, float sum) {
        const uint16_t* a = e.x + (x_row + m) * k_len;
        const uint16_t* w = e.weight + j * k_len;
        for (int64_t t = whole; t < k_len; ++t)  // K's last inputs past a whole 16
          sum += bf16_value(a[t]) * bf16_value(w[t]);
        e.out[(x_row + m) * n + j] = sum;
      });
}

// Rows of x a call takes: 16 sums, four weight vectors and an input in AVX-512's 32
// registers.
constexpr int64_t kBF16Rows = 4;

inline void bf16_block(const BF16Expert& e, int64_t k_len, int64_t n, int64_t n0, int64_t n1) {
  for (int64_t row = 0; row < e.rows; row += kBF16Rows) {
    switch (std::min(kBF16Rows, e.rows - row)) {
      case 4: bf16_rows<4>(e, k_len, n, row, n0, n1); break;
      case 3: bf16_rows<3>(e, k_len, n, row, n0, n1); break;
      case 2: bf16_rows<2>(e, k_len, n, row, n0, n1); break;
      default: bf16_rows<1>(e, k_len, n, row, n0, n1);
    }
  }
}

// Every (expert, block of kBlockRows weight rows) item (expert_linear.cpp's
// for_each_block).
inline void bf16_grouped(const std::vector<BF16Expert>& experts, int64_t k_len, int64_t n) {
  for_each_block(experts, n, [&](const BF16Expert& e, int64_t n0, int64_t n1) {
    bf16_block(e, k_len, n, n0, n1);
  });
}
