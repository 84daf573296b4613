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

// Output rows [n0, n0 + NR) for MR rows of x (from x_row on).
template <int MR, int NR>
inline void bf16_dots(const BF16Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0) {
  const uint16_t* w = e.weight + n0 * k_len;
  const uint16_t* a = e.x + x_row * k_len;
  const char* ahead = reinterpret_cast<const char*>(w + kAheadRows * k_len);
  const int64_t whole = k_len / 16 * 16;
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += 16) {
    if (k % 32 == 0) {  // one line a row every 32 inputs (see dots)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + (j * k_len + k) * 2, _MM_HINT_T0);
    }
    __m256bh wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      wv[j] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k_len + k));
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256bh xv =
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * k_len + k));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float sums[NR];
    lane_sums<NR>(acc[m], sums);
    for (int j = 0; j < NR; ++j) {
      float sum = sums[j];
      for (int64_t t = whole; t < k_len; ++t)  // K's last inputs past a whole 16
        sum += bf16_value(a[m * k_len + t]) * bf16_value(w[j * k_len + t]);
      e.out[(x_row + m) * n + n0 + j] = sum;
    }
  }
}

template <int MR>
inline void bf16_rows(const BF16Expert& e, int64_t k_len, int64_t n, int64_t x_row,
                      int64_t n0, int64_t n1) {
  int64_t j = n0;
  for (; j + 4 <= n1; j += 4) bf16_dots<MR, 4>(e, k_len, n, x_row, j);
  for (; j < n1; ++j) bf16_dots<MR, 1>(e, k_len, n, x_row, j);
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
