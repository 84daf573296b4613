// kvserve::bf16_linear: y = x W^T (+ bias) for a bf16 model's float layers on CPUs
// with AVX512-BF16, x and y bf16, the products summed in float32 and rounded once.
//
// The weight is packed once at load into panels of 16 output columns holding pairs
// of inputs side by side, [P, K / 2, 32]: element (p, k, 2j + i) is W[16p + j, 2k + i]
// (engine/kernels/cpu/packing.py, pack_bf16_pairs). One 64-byte load is then one
// operand of vdpbf16ps: 16 columns x 2 inputs, against the pair (x[2k], x[2k + 1])
// broadcast to every lane, two exact products added to each column's float32 sum. No
// horizontal sums, no widening: the layout oneDNN's bf16 GEMM reorders weights into
// (which is why torch's graphs froze them), kept here as an ordinary tensor of the
// model's, so every compiled graph and the eager path read the one copy
// (engine/runner/graph_packages.py binds it to each package instead of copying it).
//
// Measured against oneDNN's GEMM on its own prepacked weights, a 1B model's gate/up
// (16384 x 2048) and down (2048 x 8192) on a 2-core Zen 4 (bench/bf16_pairs.py):
// at one row 0.75x oneDNN's time (memory-bound: ~30 GB/s), 0.8-1.2x at 2-64 rows and
// ~1.0-1.1x at prompt sizes (~400 GFLOP/s, compute-bound).
//
// Panels are taken in chunks (shared among the threads as chunk_schedule.h says),
// whose slab of K (kSlabInputs inputs) stays in the L2 cache while every block of up
// to 6 rows of x runs over it, so a weight is read from memory once however many
// rows there are. Where K spans several slabs, each slab's sums are carried in a
// float32 scratch tile between them. The micro-kernel keeps MR x NP sums in
// registers (up to 24 of AVX-512's 32).
//
// Where the CPU has AMX-BF16 the same panels are multiplied on its tiles instead,
// at every row count (bf16_pairs_amx.h): on a 2-core Sapphire Rapids-class Xeon, a
// 1B model's gate/up at 512 rows in 17.8 ms against AVX512-BF16's 164 (1.9 TFLOP/s;
// oneDNN's own AMX GEMM 20.1 ms), at 16 rows 2.36 against 6.42 ms, at one row the
// same (memory-bound either way; bench/results/bf16_pairs_amx_2026-12-02.json).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "isa_built.h"
#include "bf16_pairs_amx.h"
#include "chunk_schedule.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#define KVSERVE_BF16_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"

constexpr int64_t kPairsPanel = 16;  // output columns a panel holds
constexpr int64_t kPairsRows = 6;    // rows of x a micro-kernel call takes at most
// Inputs of one slab: a panel's slab is kSlabInputs * 32 bytes (64 KiB), and a chunk
// of kChunkPanels of them (512 KiB) stays in L2 while the rows run over it. Chunks
// of 192 KiB, the float kernels' size, were 10-40% slower from 8 rows on.
constexpr int64_t kSlabInputs = 2048;
constexpr int64_t kChunkPanels = 8;

bool pairs_dots_here() {
  static const bool here = KVSERVE_AVX512_BUILT && __builtin_cpu_supports("avx512bf16") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq");
  return here;
}

struct PairsProblem {
  const uint32_t* x;  // [rows, K / 2]: each 32-bit word one pair of bf16 inputs
  int64_t rows, pairs;
  const uint32_t* weight;  // [P, K / 2, 16] pairs, panel after panel
  const uint16_t* bias;    // [n] bf16, or null
  uint16_t* out;           // [rows, n] bf16
  int64_t n;
};

// Rows [0, MR) of x times NP consecutive panels over pairs [k0, k1). first: the sums
// start from zero, else from `carry` ([MR, NP * 16] float32, row stride ldc);
// last: they are finished (bias added, rounded to bf16 into out), else left in
// carry. n_left: output columns from the first panel on (the last may be partial).
template <int MR, int NP>
__attribute__((target(KVSERVE_BF16_TARGET))) void pairs_micro(
    const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict w, int64_t pairs,
    int64_t k0, int64_t k1, bool first, bool last, float* __restrict carry, int64_t ldc,
    const uint16_t* __restrict bias, uint16_t* __restrict out, int64_t ldo, int64_t n_left) {
  const int64_t panel_stride = pairs * kPairsPanel;
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      acc[m][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + m * ldc + p * 16);
#pragma GCC unroll 2
  for (int64_t k = k0; k < k1; ++k) {
    __m512bh wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + k * kPairsPanel);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + k]));
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], xb, wv[p]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(carry + m * ldc + p * 16, acc[m][p]);
    return;
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t cols = std::min(kPairsPanel, n_left - p * kPairsPanel);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kPairsPanel ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    __m512 add = _mm512_setzero_ps();
    if (bias != nullptr)  // bf16 -> float32 is a shift into the high half
      add = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + p * kPairsPanel)), 16));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][p], add));
      _mm256_mask_storeu_epi16(out + m * ldo + p * kPairsPanel, mask, (__m256i)y);
    }
  }
}

