// kvserve::expert_linear (expert_linear.cpp), callable from the other sources: the
// experts' products for rows of x grouped by expert (see there).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve_cpu {

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& counts,
                         const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, bool int8_inputs);

// Whether bf16 rows meet bf16 experts in AVX-512 BF16's dot products on this CPU.
bool expert_bf16_dots();

}  // namespace kvserve_cpu
