// kvserve::expert_linear: a mixture-of-experts layer's grouped GEMM for few rows per
// expert, reading the experts' weights where they lie ([E, N, K], as loaded: no
// packing, so torch's grouped GEMM reads the same tensor where many rows make it
// compute-bound; engine/kernels/moe/fused_experts.py picks).
//
// x [R, K] float32 holds the (token, expert) pairs' rows sorted by expert, counts[e]
// of them for expert e; weight [E, N, K] float32, bf16, or int8 with a float32 scale
// per output row (scales [E, N], --quantization int8), or a GGUF's kept experts:
// int8 values or 4-bit codes two to a byte ([E, N, K / 2] uint8) with a float32
// scale, and minimum where the type has one, per group of K / G inputs (scales,
// mins [E, N, G]: w = q * scale + min). Row r of the output is its expert's weight
// times x[r]: [R, N] float32. x may be bf16 where the experts are: their products
// are then taken two at a time by AVX-512 BF16 where the CPU has it
// (expert_bf16_dots.h), else x is widened. int8_inputs (int8 experts with row scales, K a
// multiple of 32): x is quantized to int8 in blocks of 32 inputs and multiplied as
// integers (expert_int8_dots.h), as llama.cpp does with Q8_0 weights; otherwise the
// weights are widened and the products exact.
//
// Decode steps route a few tokens to each expert, so each expert's product is a
// narrow GEMV, bound by reading its weights. The work is (active expert, block of
// kBlockRows output rows) items, split evenly across torch's threads in one
// parallel_for: each weight row is read from memory once whatever the expert's row
// count (blocks of MR rows of x re-read it from L1/L2), no thread waits on another
// between experts, and no expert costs a call of its own. Each output is a dot
// product along K: one weight row at a time, read front to back (a thread's reads
// one sequential stream), against MR rows of x, 8 inputs an FMA (bf16 widened by a
// shift, int8 by two conversions), summed across lanes four rows at once at the
// end. torch's grouped GEMM read 16 tokens' bf16 experts at ~12 GB/s here (2-core
// Zen 4; the copy bandwidth is ~30), this kernel at ~26.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_shared.h"
#include "expert_linear.h"
#include "int8_inputs.h"
#include "isa_built.h"