// Panels a micro-kernel call takes for MR rows: as many as keep up to 24 sums in
// registers, with room for the panels' loads and the broadcast.
template <int MR>
constexpr int pairs_panels_per_call() {
  return MR == 1 ? 8 : MR == 2 ? 8 : MR == 3 ? 6 : MR == 4 ? 6 : 4;
}

// Panels [p, p1) in tiles of NP, what is left in tiles of NP / 2, NP / 4, ..., 1:
// four panels left over are one call of 4 (one thread's 18 panels of a 576-wide
// layer, 8 + 8 + 2, were 8 + 8 + 1 + 1).
template <int NP, typename Call>
void sweep_tiles(int64_t p, int64_t p1, const Call& call) {
  for (; p + NP <= p1; p += NP) call(std::integral_constant<int, NP>{}, p);
  if constexpr (NP > 1) sweep_tiles<NP / 2>(p, p1, call);
}

// MR rows from `row` over panels [p0, p1) and pairs [k0, k1).
template <int MR>
void pairs_sweep(const PairsProblem& q, int64_t row, int64_t p0, int64_t p1, int64_t k0,
                 int64_t k1, float* carry, int64_t ldc) {
  constexpr int NP = pairs_panels_per_call<MR>();
  const bool first = k0 == 0, last = k1 == q.pairs;
  const uint32_t* x = q.x + row * q.pairs;
  uint16_t* out = q.out + row * q.n;
  auto call = [&](auto np, int64_t p) {
    constexpr int kNP = decltype(np)::value;
    pairs_micro<MR, kNP>(x, q.pairs, q.weight + p * q.pairs * kPairsPanel, q.pairs, k0, k1,
                         first, last, carry + (p - p0) * kPairsPanel, ldc,
                         q.bias ? q.bias + p * kPairsPanel : nullptr, out + p * kPairsPanel,
                         q.n, q.n - p * kPairsPanel);
  };
  sweep_tiles<NP>(p0, p1, call);
}

void pairs_rows(int64_t rows, const PairsProblem& q, int64_t row, int64_t p0, int64_t p1,
                int64_t k0, int64_t k1, float* carry, int64_t ldc) {
  switch (rows) {
    case 6: return pairs_sweep<6>(q, row, p0, p1, k0, k1, carry, ldc);
    case 5: return pairs_sweep<5>(q, row, p0, p1, k0, k1, carry, ldc);
    case 4: return pairs_sweep<4>(q, row, p0, p1, k0, k1, carry, ldc);
    case 3: return pairs_sweep<3>(q, row, p0, p1, k0, k1, carry, ldc);
    case 2: return pairs_sweep<2>(q, row, p0, p1, k0, k1, carry, ldc);
    default: return pairs_sweep<1>(q, row, p0, p1, k0, k1, carry, ldc);
  }
}

// Panels [c0, c1), at most kChunkPanels: every row over every slab of K.
void pairs_chunk(const PairsProblem& q, int64_t c0, int64_t c1) {
  const int64_t slab = kSlabInputs / 2;  // pairs
  const bool carried = q.pairs > slab;
  // The sums carried between slabs, [rows, kChunkPanels * 16]; kept per thread
  // across calls (a fresh allocation past 128 KiB is an mmap and its page faults).
  thread_local std::vector<float> carry;
  const int64_t ldc = kChunkPanels * kPairsPanel;
  if (carried) carry.resize(std::max<size_t>(carry.size(), q.rows * ldc));
  for (int64_t k0 = 0; k0 < q.pairs; k0 += slab) {
    const int64_t k1 = std::min(q.pairs, k0 + slab);
    for (int64_t row = 0; row < q.rows; row += kPairsRows)
      pairs_rows(std::min(kPairsRows, q.rows - row), q, row, c0, c1, k0, k1,
                 carried ? carry.data() + row * ldc : nullptr, ldc);
  }
}

