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
//
// The layers' tensors (some 480 for SmolLM2: weights, scales, norms, KV caches) are handed
// over once, to a DecodeLayers object that keeps them; each step passes only its own inputs.
// Passed as lists on every call, converting them cost 78-135 us a step (25-42 us now).
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// One model's layers as the decode step runs them. Per layer: norms (Llama: input,
// post_attention; Gemma 3: input, post_attention, pre_feedforward, post_feedforward, q_norm,
// k_norm), four projections (qkv, o, gate_up, down: codes, scales, lows, out_features and zero
// point as Linear holds them for int8_act_gemm), its K and V caches and which rotary table it
// uses (rope_index: Gemma 3's local and global).
struct DecodeLayers : torch::CustomClassHolder {
  std::vector<at::Tensor> norms, codes, scales, lows, k_caches, v_caches;
  at::Tensor final_norm;
  std::vector<int64_t> out_features, zero_points, rope_index;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, attn_scale;
  bool gemma;

  DecodeLayers(std::vector<at::Tensor> norms, at::Tensor final_norm, std::vector<at::Tensor> codes,
               std::vector<at::Tensor> scales, std::vector<at::Tensor> lows, std::vector<int64_t> out_features,
               std::vector<int64_t> zero_points, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
               std::vector<int64_t> rope_index, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double attn_scale, bool gemma)
      : norms(std::move(norms)), codes(std::move(codes)), scales(std::move(scales)), lows(std::move(lows)),
        k_caches(std::move(k_caches)), v_caches(std::move(v_caches)), final_norm(std::move(final_norm)),
        out_features(std::move(out_features)), zero_points(std::move(zero_points)), rope_index(std::move(rope_index)),
        num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps), attn_scale(attn_scale),
        gemma(gemma) {
    const size_t layers = this->k_caches.size();
    TORCH_CHECK(this->v_caches.size() == layers && this->norms.size() == per_layer() * layers &&
                    this->codes.size() == 4 * layers && this->scales.size() == this->codes.size() &&
                    this->lows.size() == this->codes.size() && this->out_features.size() == this->codes.size() &&
                    this->zero_points.size() == this->codes.size() && this->rope_index.size() == layers,
                "DecodeLayers: per-layer lists of inconsistent lengths");
  }

  size_t per_layer() const { return gemma ? 6 : 2; }

  at::Tensor project(size_t layer, int p, const at::Tensor& x, bool gated = false) const {
    const size_t i = layer * 4 + p;
    return gemel::ops::int8_act_gemm(x, codes[i], scales[i], lows[i], out_features[i], gated, zero_points[i]);
  }

  // x: the embedded tokens [B, hidden], one per sequence. cos/sin: the step's rotary tables
  // [B, head_dim] (layer i uses rope_index[i]); windows[i]: layer i's sliding window (0:
  // none). Returns the final norm of the residual stream, [B, hidden], what the model's
  // forward returns.
  at::Tensor run(const at::Tensor& x_in, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                 std::vector<int64_t> windows, const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                 const at::Tensor& context_lens) const {
    const size_t layers = k_caches.size();
    TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x must be contiguous [B, hidden]");
    TORCH_CHECK(windows.size() == layers && cos.size() == sin.size(), "decode_layers: one window per layer, cos and sin alike");
    for (int64_t r : rope_index) TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(cos.size()), "decode_layers: rope_index out of range");
    const int64_t batch = x_in.size(0);
    at::Tensor x = x_in, h, mlp;
    for (size_t i = 0; i < layers; ++i) {
      const at::Tensor* n = &norms[i * per_layer()];
      if (i == 0) {
        h = gemel::ops::rms_norm(x, n[0], eps);
      } else {
        std::optional<at::Tensor> post_ffn;
        if (gemma) post_ffn = norms[(i - 1) * per_layer() + 3];
        std::tie(x, h) = gemel::ops::add_rms_norm(x, mlp, n[0], eps, post_ffn);
      }
      const at::Tensor qkv = project(i, 0, h);
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
      std::tie(x, h) = gemel::ops::add_rms_norm(x, project(i, 1, attn), gemma ? n[2] : n[1], eps, post_attn);
      const at::Tensor gate_up = project(i, 2, h);
      mlp = gemma ? project(i, 3, gemel::ops::gelu_tanh_and_mul(gate_up)) : project(i, 3, gate_up, /*gated=*/true);
    }
    std::optional<at::Tensor> last_post_ffn;
    if (gemma) last_post_ffn = norms[(layers - 1) * per_layer() + 3];
    return std::get<1>(gemel::ops::add_rms_norm(x, mlp, final_norm, eps, last_post_ffn));
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double, bool>())
      .def("run", &DecodeLayers::run);
}
