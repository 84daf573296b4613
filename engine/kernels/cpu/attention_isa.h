// Which of the CPU's instruction sets the attention kernels (paged_decode.cpp,
// paged_prefill.cpp) may use, each asked once a process. $KVSERVE_CPU_ISA narrows
// them, the tests' way to reach the other paths on a CPU that has more: avx2 keeps
// every pass on AVX2, avx512 keeps AVX-512 but not AVX512-BF16's dot products.
#pragma once

#include <cstdlib>
#include <cstring>

#include "isa_built.h"

#define KVSERVE_AVX512_ATTENTION "avx512f,avx512bw,avx512vl,avx512dq"
#define KVSERVE_AVX512_BF16_DOTS KVSERVE_AVX512_ATTENTION ",avx512bf16"

namespace kvserve_cpu {

inline bool isa_narrowed_to(const char* name) {
  const char* isa = std::getenv("KVSERVE_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, name) == 0;
}

inline bool avx512_attention_here() {
  static const bool here = [] {
    __builtin_cpu_init();
    return KVSERVE_AVX512_BUILT && !isa_narrowed_to("avx2") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return here;
}

// AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): dot products of bf16 pairs into
// float32, a product of two bf16 values exact, so bf16 queries and keys are multiplied
// as they lie.
inline bool bf16_dots_here() {
  static const bool here = [] {
    __builtin_cpu_init();
    return !isa_narrowed_to("avx512") && avx512_attention_here() &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return here;
}

}  // namespace kvserve_cpu