namespace {

using kvserve_cpu::hsum;
using kvserve_cpu::kDotBlock;

constexpr int64_t kBlockRows = 16;  // output rows an item takes (32 KiB of bf16 at K 1024)
constexpr int64_t kExpertRows = 3;     // rows of x a dot kernel call takes

struct F32Row {
  using T = float;
  static constexpr int64_t kCodes = 1;  // inputs an element holds
  static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
};

struct BF16Row {
  using T = uint16_t;
  static constexpr int64_t kCodes = 1;
  static inline __m256 load(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
};

struct I8Row {
  using T = int8_t;
  static constexpr int64_t kCodes = 1;
  static inline __m256 load(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};

// Two 4-bit codes a byte (a GGUF's 16-level blocks, group_quant.code_values): input
// 2i in the low nibble, 2i + 1 in the high one.
struct U4Row {
  using T = uint8_t;
  static constexpr int64_t kCodes = 2;
  static inline __m256 load(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof(four));
    const __m128i v = _mm_cvtsi32_si128(four), nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  }
};

template <typename Row>
inline float widen(typename Row::T v) {
  if constexpr (std::is_same_v<Row, BF16Row>) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return float(v);
  }
}

// The sums of four vectors' eight lanes each: [sum a, sum b, sum c, sum d]. (K as
// short as 384 inputs is 48 steps a row, and four separate reductions took a third
// of that.)
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Output rows [n0, n1) of MR rows of x, the weight rows read one after another (one
// sequential stream a thread: see kSteps): row(j, sums) leaves weight row j's lane
// sums against each row of x in sums[m]; store(m, j, total) takes their totals,
// summed across lanes four weight rows at once (one reduction, not four).
template <int MR, typename RowSums, typename Store>
inline void rows_in_order(int64_t n0, int64_t n1, const RowSums& row, const Store& store) {
  for (int64_t j = n0; j < n1; j += 4) {
    const int nr = int(std::min<int64_t>(4, n1 - j));
    __m256 lanes[MR][4];
    for (int r = 0; r < nr; ++r) {
      __m256 sums[MR];
      row(j + r, sums);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) lanes[m][r] = sums[m];
    }
    for (int m = 0; m < MR; ++m) {
      float totals[4];
      if (nr == 4) {
        _mm_storeu_ps(totals, sum4(lanes[m][0], lanes[m][1], lanes[m][2], lanes[m][3]));
      } else {
        for (int r = 0; r < nr; ++r) totals[r] = hsum(lanes[m][r]);
      }
      for (int r = 0; r < nr; ++r) store(m, j + r, totals[r]);
    }
  }
}

struct Expert {
  const float* x;        // its rows of x, [rows, K]
  int64_t rows;
  const void* weight;    // [N, K] (or [N, K / 2] nibble pairs)
  const float* scales;   // [N] per row (int8), [N, G] per group of K / G inputs, or null
  const float* mins;     // [N, G] with group scales where the type has minimums, or null
  float* out;            // its rows of the output, [rows, N]
};

// Steps of 8 inputs a weight row is read in at a time, each summed on its own: one
// row at a time, front to back, so a thread's reads are one sequential stream the
// hardware prefetcher follows (four rows read side by side, as four short streams,
// came from memory at ~18 GB/s against ~28 read in order, 2-core Zen 4). The same
// count whatever the rows of x, so a row's sums do not depend on its batch.
constexpr int kSteps = 2;

// Weight row j against MR rows of x (from x_row on): each row's float32 sums, lane
// by lane, in sums[m] (K's last inputs past a whole 8 left to the caller, and the
// row's scale). kGroups: each group of K / groups inputs of the row widened to
// q * scale + min (in float32, as group_quant.group_weights computes it) before it
// meets x.
template <int MR, typename Row, bool kGroups>
inline void dot_row(const Expert& e, int64_t k_len, int64_t groups, int64_t x_row,
                    int64_t j, __m256 (&sums)[MR]) {
  using T = typename Row::T;
  const int64_t stride = k_len / Row::kCodes;  // elements a weight row holds
  const T* w = static_cast<const T*>(e.weight) + j * stride;
  const float* a = e.x + x_row * k_len;
  __m256 acc[MR][kSteps];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int s = 0; s < kSteps; ++s) acc[m][s] = _mm256_setzero_ps();
  const int64_t group_len = kGroups ? k_len / groups : k_len / 8 * 8;
  for (int64_t g = 0; g < (kGroups ? groups : 1); ++g) {
    __m256 scale = _mm256_setzero_ps(), low = _mm256_setzero_ps();
    if constexpr (kGroups) {
      scale = _mm256_set1_ps(e.scales[j * groups + g]);
      low = _mm256_set1_ps(e.mins != nullptr ? e.mins[j * groups + g] : 0.0f);
    }
    // 8 inputs at k into acc[.][s]
    auto step = [&](int64_t k, int s) {
      __m256 wv = Row::load(w + k / Row::kCodes);
      if constexpr (kGroups) wv = _mm256_fmadd_ps(wv, scale, low);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
        acc[m][s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + m * k_len + k), wv, acc[m][s]);
    };
    const int64_t k0 = g * group_len, k1 = k0 + group_len;
    const int64_t paired = k0 + (k1 - k0) / (8 * kSteps) * (8 * kSteps);
    for (int64_t k = k0; k < paired; k += 8 * kSteps) {
#pragma GCC unroll 2
      for (int s = 0; s < kSteps; ++s) step(k + 8 * s, s);
    }
    for (int64_t k = paired; k < k1; k += 8) step(k, 0);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) sums[m] = _mm256_add_ps(acc[m][0], acc[m][1]);
}

