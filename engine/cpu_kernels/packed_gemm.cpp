// kvserve::packed_linear: y = x W^T (+ bias) on x86 CPUs with AVX2 and FMA, for
// float32 rows x and a weight packed once at load (engine/cpu_kernels/packing.py).
//
// The packed weight is a run of panels, each 16 output columns wide and K deep:
// [P, K, 16], so one step along K reads 16 consecutive values of one panel. They
// are float32, or bfloat16 where every value of the weight is exact in bf16 (half
// the bytes; a bf16 checkpoint served in float32). A bf16 panel row keeps column j
// in the low half of 32-bit word j and column j + 8 in its high half, so widening
// a row to two float32 vectors is one shift and one mask. Sums are float32 either
// way: only the order of the additions differs from torch's float32 GEMMs.
//
// Each thread takes a contiguous range of panels (at::parallel_for, torch's own
// OpenMP pool). Within it, panels are taken in chunks that stay in the L2 cache
// while every block of 6 rows of x runs over them, so a weight is read from memory
// once however many rows there are. The micro-kernel keeps a 6 x 16 tile of
// sums (12 of AVX2's 16 registers) over the whole of K; fewer rows take more
// panels a call, so one row still has 8 independent sums in flight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;            // output columns a panel holds
constexpr int64_t kMaxRows = 6;           // rows of x a micro-kernel call takes
constexpr int64_t kChunkBytes = 192 << 10;  // panels a thread keeps hot in L2
// How far ahead of its loads a panel's stream is prefetched, in panel rows:
// 2-4 KiB ahead measured best on a 2-core Zen 3 (the hardware prefetcher alone
// left batch-16 steps 10-15% slower).
constexpr int64_t kPrefetchRows = 64;

struct F32Panel {
  using T = float;
  static inline void load(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
};

struct BF16Panel {
  using T = uint16_t;
  static inline void load(const uint16_t* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
  }
};

// Rows [0, MR) of x times NP consecutive panels: C[m, p*16 + j], bias added.
// n_left: output columns from the first panel on (the last panel may be partial).
template <int MR, int NP, typename Panel>
inline void micro(const float* __restrict a, int64_t lda, const typename Panel::T* __restrict b,
                  int64_t k_len, float* __restrict c, int64_t ldc,
                  const float* __restrict bias, int64_t n_left) {
  const int64_t panel_stride = k_len * kPanel;
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  // Two steps of K a loop turn: the loop's own instructions then cost half as much
  // beside its 12 FMAs a step (5-15% faster at 28 and 512 rows, 2-core Zen 3).
#pragma GCC unroll 2
  for (int64_t k = 0; k < k_len; ++k) {
    __m256 w[NP][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const typename Panel::T* row = b + p * panel_stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPanel), _MM_HINT_T0);
      Panel::load(row, w[p][0], w[p][1]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[m][p][0] = _mm256_fmadd_ps(x, w[p][0], acc[m][p][0]);
        acc[m][p][1] = _mm256_fmadd_ps(x, w[p][1], acc[m][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t cols = std::min(kPanel, n_left - p * kPanel);
    if (cols <= 0) break;
    float add[kPanel] = {0};
    if (bias != nullptr) std::memcpy(add, bias + p * kPanel, sizeof(float) * cols);
    const __m256 add_lo = _mm256_loadu_ps(add), add_hi = _mm256_loadu_ps(add + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      float* out = c + m * ldc + p * kPanel;
      const __m256 lo = _mm256_add_ps(acc[m][p][0], add_lo);
      const __m256 hi = _mm256_add_ps(acc[m][p][1], add_hi);
      if (cols == kPanel) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
      } else {
        float tile[kPanel];
        _mm256_storeu_ps(tile, lo);
        _mm256_storeu_ps(tile + 8, hi);
        std::memcpy(out, tile, sizeof(float) * cols);
      }
    }
  }
}

struct Problem {
  const float* x;
  int64_t rows, k_len;
  const void* weight;
  int64_t n;
  const float* bias;
  float* out;
};

// MR rows of x over panels [p0, p1), NP panels a call.
template <int MR, int NP, typename Panel>
void sweep(const Problem& q, int64_t row, int64_t p0, int64_t p1) {
  const auto* w = static_cast<const typename Panel::T*>(q.weight);
  const float* a = q.x + row * q.k_len;
  float* c = q.out + row * q.n;
  const int64_t panel_stride = q.k_len * kPanel;
  auto call = [&](auto np, int64_t p) {
    micro<MR, decltype(np)::value, Panel>(a, q.k_len, w + p * panel_stride, q.k_len,
                                          c + p * kPanel, q.n,
                                          q.bias ? q.bias + p * kPanel : nullptr,
                                          q.n - p * kPanel);
  };
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) call(std::integral_constant<int, NP>{}, p);
  for (; p < p1; ++p) call(std::integral_constant<int, 1>{}, p);
}

// The rows left after the blocks of 6: as many panels a call as keep 8-12 sums.
template <typename Panel>
void sweep_rows(int64_t rows, const Problem& q, int64_t row, int64_t p0, int64_t p1) {
  switch (rows) {
    case 6: return sweep<6, 1, Panel>(q, row, p0, p1);
    case 5: return sweep<5, 1, Panel>(q, row, p0, p1);
    case 4: return sweep<4, 1, Panel>(q, row, p0, p1);
    case 3: return sweep<3, 2, Panel>(q, row, p0, p1);
    case 2: return sweep<2, 3, Panel>(q, row, p0, p1);
    default: return sweep<1, 4, Panel>(q, row, p0, p1);
  }
}

template <typename Panel>
void gemm(const Problem& q) {
  const int64_t panels = (q.n + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(
      1, kChunkBytes / (std::max<int64_t>(1, q.k_len) * kPanel *
                        int64_t(sizeof(typename Panel::T))));
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      for (int64_t row = 0; row < q.rows; row += kMaxRows)
        sweep_rows<Panel>(std::min(kMaxRows, q.rows - row), q, row, c0, c1);
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "packed_linear: x must be 2-D float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == x.size(1) && weight.size(2) == kPanel &&
                  weight.size(0) * kPanel >= n && weight.is_contiguous(),
              "packed_linear: weight ", weight.sizes(), " is not packed for ", x.size(1),
              " inputs and ", n, " outputs");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "packed_linear: packed weights are float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->numel() == n),
              "packed_linear: the bias must be ", n, " contiguous float32 values");
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  if (rows.size(0) == 0 || n == 0) return out;
  // (K = 0 needs no case of its own: the sums stay 0 and the bias is added.)
  const Problem q{rows.data_ptr<float>(), rows.size(0), rows.size(1), weight.data_ptr(), n,
                  has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>()};
  if (weight.scalar_type() == at::kFloat)
    gemm<F32Panel>(q);
  else
    gemm<BF16Panel>(q);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("packed_linear(Tensor x, Tensor weight, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("packed_linear", packed_linear); }