// AMX (bf16_pairs_amx.h). A chunk's panels, read once for every row of x, are kept
// to about 1 MiB of the L2 cache (2 MiB a core on Sapphire Rapids), the rows' x tiles
// beside them.
constexpr int64_t kAmxChunkBytes = 1 << 20;

int64_t amx_chunk_panels(int64_t pairs) {
  return std::clamp<int64_t>(kAmxChunkBytes / (pairs * 64) / 2 * 2, 2, 16);
}

// x's rows in tiles of 16 for AMX, which loads whole tiles: the last, when partial,
// from a padded copy.
struct RowTiles {
  const uint32_t* x;
  int64_t rows, pairs;
  const uint32_t* tail;  // [16, pairs] (the last rows first), or null where none is partial
  int64_t count() const { return (rows + kvserve_amx::kTileRows - 1) / kvserve_amx::kTileRows; }
  const uint32_t* tile(int64_t t) const {
    return (t + 1) * kvserve_amx::kTileRows <= rows ? x + t * kvserve_amx::kTileRows * pairs
                                                    : tail;
  }
};

// Panels [c0, c1) for every row on AMX: blocks of 32 rows x 2 panels (16 rows x 3
// panels for a last lone row tile), their sums over the pairs [0, 16 * (K / 32)) in
// float32 scratch, which the AVX512-BF16 micro-kernel then takes over: any pairs
// left (K not a multiple of 32), the bias, the rounding to bf16, the real rows only.
void amx_chunk(const PairsProblem& q, const RowTiles& x, int64_t c0, int64_t c1) {
  const int64_t pairs16 = q.pairs / kvserve_amx::kTilePairs * kvserve_amx::kTilePairs;
  const int64_t panel_stride = q.pairs * kPairsPanel;
  constexpr int64_t ldc = 3 * kPairsPanel;
  alignas(64) float sums[2 * kvserve_amx::kTileRows * ldc];
  const kvserve_amx::Tiles tiles;
  for (int64_t t = 0; t < x.count(); t += 2) {
    const int64_t row = t * kvserve_amx::kTileRows;
    const int64_t rows = std::min(2 * kvserve_amx::kTileRows, q.rows - row);
    auto run = [&](auto mt, auto nt, int64_t p) {
      constexpr int MT = decltype(mt)::value, NT = decltype(nt)::value;
      const uint32_t* tiles_x[MT];
      for (int m = 0; m < MT; ++m) tiles_x[m] = x.tile(t + m);
      kvserve_amx::block<MT, NT>(tiles_x, q.pairs, q.weight + p * panel_stride, panel_stride,
                                 pairs16, sums, ldc);
      for (int64_t r = 0; r < rows; r += kPairsRows)
        pairs_rows(std::min(kPairsRows, rows - r), q, row + r, p, p + NT, pairs16, q.pairs,
                   sums + r * ldc, ldc);
    };
    using one = std::integral_constant<int, 1>;
    using two = std::integral_constant<int, 2>;
    using three = std::integral_constant<int, 3>;
    int64_t p = c0;
    if (t + 1 < x.count()) {
      for (; p + 2 <= c1; p += 2) run(two{}, two{}, p);
      if (p < c1) run(two{}, one{}, p);
    } else {
      for (; p + 3 <= c1; p += 3) run(one{}, three{}, p);
      if (p + 2 <= c1) run(one{}, two{}, p);
      else if (p < c1) run(one{}, one{}, p);
    }
  }
}

enum class Kernel { kAvx512, kAmx };

// Which kernel a product takes by default: AMX wherever the CPU has it (and K has
// a tile of pairs), for every row count alike (see bf16_pairs_amx.h).
Kernel default_kernel(int64_t pairs) {
  return kvserve_amx::amx_here() && pairs >= kvserve_amx::kTilePairs ? Kernel::kAmx
                                                                      : Kernel::kAvx512;
}

