// kvserve::packed_linear: y = x W^T (+ bias) for float32 rows x and one weight
// packed at load (packing.py); the kernels and the layout: packed_panels.h.
#include "packed_panels.h"

namespace {

template <typename Panel>
void quantized_gemm(const Problem& q) {
  if (q.rows <= kWidenInRegistersRows) {
    if constexpr (!Panel::kMins) return gemm<Panel>(q);
    // Each row's sum over each group, once: the minimums' share of every column.
    const int64_t groups = q.k_len / q.groups.len;
    std::vector<float> sums(q.rows * groups, 0.0f);
    for (int64_t r = 0; r < q.rows; ++r)
      for (int64_t k = 0; k < q.k_len; ++k)
        sums[r * groups + k / q.groups.len] += q.x[r * q.k_len + k];
    Problem with_sums = q;
    with_sums.groups.x_sums = sums.data();
    if (!q.int8_inputs || q.rows > kDotRows || q.groups.len % kDotBlock != 0)
      return gemm<Panel>(with_sums);
    std::vector<int8_t> x_q(q.rows * q.k_len);
    std::vector<float> x_step(q.rows * q.k_len / kDotBlock);
    quantize_for_dot(q.x, q.rows, q.k_len, x_q.data(), x_step.data());
    with_sums.groups.x_q = x_q.data();
    with_sums.groups.x_step = x_step.data();
    return gemm<U4DotPanel>(with_sums);
  }
  const int64_t panels = (q.n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1,
                   [&](int64_t begin, int64_t end) { widened_panels<Panel>(q, begin, end); });
}

void check_groups(const at::Tensor& weight, int64_t k, const std::optional<at::Tensor>& t,
                  const char* what) {
  TORCH_CHECK(t.has_value() && t->defined() && t->scalar_type() == at::kHalf &&
                  t->dim() == 3 && t->size(0) == weight.size(0) && t->size(1) > 0 &&
                  k >= t->size(1) && k % t->size(1) == 0 && t->size(2) == kPanel &&
                  t->is_contiguous(),
              "packed_linear: ", weight.scalar_type(), " panels ", weight.sizes(),
              " need float16 group ", what, " [", weight.size(0), ", K / group, ", kPanel,
              "]");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, bool int8_inputs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "packed_linear: x must be 2-D float32, got ", x.sizes(), " ", x.scalar_type());
  const auto type = weight.scalar_type();
  const int64_t row_elems = type == at::kByte ? kPanel / 2 : kPanel;
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == x.size(1) &&
                  weight.size(2) == row_elems && weight.size(0) * kPanel >= n &&
                  weight.is_contiguous(),
              "packed_linear: weight ", weight.sizes(), " is not packed for ", x.size(1),
              " inputs and ", n, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->numel() == n),
              "packed_linear: the bias must be ", n, " contiguous float32 values");
  const bool has_scales = scales.has_value() && scales->defined();
  const bool has_mins = mins.has_value() && mins->defined();
  const int64_t k = x.size(1);
  Groups groups;
  const float* col_scale = nullptr;
  if (type == at::kFloat || type == at::kBFloat16) {
    TORCH_CHECK(!has_scales && !has_mins, "packed_linear: float panels take no scales");
  } else if (type == at::kChar && has_scales && scales->scalar_type() == at::kFloat) {
    TORCH_CHECK(!has_mins && scales->is_contiguous() && scales->numel() == weight.size(0) * kPanel,
                "packed_linear: per-column int8 scales must be ", weight.size(0) * kPanel,
                " contiguous float32 values and no minimums");
    col_scale = scales->data_ptr<float>();
  } else if (type == at::kChar) {
    check_groups(weight, k, scales, "scales");
    TORCH_CHECK(!has_mins, "packed_linear: int8 panels take no minimums");
  } else if (type == at::kByte) {
    check_groups(weight, k, scales, "scales");
    check_groups(weight, k, mins, "minimums");
    TORCH_CHECK(mins->size(1) == scales->size(1), "packed_linear: scales and minimums "
                "of different group sizes");
  } else {
    TORCH_CHECK(false, "packed_linear: packed weights are float32, bfloat16, int8 or "
                "uint8 (int4 pairs), not ", type);
  }
  if (has_scales && scales->scalar_type() == at::kHalf) {
    groups.scales = reinterpret_cast<const uint16_t*>(scales->data_ptr());
    groups.len = k / scales->size(1);
  }
  if (has_mins) groups.mins = reinterpret_cast<const uint16_t*>(mins->data_ptr());
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  if (rows.size(0) == 0 || n == 0) return out;
  // (K = 0 needs no case of its own: the sums stay 0 and the bias is added.)
  const Problem q{rows.data_ptr<float>(), rows.size(0), k, weight.data_ptr(), groups, n,
                  col_scale, has_bias ? bias->data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), int8_inputs};
  if (type == at::kFloat)
    gemm<F32Panel>(q);
  else if (type == at::kBFloat16)
    gemm<BF16Panel>(q);
  else if (type == at::kByte)
    quantized_gemm<U4Panel>(q);
  else if (groups.scales != nullptr)
    quantized_gemm<I8GroupPanel>(q);
  else
    quantized_gemm<I8Panel>(q);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "packed_linear(Tensor x, Tensor weight, int n, Tensor? bias, Tensor? scales=None, "
      "Tensor? mins=None, bool int8_inputs=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("packed_linear", packed_linear); }