// Output rows [n0, n1) for MR rows of x (from x_row on).
template <int MR, typename Row, bool kGroups>
inline void dot_rows(const Expert& e, int64_t k_len, int64_t groups, int64_t n,
                     int64_t x_row, int64_t n0, int64_t n1) {
  using T = typename Row::T;
  const int64_t stride = k_len / Row::kCodes;
  const int64_t whole = kGroups ? k_len : k_len / 8 * 8;
  rows_in_order<MR>(
      n0, n1,
      [&](int64_t j, __m256(&sums)[MR]) {
        dot_row<MR, Row, kGroups>(e, k_len, groups, x_row, j, sums);
      },
      [&](int m, int64_t j, float sum) {
        const float* a = e.x + (x_row + m) * k_len;
        const T* w = static_cast<const T*>(e.weight) + j * stride;
        for (int64_t t = whole; t < k_len; ++t)  // K's last inputs past a whole 8
          sum += a[t] * widen<Row>(w[t]);
        if (!kGroups && e.scales != nullptr) sum *= e.scales[j];
        e.out[(x_row + m) * n + j] = sum;
      });
}

template <typename Row, bool kGroups>
void block(const Expert& e, int64_t k_len, int64_t groups, int64_t n, int64_t n0,
           int64_t n1) {
  for (int64_t row = 0; row < e.rows; row += kExpertRows) {
    switch (std::min(kExpertRows, e.rows - row)) {
      case 3: dot_rows<3, Row, kGroups>(e, k_len, groups, n, row, n0, n1); break;
      case 2: dot_rows<2, Row, kGroups>(e, k_len, groups, n, row, n0, n1); break;
      default: dot_rows<1, Row, kGroups>(e, k_len, groups, n, row, n0, n1);
    }
  }
}

// Every (active expert, block of kBlockRows output rows) item of a grouped product,
// split evenly across torch's threads: block(expert, n0, n1) for each.
template <typename ExpertT, typename Block>
void for_each_block(const std::vector<ExpertT>& experts, int64_t n, const Block& block) {
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  const int64_t items = int64_t(experts.size()) * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i % blocks;
      block(experts[i / blocks], b * kBlockRows, std::min(n, (b + 1) * kBlockRows));
    }
  });
}

template <typename Row, bool kGroups = false>
void grouped(const std::vector<Expert>& experts, int64_t k_len, int64_t groups, int64_t n) {
  for_each_block(experts, n, [&](const Expert& e, int64_t n0, int64_t n1) {
    block<Row, kGroups>(e, k_len, groups, n, n0, n1);
  });
}

// int8 experts times x quantized to int8 (expert_int8_dots.h), for AVX2 and, where
// the CPU has it, AVX-512 VNNI.
// What a kernel call reads of one active expert's rows.
struct Int8Expert {
  const int8_t* x_q;     // its rows of x as int8, [rows, K]
  const float* x_step;   // their blocks' steps, [rows, K / kDotBlock]
  int64_t rows;
  const int8_t* weight;  // [N, K]
  const float* scales;   // [N], a scale per weight row
  float* out;            // its rows of the output, [rows, N]
};

namespace avx2 {
#define KV_VNNI 0
#include "expert_int8_dots.h"
#undef KV_VNNI
}  // namespace avx2

#if KVSERVE_AVX512_BUILT
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define KV_VNNI 1
#include "expert_int8_dots.h"
#undef KV_VNNI
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace bf16dot {
#include "expert_bf16_dots.h"
}  // namespace bf16dot
#pragma GCC pop_options
#endif  // KVSERVE_AVX512_BUILT

// Whether the CPU's AVX-512 extensions may be used: not with KVSERVE_CPU_ISA=avx2
// (the tests compare the paths this way).
bool avx512_allowed() {
  const char* isa = std::getenv("KVSERVE_CPU_ISA");
  return !(isa != nullptr && std::strcmp(isa, "avx2") == 0);
}

// Whether to take AVX-512 BF16's dot products for bf16 experts and rows.
bool use_bf16_dots() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return KVSERVE_AVX512_BUILT && avx512_allowed() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
}

