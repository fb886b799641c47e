// Every layer of a decode step in one call: the same kernels, in the same order, as the
// model's fused eager path (models/llama.py and models/gemma3.py, forward_fused), called
// from C++.
//
// At batch 1 a step is some 250 kernel calls of 5-60 us each (SmolLM2: 30 layers of norms,
// four projections, rotary and attention). From Python each call costs 3-4 us of its own
// (the module call, the dispatcher boxing its arguments) and the layers' glue about as much
// again: over a millisecond of a ~7 ms step on an AVX2 CPU. Called here, each is a plain C++
// function call. Taken only where every projection runs on int8_act_gemm and the step is
// decodes alone (gemel/layers/decode_layers.py decides); otherwise the Python path runs.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include "ops.h"

#include <optional>

namespace {

// Projection p of layer i: per layer four (qkv, o, gate_up, down), each its codes, scales,
// lows, out_features and zero point, as Linear holds them for int8_act_gemm.
struct Projections {
  at::TensorList codes, scales, lows;
  at::IntArrayRef out_features, zero_points;

  at::Tensor apply(int64_t layer, int p, const at::Tensor& x, bool gated = false) const {
    const int64_t i = layer * 4 + p;
    return gemel::ops::int8_act_gemm(x, codes[i], scales[i], lows[i], out_features[i], gated, zero_points[i]);
  }
};

// x: the embedded tokens [B, hidden], one per sequence. norms per layer: Llama (input,
// post_attention); Gemma 3 (input, post_attention, pre_feedforward, post_feedforward, q_norm,
// k_norm). cos/sin: rotary tables [B, head_dim], rope_index[i] picks layer i's (Gemma 3's
// local and global), windows[i] its sliding window (0: none). Returns the final norm of the
// residual stream, [B, hidden], what the model's forward returns.
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList cos, at::TensorList sin,
                         at::IntArrayRef rope_index, at::IntArrayRef windows,
                         const at::Tensor& slot_mapping, const at::Tensor& kv_slots, const at::Tensor& context_lens,
                         at::TensorList norms, const at::Tensor& final_norm,
                         at::TensorList codes, at::TensorList scales,
                         at::TensorList lows, at::IntArrayRef out_features,
                         at::IntArrayRef zero_points, at::TensorList k_caches,
                         at::TensorList v_caches, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double attn_scale, bool gemma) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t per_layer = gemma ? 6 : 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x must be contiguous [B, hidden]");
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers && static_cast<int64_t>(norms.size()) == per_layer * layers &&
                  static_cast<int64_t>(codes.size()) == 4 * layers && scales.size() == codes.size() &&
                  lows.size() == codes.size() && out_features.size() == codes.size() &&
                  zero_points.size() == codes.size() && static_cast<int64_t>(rope_index.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers && cos.size() == sin.size(),
              "decode_layers: per-layer lists of inconsistent lengths");
  for (int64_t r : rope_index) TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(cos.size()), "decode_layers: rope_index out of range");
  const Projections proj{codes, scales, lows, out_features, zero_points};
  const int64_t batch = x_in.size(0);
  at::Tensor x = x_in, h, mlp;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* n = &norms[i * per_layer];
    if (i == 0) {
      h = gemel::ops::rms_norm(x, n[0], eps);
    } else {
      std::optional<at::Tensor> post_ffn;
      if (gemma) post_ffn = norms[(i - 1) * per_layer + 3];
      std::tie(x, h) = gemel::ops::add_rms_norm(x, mlp, n[0], eps, post_ffn);
    }
    const at::Tensor qkv = proj.apply(i, 0, h);
    std::optional<at::Tensor> q_norm, k_norm;
    if (gemma) q_norm = n[4], k_norm = n[5];
    const int64_t r = rope_index[i];
    const at::Tensor q = gemel::ops::rotary_q_store_kv(qkv, cos[r], sin[r], k_caches[i], v_caches[i], slot_mapping,
                                                       num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps);
    const at::Tensor attn = gemel::ops::paged_decode_attention(q, k_caches[i], v_caches[i], kv_slots, context_lens,
                                                               attn_scale, windows[i])
                                .view({batch, num_heads * head_dim});
    std::optional<at::Tensor> post_attn;
    if (gemma) post_attn = n[1];
    std::tie(x, h) = gemel::ops::add_rms_norm(x, proj.apply(i, 1, attn), gemma ? n[2] : n[1], eps, post_attn);
    const at::Tensor gate_up = proj.apply(i, 2, h);
    mlp = gemma ? proj.apply(i, 3, gemel::ops::gelu_tanh_and_mul(gate_up)) : proj.apply(i, 3, gate_up, /*gated=*/true);
  }
  std::optional<at::Tensor> last_post_ffn;
  if (gemma) last_post_ffn = norms[(layers - 1) * per_layer + 3];
  return std::get<1>(gemel::ops::add_rms_norm(x, mlp, final_norm, eps, last_post_ffn));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("decode_layers(Tensor x, Tensor[] cos, Tensor[] sin, int[] rope_index, int[] windows, Tensor slot_mapping, "
        "Tensor kv_slots, Tensor context_lens, Tensor[] norms, Tensor final_norm, Tensor[] codes, Tensor[] scales, "
        "Tensor[] lows, int[] out_features, int[] zero_points, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float attn_scale, bool gemma) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) { m.impl("decode_layers", &decode_layers); }
