// The CPU operators of shared/model/kernels, as bound to Python by bindings.cpp
// (loaded by shared/model/cpu_kernels.py).
#pragma once

#include <torch/extension.h>

namespace aflex {

// Both kernels use AVX-512 (F, BW) and, for the int8 product, VNNI: checked at run time, so the
// extension builds on any x86-64 compiler and says "no" on CPUs without them.
inline bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& weight_scale,
                          const c10::optional<torch::Tensor>& bias, int64_t block, int64_t N);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, const torch::Tensor& lengths);

}  // namespace aflex