// Whether to take AVX-512 VNNI's integer products: where the CPU (and the OS) has
// them, unless KVSERVE_CPU_ISA=avx2.
bool use_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return KVSERVE_AVX512_BUILT && avx512_allowed() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

// The counts, checked: each non-negative, summing to the rows of x.
void check_counts(const int64_t* count, int64_t num_experts, int64_t rows) {
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(count[e] >= 0, "expert_linear: negative count");
    total += count[e];
  }
  TORCH_CHECK(total == rows, "expert_linear: counts sum to ", total, ", not x's ", rows,
              " rows");
}

// bf16 experts' products with bf16 rows of x (expert_bf16_dots.h).
at::Tensor bf16_products(const at::Tensor& rows, const int64_t* count, const at::Tensor& weight) {
  const int64_t num_experts = weight.size(0), n = weight.size(1), k = rows.size(1);
  at::Tensor out = at::empty({rows.size(0), n}, rows.options().dtype(at::kFloat));
#if KVSERVE_AVX512_BUILT
  const auto* x = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<bf16dot::BF16Expert> experts;
  int64_t row = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] > 0 && n > 0)
      experts.push_back(bf16dot::BF16Expert{x + row * k, count[e], w + e * n * k,
                                            out.data_ptr<float>() + row * n});
    row += count[e];
  }
  if (!experts.empty()) bf16dot::bf16_grouped(experts, k, n);
#else
  TORCH_CHECK(false, "expert_linear: bf16 dot products need AVX-512 (use_bf16_dots)");
#endif
  return out;
}

// The int8 experts' products with x quantized to int8 (every row of x at once).
at::Tensor int8_input_products(const at::Tensor& rows, const int64_t* count,
                               const at::Tensor& weight, const at::Tensor& scales) {
  const int64_t num_experts = weight.size(0), n = weight.size(1), k = rows.size(1);
  const int64_t blocks = k / kDotBlock;
  std::vector<int8_t> x_q(rows.size(0) * k);
  std::vector<float> x_step(rows.size(0) * blocks);
  kvserve_cpu::quantize_for_dot(rows.data_ptr<float>(), rows.size(0), k, x_q.data(),
                                x_step.data());
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  std::vector<Int8Expert> experts;
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  int64_t row = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] > 0 && n > 0)
      experts.push_back(Int8Expert{x_q.data() + row * k, x_step.data() + row * blocks,
                                         count[e], w + e * n * k, s + e * n,
                                         out.data_ptr<float>() + row * n});
    row += count[e];
  }
  if (experts.empty()) return out;
#if KVSERVE_AVX512_BUILT
  if (use_vnni()) {
    vnni::int8_grouped(experts, k, n);
    return out;
  }
#endif
  avx2::int8_grouped(experts, k, n);
  return out;
}

void check_per_group(const char* what, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == like.sizes(),
              "expert_linear: group ", what, " must be contiguous float32 ", like.sizes(),
              ", got ", t.sizes(), " ", t.scalar_type());
}


}  // namespace

