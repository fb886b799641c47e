// The kernels' C++ entry points, for code in this library that calls them without going
// through PyTorch's dispatcher (decode_layers.cpp: a whole decode step's layers in one call).
// Each is the function registered under torch.ops.gemel of the same name.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace gemel::ops {

at::Tensor int8_act_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& low,
                         int64_t out_features, bool gated, int64_t zero_point);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps, const std::optional<at::Tensor>& delta_weight);

at::Tensor gelu_tanh_and_mul(const at::Tensor& x);

at::Tensor rotary_q_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                             const std::optional<at::Tensor>& k_norm, double norm_eps);

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& kv_slots, const at::Tensor& context_lens, double scale,
                                  int64_t window);

}  // namespace gemel::ops
