// kvserve::packed_grouped_linear: a mixture-of-experts layer's grouped GEMM over
// experts packed as packed_linear's panels (packed_panels.h), in one call.
//
// x [R, K] float32 holds the (token, expert) pairs' rows sorted by expert, counts[e]
// of them for expert e; weight [E, P, K, 16] is every expert's panels stacked (float32,
// bf16, or int8 with a float32 scale per output column, scales [E, P * 16]); bias
// [E, n] float32. Row r of the output is its expert's weight times x[r].
//
// The work is (active expert, panel) pairs, split evenly across torch's threads in one
// parallel_for: each active expert's panels are read once whatever its row count, no
// thread waits on another between experts, and no expert costs a call of its own (a
// Python loop over packed_linear spent a fifth of a 16-token layer between calls).
#include "packed_panels.h"

namespace {

template <typename Panel>
void grouped_gemm(const std::vector<Problem>& experts, int64_t panels) {
  const int64_t items = int64_t(experts.size()) * panels;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const Problem& q = experts[i / panels];
      const int64_t p0 = i % panels, p1 = std::min(panels, p0 + (end - i));
      if constexpr (Panel::kIntegers) {
        if (q.rows > kWidenInRegistersRows) {
          widened_panels<Panel>(q, p0, p1);
          i += p1 - p0;
          continue;
        }
      }
      direct_panels<Panel>(q, p0, p1);
      i += p1 - p0;
    }
  });
}

at::Tensor packed_grouped_linear(const at::Tensor& x, const at::Tensor& counts,
                                 const at::Tensor& weight, int64_t n,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "packed_grouped_linear: x must be 2-D float32, got ", x.sizes(), " ",
              x.scalar_type());
  const auto type = weight.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kChar,
              "packed_grouped_linear: expert panels are float32, bfloat16 or int8, not ",
              type);
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == x.size(1) && weight.size(3) == kPanel &&
                  weight.size(1) * kPanel >= n && weight.is_contiguous(),
              "packed_grouped_linear: weight ", weight.sizes(), " is not experts' panels for ",
              x.size(1), " inputs and ", n, " outputs");
  const int64_t num_experts = weight.size(0), panels = weight.size(1), k = x.size(1);
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong &&
                  counts.numel() == num_experts && counts.device().is_cpu(),
              "packed_grouped_linear: counts must be ", num_experts, " int64 values");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->dim() == 2 && bias->size(0) == num_experts &&
                            bias->size(1) == n),
              "packed_grouped_linear: the bias must be [", num_experts, ", ", n,
              "] contiguous float32");
  const bool has_scales = scales.has_value() && scales->defined();
  TORCH_CHECK(has_scales == (type == at::kChar),
              "packed_grouped_linear: int8 panels, and only they, take scales");
  TORCH_CHECK(!has_scales || (scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                              scales->dim() == 2 && scales->size(0) == num_experts &&
                              scales->size(1) == panels * kPanel),
              "packed_grouped_linear: int8 scales must be [", num_experts, ", ",
              panels * kPanel, "] contiguous float32");
  const at::Tensor rows = x.contiguous();
  const at::Tensor counted = counts.contiguous();
  const int64_t* count = counted.data_ptr<int64_t>();
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  std::vector<Problem> experts;
  int64_t row = 0;
  const int64_t weight_bytes = panels * k * kPanel * weight.element_size();
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(count[e] >= 0 && row + count[e] <= rows.size(0),
                "packed_grouped_linear: counts sum past x's ", rows.size(0), " rows");
    if (count[e] > 0 && n > 0)
      experts.push_back(Problem{
          rows.data_ptr<float>() + row * k, count[e], k,
          static_cast<const char*>(weight.data_ptr()) + e * weight_bytes, Groups{}, n,
          has_scales ? scales->data_ptr<float>() + e * panels * kPanel : nullptr,
          has_bias ? bias->data_ptr<float>() + e * n : nullptr,
          out.data_ptr<float>() + row * n, false});
    row += count[e];
  }
  TORCH_CHECK(row == rows.size(0), "packed_grouped_linear: counts sum to ", row, ", not x's ",
              rows.size(0), " rows");
  if (experts.empty()) return out;
  const int64_t used = (n + kPanel - 1) / kPanel;  // panels holding the n outputs
  if (type == at::kFloat)
    grouped_gemm<F32Panel>(experts, used);
  else if (type == at::kBFloat16)
    grouped_gemm<BF16Panel>(experts, used);
  else
    grouped_gemm<I8Panel>(experts, used);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("packed_grouped_linear(Tensor x, Tensor counts, Tensor weight, int n, Tensor? bias, "
        "Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("packed_grouped_linear", packed_grouped_linear); }