namespace kvserve_cpu {

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& counts,
                         const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, bool int8_inputs) {
  const auto type = weight.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               (x.scalar_type() == at::kBFloat16 && type == at::kBFloat16)),
              "expert_linear: x must be 2-D float32 (or bf16, with bf16 experts), got ",
              x.sizes(), " ", x.scalar_type());
  if (x.scalar_type() == at::kBFloat16 && !use_bf16_dots())
    return expert_linear(x.to(at::kFloat), counts, weight, scales, mins, int8_inputs);
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kChar ||
                  type == at::kByte,
              "expert_linear: experts are float32, bfloat16, int8 or uint8 (4-bit code "
              "pairs), not ", type);
  const int64_t k = x.size(1), codes = type == at::kByte ? 2 : 1;
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) * codes == k && weight.is_contiguous(),
              "expert_linear: weight ", weight.sizes(), " is not contiguous [E, N, ", k / codes,
              "]");
  const int64_t num_experts = weight.size(0), n = weight.size(1);
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong &&
                  counts.numel() == num_experts && counts.device().is_cpu(),
              "expert_linear: counts must be ", num_experts, " int64 values");
  const bool has_scales = scales.has_value() && scales->defined();
  const bool has_mins = mins.has_value() && mins->defined();
  const bool integers = type == at::kChar || type == at::kByte;
  TORCH_CHECK(has_scales == integers,
              "expert_linear: integer experts, and only they, take scales");
  int64_t groups = 0;  // 0: a scale per row (or none)
  if (has_scales && scales->dim() == 3) {
    groups = scales->size(2);
    TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 8 == 0 &&
                    scales->size(0) == num_experts && scales->size(1) == n,
                "expert_linear: group scales [", num_experts, ", ", n,
                ", G] with groups of a multiple of 8 of the ", k, " inputs, got ",
                scales->sizes());
    check_per_group("scales", *scales, *scales);
    if (has_mins) check_per_group("minimums", *mins, *scales);
  } else {
    TORCH_CHECK(!has_mins, "expert_linear: minimums come with group scales");
    TORCH_CHECK(type != at::kByte, "expert_linear: 4-bit codes need group scales");
    TORCH_CHECK(!has_scales || (scales->scalar_type() == at::kFloat &&
                                scales->is_contiguous() && scales->dim() == 2 &&
                                scales->size(0) == num_experts && scales->size(1) == n),
                "expert_linear: int8 row scales must be [", num_experts, ", ", n,
                "] contiguous float32");
  }
  const at::Tensor rows = x.contiguous();
  const at::Tensor counted = counts.contiguous();
  const int64_t* count = counted.data_ptr<int64_t>();
  if (rows.scalar_type() == at::kBFloat16) {
    check_counts(count, num_experts, rows.size(0));
    return bf16_products(rows, count, weight);
  }
  if (int8_inputs && type == at::kChar && groups == 0 && k % kDotBlock == 0) {
    check_counts(count, num_experts, rows.size(0));
    return int8_input_products(rows, count, weight, *scales);
  }
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  std::vector<Expert> experts;
  int64_t row = 0;
  const int64_t expert_bytes = n * weight.size(2) * weight.element_size();
  const int64_t scales_each = has_scales ? n * std::max<int64_t>(groups, 1) : 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(count[e] >= 0 && row + count[e] <= rows.size(0),
                "expert_linear: counts sum past x's ", rows.size(0), " rows");
    if (count[e] > 0 && n > 0)
      experts.push_back(Expert{rows.data_ptr<float>() + row * k, count[e],
                               static_cast<const char*>(weight.data_ptr()) + e * expert_bytes,
                               has_scales ? scales->data_ptr<float>() + e * scales_each
                                          : nullptr,
                               has_mins ? mins->data_ptr<float>() + e * scales_each : nullptr,
                               out.data_ptr<float>() + row * n});
    row += count[e];
  }
  TORCH_CHECK(row == rows.size(0), "expert_linear: counts sum to ", row, ", not x's ",
              rows.size(0), " rows");
  if (experts.empty()) return out;
  if (type == at::kFloat)
    grouped<F32Row>(experts, k, groups, n);
  else if (type == at::kBFloat16)
    grouped<BF16Row>(experts, k, groups, n);
  else if (type == at::kByte)
    grouped<U4Row, true>(experts, k, groups, n);
  else if (groups > 0)
    grouped<I8Row, true>(experts, k, groups, n);
  else
    grouped<I8Row>(experts, k, groups, n);
  return out;
}

bool expert_bf16_dots() { return use_bf16_dots(); }

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("expert_linear(Tensor x, Tensor counts, Tensor weight, Tensor? scales=None, "
        "Tensor? mins=None, bool int8_inputs=False) -> Tensor");
  // Whether bf16 rows meet bf16 experts in AVX-512 BF16's dot products here.
  m.def("expert_bf16_dots() -> bool", [] { return kvserve_cpu::expert_bf16_dots(); });
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("expert_linear", kvserve_cpu::expert_linear); }
