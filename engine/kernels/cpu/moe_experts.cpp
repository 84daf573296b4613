// kvserve::moe_experts: a mixture-of-experts layer's routed experts for few rows an
// expert (decode steps, short prompt chunks), in one call: the (token, expert) pairs
// sorted by expert (a counting sort), their rows gathered, the gate/up product
// (kvserve::expert_linear), SwiGLU, the down product, and each pair's result
// weighted and summed into its token's row. The same steps as
// engine/kernels/moe/fused_experts.py's Python path, whose ~20 torch calls cost
// ~0.5 ms a layer beside the experts' ~3-7 ms at 16 tokens (2-core Zen 4).
//
// x [T, H] float32 or bf16; topk_ids [T, K] global expert ids (this rank holds
// [first, first + E)); topk_weights [T, K]; w13 [E, 2I, H] and w2 [E, H, I] as
// expert_linear reads them (with their scales and minimums). SiLU-gated experts
// without biases only (the caller keeps the others). Returns [T, H] in x's dtype,
// or an empty tensor where more than max_rows pairs meet an active expert on
// average: torch's GEMMs are faster there, and the caller takes them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "attention_shared.h"
#include "expert_linear.h"

namespace {

// silu(x) = x * sigmoid(x) for eight floats: e = exp(-|x|) (kvserve_cpu's exp for
// non-positive arguments, float32's precision), sigmoid(x) = 1 / (1 + e) where x >= 0,
// e / (1 + e) below.
inline __m256 silu8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = kvserve_cpu::exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 below = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, below), _mm256_add_ps(one, e));
  return _mm256_mul_ps(x, sigmoid);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t first,
                       const std::optional<at::Tensor>& w13_scale,
                       const std::optional<at::Tensor>& w2_scale,
                       const std::optional<at::Tensor>& w13_min,
                       const std::optional<at::Tensor>& w2_min, bool int8_inputs,
                       int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be 2-D float32 or bf16");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_ids and topk_weights must be [", x.size(0), ", K]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w2.size(0) == w13.size(0) &&
                  w13.size(1) == 2 * (w2.size(2) * (w2.scalar_type() == at::kByte ? 2 : 1)),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I] expected");
  const int64_t tokens = x.size(0), top_k = topk_ids.size(1), hidden = x.size(1);
  // expert_linear's scales and minimums are float32 (an int8 layer's may be bf16)
  const auto as_float = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value() || !t->defined()) return std::nullopt;
    return t->to(at::kFloat).contiguous();
  };
  const int64_t num_experts = w13.size(0), inter = w13.size(1) / 2;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* weight = weights.data_ptr<float>();

  // Pairs routed here, sorted by expert (stable): order[offset[e] .. offset[e + 1]).
  at::Tensor counts = at::zeros({num_experts}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const int64_t e = id[p] - first;
    if (e >= 0 && e < num_experts) ++count[e];
  }
  std::vector<int64_t> offset(num_experts + 1, 0);
  int64_t active = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    offset[e + 1] = offset[e] + count[e];
    active += count[e] > 0;
  }
  const int64_t pairs = offset[num_experts];
  if (pairs > max_rows * active) return at::empty({0}, x.options());
  std::vector<int64_t> order(pairs), next(offset.begin(), offset.end() - 1);
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const int64_t e = id[p] - first;
    if (e >= 0 && e < num_experts) order[next[e]++] = p;
  }

  // The pairs' rows of x: bf16 as they are where bf16 experts take them so, else float32.
  const bool bf16_rows = x.scalar_type() == at::kBFloat16 &&
                         w13.scalar_type() == at::kBFloat16 && kvserve_cpu::expert_bf16_dots();
  const at::Tensor xs = x.contiguous();
  at::Tensor rows = at::empty({pairs, hidden}, x.options().dtype(bf16_rows ? at::kBFloat16
                                                                           : at::kFloat));
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t t = order[i] / top_k;
    if (bf16_rows) {
      std::memcpy(static_cast<at::BFloat16*>(rows.data_ptr()) + i * hidden,
                  static_cast<const at::BFloat16*>(xs.data_ptr()) + t * hidden,
                  hidden * sizeof(at::BFloat16));
    } else if (xs.scalar_type() == at::kFloat) {
      std::memcpy(static_cast<float*>(rows.data_ptr()) + i * hidden,
                  static_cast<const float*>(xs.data_ptr()) + t * hidden, hidden * sizeof(float));
    } else {
      const auto* src = static_cast<const at::BFloat16*>(xs.data_ptr()) + t * hidden;
      float* dst = static_cast<float*>(rows.data_ptr()) + i * hidden;
      for (int64_t k = 0; k < hidden; ++k) dst[k] = float(src[k]);
    }
  }
  const at::Tensor h = kvserve_cpu::expert_linear(
      rows, counts, w13, as_float(w13_scale), as_float(w13_min), int8_inputs);  // [pairs, 2I]

  // SwiGLU: silu(gate) * up, rounded to bf16 for bf16 experts in a bf16 model (as
  // torch's bf16 GEMMs would round it).
  const bool bf16_down = x.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16;
  at::Tensor a = at::empty({pairs, inter}, x.options().dtype(bf16_down ? at::kBFloat16
                                                                       : at::kFloat));
  const float* hp = h.data_ptr<float>();
  auto* a_bf16 = bf16_down ? static_cast<at::BFloat16*>(a.data_ptr()) : nullptr;
  float* a_float = bf16_down ? nullptr : static_cast<float*>(a.data_ptr());
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = hp + i * 2 * inter;
      const float* up = gate + inter;
      int64_t j = 0;
      for (; j + 8 <= inter; j += 8) {
        const __m256 v = _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + j)), _mm256_loadu_ps(up + j));
        if (bf16_down) {
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, v);
          for (int l = 0; l < 8; ++l) a_bf16[i * inter + j + l] = at::BFloat16(lanes[l]);
        } else {
          _mm256_storeu_ps(a_float + i * inter + j, v);
        }
      }
      for (; j < inter; ++j) {
        const float v = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
        if (bf16_down)
          a_bf16[i * inter + j] = at::BFloat16(v);
        else
          a_float[i * inter + j] = v;
      }
    }
  });
  const at::Tensor y = kvserve_cpu::expert_linear(
      a, counts, w2, as_float(w2_scale), as_float(w2_min), int8_inputs);  // [pairs, H]

  // Each pair's result, weighted, into its token's row (float32, in the pairs' order).
  at::Tensor sum = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* out = sum.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t p = order[i];
    float* row = out + (p / top_k) * hidden;
    const float w = weight[p];
    const float* src = yp + i * hidden;
    for (int64_t k = 0; k < hidden; ++k) row[k] += w * src[k];
  }
  return x.scalar_type() == at::kFloat ? sum : sum.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
        "int first, Tensor? w13_scale=None, Tensor? w2_scale=None, Tensor? w13_min=None, "
        "Tensor? w2_min=None, bool int8_inputs=False, int max_rows=6) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("moe_experts", moe_experts); }