void pairs_gemm(const PairsProblem& q, Kernel kernel) {
  const int64_t panels = (q.n + kPairsPanel - 1) / kPairsPanel;
  if (kernel == Kernel::kAvx512) {
    kvserve_cpu::for_each_chunk(panels, kChunkPanels,
                                [&](int64_t c0, int64_t c1) { pairs_chunk(q, c0, c1); });
    return;
  }
  // Kept across calls, as pairs_chunk's carry is (a batch-1 step pads its one row
  // in every layer). The padding rows are not cleared: a tile's rows are summed
  // apart, and those rows' sums are never stored.
  thread_local std::vector<uint32_t> tail;
  const int64_t whole = q.rows / kvserve_amx::kTileRows * kvserve_amx::kTileRows;
  const bool padded = whole < q.rows;
  if (padded) {
    tail.resize(std::max<size_t>(tail.size(), kvserve_amx::kTileRows * q.pairs));
    std::memcpy(tail.data(), q.x + whole * q.pairs, (q.rows - whole) * q.pairs * 4);
  }
  const RowTiles x{q.x, q.rows, q.pairs, padded ? tail.data() : nullptr};
  kvserve_cpu::for_each_chunk(panels, amx_chunk_panels(q.pairs),
                              [&](int64_t c0, int64_t c1) { amx_chunk(q, x, c0, c1); });
}

// y = x W^T (+ bias) on `kernel`, or where none is named the one default_kernel picks.
at::Tensor bf16_linear_with(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                            const std::optional<at::Tensor>& bias,
                            std::optional<Kernel> kernel) {
  TORCH_CHECK(pairs_dots_here(), "bf16_linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be 2-D bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t k = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 3 &&
                  weight.size(1) * 2 == k && weight.size(2) == 2 * kPairsPanel &&
                  weight.size(0) * kPairsPanel >= n && weight.is_contiguous(),
              "bf16_linear: weight ", weight.sizes(), " ", weight.scalar_type(),
              " is not bf16 pair panels for ", k, " inputs and ", n, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n),
              "bf16_linear: the bias must be ", n, " bfloat16 values");
  const at::Tensor rows = x.contiguous();
  const at::Tensor bias_rows = has_bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  if (rows.size(0) == 0 || n == 0) return out;
  if (k == 0) return has_bias ? out.copy_(bias_rows.view({1, n}).expand({rows.size(0), n}))
                              : out.zero_();
  const PairsProblem q{reinterpret_cast<const uint32_t*>(rows.data_ptr()),
                       rows.size(0),
                       k / 2,
                       reinterpret_cast<const uint32_t*>(weight.data_ptr()),
                       has_bias ? reinterpret_cast<const uint16_t*>(bias_rows.data_ptr())
                                : nullptr,
                       reinterpret_cast<uint16_t*>(out.data_ptr()),
                       n};
#if KVSERVE_AVX512_BUILT  // (else refused above: pairs_dots_here)
  pairs_gemm(q, kernel.value_or(default_kernel(q.pairs)));
#endif
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  return bf16_linear_with(x, weight, n, bias, std::nullopt);
}

// The op on a named kernel ("avx512" or "amx"), for tests and benchmarks.
at::Tensor bf16_linear_on(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                          const std::optional<at::Tensor>& bias, c10::string_view kernel) {
  TORCH_CHECK(kernel == "avx512" || kernel == "amx",
              "bf16_linear_on: kernel must be avx512 or amx, got ", kernel);
  TORCH_CHECK(kernel != "amx" || kvserve_amx::amx_here(),
              "bf16_linear_on: this CPU (or this process) has no AMX-BF16");
  return bf16_linear_with(x, weight, n, bias, kernel == "amx" ? Kernel::kAmx : Kernel::kAvx512);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_on(Tensor x, Tensor weight, int n, Tensor? bias, str kernel) -> Tensor");
  // Whether bf16_linear takes AMX here (the CPU has it and Linux granted its tiles).
  m.def("bf16_amx_here() -> bool", [] { return kvserve_amx::amx_here(); });
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
  m.impl("bf16_linear_on", bf16_linear_on);
}

// The op's C entry point, which AOTInductor's C++ wrappers call directly where the
// graph is built with it (engine/kernels/cpu/c_shims.py) rather than through the
// dispatcher's boxed call (its proxy executor: 1.60 against 1.32 us a tiny call).
// Visible: the library's other symbols are hidden (build.py's FLAGS).
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_bf16_linear(
    AtenTensorHandle x, AtenTensorHandle weight, int64_t n, AtenTensorHandle* bias,
    AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    *ret0 = torch::aot_inductor::new_tensor_handle(
        bf16_linear(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight),
                    n, torch::aot_inductor::pointer_to_optional<at::Tensor>(bias)));
  });
}
