// Fused element-wise ops of the eager CPU step: RMSNorm, SiLU-and-multiply, rotary embedding.
//
// In PyTorch each of these is 3-10 separate kernels, each a pass over memory and (at decode
// sizes) a few microseconds of dispatch: ~45 small ops per layer at batch 32. Here each is
// one pass. They round at the same points as the PyTorch code they replace (every PyTorch
// op on bf16 computes in float32 and rounds its result to bf16), so results agree with it
// up to the order of the RMSNorm sum.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "ops.h"
#include "silu.h"

#include <cmath>
#include <optional>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using gemel::from_f;
using gemel::round_as;
using gemel::to_f;

// Rows of at least this many elements per task before the work is split across threads.
constexpr int64_t kGrainElements = 32768;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

// 1 / sqrt(mean of the squares + eps), in double: -ffast-math would otherwise turn 1/sqrtf
// into an approximate rsqrt.
inline float inverse_rms_of(float squares, int64_t n, float eps) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(squares / static_cast<float>(n) + eps)));
}

// The same for the n values at x (read as float32).
template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f<T>(x[i]);
    squares += v * v;
  }
  return inverse_rms_of(squares, n, eps);
}

// Llama order: normalise in float32, round to T, then multiply by the T weight (rounding
// again), as layers/layernorm.py's rms_norm_llama does.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t dim, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * dim;
      const float inv = inverse_rms(xr, dim, eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = from_f<T>(to_f<T>(weight[i]) * round_as<T>(to_f<T>(xr[i]) * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, dim] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "rms_norm: weight must be [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight must have the dtype of x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// The residual add and the next RMSNorm in one pass (vLLM's fused_add_rms_norm): sum = x +
// delta, rounded to T as PyTorch's add is, then rms_norm_llama(sum). Saves a small op and a
// pass over the residual stream twice a layer. With delta_weight (float32 only: Gemma 3,
// whose attention and MLP outputs are normed before they join the residual stream), delta
// is first RMS-normed and scaled by it: sum = x + norm(delta) * delta_weight.
template <typename T>
void add_rms_norm_rows(const T* x, const T* delta, const T* weight, const T* delta_weight, T* sum, T* out,
                       int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *xr = x + r * dim, *dr = delta + r * dim;
      T* s = sum + r * dim;
      T* o = out + r * dim;
      float squares = 0.f;
      // Two loops rather than one with the choice inside it: GCC does not vectorise that one.
      if (delta_weight != nullptr) {
        const float delta_inv = inverse_rms(dr, dim, eps);
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; ++i) {
          const float v = round_as<T>(to_f<T>(xr[i]) + to_f<T>(dr[i]) * delta_inv * to_f<T>(delta_weight[i]));
          s[i] = from_f<T>(v);
          squares += v * v;
        }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; ++i) {
          const float v = round_as<T>(to_f<T>(xr[i]) + to_f<T>(dr[i]));
          s[i] = from_f<T>(v);
          squares += v * v;
        }
      }
      const float inv = inverse_rms_of(squares, dim, eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = from_f<T>(to_f<T>(weight[i]) * round_as<T>(to_f<T>(s[i]) * inv));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps, const std::optional<at::Tensor>& delta_weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous(),
              "add_rms_norm: x and delta must be contiguous [rows, dim] of one shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "add_rms_norm: weight must be [dim]");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, delta and weight must share a dtype");
  const bool norm_delta = delta_weight.has_value() && delta_weight->defined();
  if (norm_delta) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && delta_weight->scalar_type() == at::kFloat,
                "add_rms_norm: delta_weight needs float32 x (the rounding orders of the norms differ in other dtypes)");
    TORCH_CHECK(delta_weight->dim() == 1 && delta_weight->size(0) == x.size(1) && delta_weight->is_contiguous(),
                "add_rms_norm: delta_weight must be [dim]");
  }
  auto sum = at::empty_like(x), out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                norm_delta ? delta_weight->data_ptr<scalar_t>() : nullptr, sum.data_ptr<scalar_t>(),
                                out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {sum, out};
}

// out = silu(gate) * up for x = [gate | up], with F.silu's result rounded to T first.
template <typename T>
void silu_and_mul_rows(const T* in, T* out, int64_t rows, int64_t dim, int64_t stride) {
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + dim;
      T* o = out + r * dim;
#if defined(GEMEL_SILU16)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (int64_t i = 0; i < dim; i += 16) {
          const __mmask16 m = gemel::first_lanes(dim - i);
          const __m512 product = gemel::silu_and_mul16(gemel::load_bf16x16(gate + i, m), gemel::load_bf16x16(up + i, m));
          _mm256_mask_storeu_epi16(o + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(product), 16)));
        }
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float g = to_f<T>(gate[i]);
        o[i] = from_f<T>(round_as<T>(g / (1.f + std::exp(-g))) * to_f<T>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [rows, 2 * dim]");
  const int64_t rows = x.size(0), dim = x.size(1) / 2;
  auto out = at::empty({rows, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim, x.stride(0));
  });
  return out;
}

// out = gelu_tanh(gate) * up for x = [gate | up] in float32 (Gemma's GeGLU), in the order of
// PyTorch's F.gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
void gelu_tanh_and_mul_rows(const float* in, float* out, int64_t rows, int64_t dim, int64_t stride) {
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + dim;
      float* o = out + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float g = gate[i];
        const float inner = kBeta * (g + kKappa * g * g * g);
        o[i] = 0.5f * g * (1.f + std::tanh(inner)) * up[i];
      }
    }
  });
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "gelu_tanh_and_mul: x must be [rows, 2 * dim]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gelu_tanh_and_mul: x must be float32");
  const int64_t rows = x.size(0), dim = x.size(1) / 2;
  auto out = at::empty({rows, dim}, x.options());
  gelu_tanh_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, dim, x.stride(0));
  return out;
}

// One head's half-rotation rotary embedding: o = x * cos + cat(-x2, x1) * sin, each product
// and the sum rounded to T as in the PyTorch version. O is T, or float holding T's values.
template <typename T, typename O>
inline void rotate_head(const T* x, const T* c, const T* s, int64_t half, O* o) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f<T>(x[i]), x2 = to_f<T>(x[i + half]);
    const float lo = round_as<T>(x1 * to_f<T>(c[i])) + round_as<T>(-x2 * to_f<T>(s[i]));
    const float hi = round_as<T>(x2 * to_f<T>(c[i + half])) + round_as<T>(x1 * to_f<T>(s[i + half]));
    if constexpr (std::is_same_v<O, float>) {
      o[i] = round_as<T>(lo), o[i + half] = round_as<T>(hi);
    } else {
      o[i] = from_f<T>(lo), o[i + half] = from_f<T>(hi);
    }
  }
}

// One row of an int8 KV cache (layers/kv_cache.py): codes round(x / scale) with
// scale = max|x| / 127, then the float32 scale's 4 bytes.
inline void quantize_kv_row(const float* x, int64_t n, int8_t* row) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  const float inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < n; ++i) row[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
  std::memcpy(row + n, &scale, sizeof(scale));
}

// The rotary embedding of q and k, read from the fused qkv projection's rows (cos/sin: the
// [tokens, head_dim] tables of the step, both halves equal). q goes to q_out [tokens,
// num_heads, head_dim]. k goes to k_out [tokens, num_kv_heads, head_dim], or, with slots,
// straight into the KV cache (C = T: [num_kv_heads, num_slots, head_dim]; C = int8_t: rows of
// head_dim + 4; C = Half under float32 T: float16 rows, rounded to nearest even) at each
// token's slot, and then v is stored into v_cache there too.
//
// q_norm / k_norm (float32 only; Gemma 3's QK-norm): each q and k head is first RMS-normed
// over head_dim and scaled by them, as rms_norm_gemma does in float32.
template <typename T, typename C = T>
void rotary_rows(const T* in, const T* cos, const T* sin, T* q_out, C* k_out, C* v_cache, const int64_t* slots,
                 int64_t num_slots, int64_t tokens, int64_t stride, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, const T* q_norm = nullptr, const T* k_norm = nullptr, float norm_eps = 0.f) {
  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
  const int64_t half = head_dim / 2, heads = num_heads + num_kv_heads;
  const int64_t row = kInt8Cache ? head_dim + 4 : head_dim;
  if (slots != nullptr) {
    // The cache rows written here lie anywhere in the cache and are rarely in any cache level:
    // asked for all at once first, their misses overlap instead of stalling one store at a time.
    const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_out + (h * num_slots + slots[t]) * row) + b, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + (h * num_slots + slots[t]) * row) + b, 1);
        }
  }
  at::parallel_for(0, tokens, grain_rows(heads * head_dim), [&](int64_t t0, int64_t t1) {
    std::vector<float> values(kInt8Cache ? head_dim : 0);
    std::vector<T> normed(q_norm != nullptr || k_norm != nullptr ? head_dim : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = in + t * stride + h * head_dim;
        const int64_t kv_head = h - num_heads;
        if constexpr (std::is_same_v<T, float>) {
          const float* norm = h < num_heads ? q_norm : k_norm;
          if (norm != nullptr) {
            const float inv = inverse_rms(x, head_dim, norm_eps);
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) normed[i] = x[i] * inv * norm[i];
            x = normed.data();
          }
        }
        if (h < num_heads) {
          rotate_head(x, c, s, half, q_out + (t * num_heads + h) * head_dim);
        } else if (slots == nullptr) {
          if constexpr (!kInt8Cache) rotate_head(x, c, s, half, k_out + (t * num_kv_heads + kv_head) * head_dim);
        } else if constexpr (kInt8Cache) {
          rotate_head(x, c, s, half, values.data());
          quantize_kv_row(values.data(), head_dim, k_out + (kv_head * num_slots + slots[t]) * row);
        } else {
          rotate_head(x, c, s, half, k_out + (kv_head * num_slots + slots[t]) * row);
        }
      }
      if (slots == nullptr) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* v = in + t * stride + (heads + h) * head_dim;
        C* dst = v_cache + (h * num_slots + slots[t]) * row;
        if constexpr (kInt8Cache) {
          for (int64_t i = 0; i < head_dim; ++i) values[i] = to_f<T>(v[i]);
          quantize_kv_row(values.data(), head_dim, dst);
        } else if constexpr (std::is_same_v<C, T>) {
          std::memcpy(dst, v, head_dim * sizeof(T));
        } else {
          for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<C>(to_f<T>(v[i]));
        }
      }
    }
  });
}

at::Tensor rotary_tables(const at::Tensor& table, const at::Tensor& qkv, int64_t head_dim) {
  auto t = table.reshape({qkv.size(0), head_dim}).contiguous();
  TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "rotary: cos/sin must have the dtype of qkv");
  return t;
}

void check_qkv(const at::Tensor& qkv, int64_t width, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary: qkv must be [tokens, width] with contiguous rows");
  TORCH_CHECK(qkv.size(1) >= width && head_dim % 2 == 0, "rotary: qkv too narrow or odd head size");
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_qkv(qkv, (num_heads + num_kv_heads) * head_dim, head_dim);
  const int64_t tokens = qkv.size(0);
  const auto c = rotary_tables(cos, qkv, head_dim), s = rotary_tables(sin, qkv, head_dim);
  auto q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  auto k = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk", [&] {
    rotary_rows<scalar_t, scalar_t>(qkv.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                                    q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), nullptr, nullptr, 0, tokens,
                                    qkv.stride(0), num_heads, num_kv_heads, head_dim);
  });
  return {q, k};
}

// rotary_qk, with k and v written into the KV cache at slot_mapping instead of returned
// (what paged_attention's two index_copy_ calls would do): returns q.
// q_norm, k_norm: [head_dim] float32 weights of a per-head RMSNorm applied to q and k before
// the rotation (Gemma 3's QK-norm), float32 qkv only.
at::Tensor rotary_q_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                             const std::optional<at::Tensor>& k_norm, double norm_eps) {
  check_qkv(qkv, (num_heads + 2 * num_kv_heads) * head_dim, head_dim);
  const int64_t tokens = qkv.size(0);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const bool half_cache = k_cache.scalar_type() == at::kHalf && qkv.scalar_type() == at::kFloat;
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == num_kv_heads &&
                  k_cache.size(2) == (int8_cache ? head_dim + 4 : head_dim) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "rotary_q_store_kv: caches must be contiguous [num_kv_heads, slots, head_dim] (int8: head_dim + 4)");
  TORCH_CHECK((int8_cache || half_cache || k_cache.scalar_type() == qkv.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "rotary_q_store_kv: caches must have the dtype of qkv, be int8, or be float16 under float32 qkv");
  const auto slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "rotary_q_store_kv: one int64 slot per token");
  const int64_t num_slots = k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_q_store_kv: slot out of range");
  const bool qk_norm = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(qk_norm == (k_norm.has_value() && k_norm->defined()), "rotary_q_store_kv: q_norm and k_norm go together");
  if (qk_norm) {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "rotary_q_store_kv: q_norm and k_norm need float32 qkv");
    for (const auto* w : {&*q_norm, &*k_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->dim() == 1 && w->size(0) == head_dim && w->is_contiguous(),
                  "rotary_q_store_kv: q_norm and k_norm must be float32 [head_dim]");
  }
  const float* qn = qk_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = qk_norm ? k_norm->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(norm_eps);
  const auto c = rotary_tables(cos, qkv, head_dim), s = rotary_tables(sin, qkv, head_dim);
  auto q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_q_store_kv", [&] {
    // the norms' weights as scalar_t pointers: non-null only where scalar_t is float (checked above)
    const scalar_t* qn_t = reinterpret_cast<const scalar_t*>(qn);
    const scalar_t* kn_t = reinterpret_cast<const scalar_t*>(kn);
    if (int8_cache) {
      rotary_rows<scalar_t, int8_t>(qkv.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                                    q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                    slot, num_slots, tokens, qkv.stride(0), num_heads, num_kv_heads, head_dim, qn_t,
                                    kn_t, eps);
    } else if (half_cache) {
      if constexpr (std::is_same_v<scalar_t, float>)
        rotary_rows<float, at::Half>(qkv.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), q.data_ptr<float>(),
                                     k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), slot, num_slots, tokens,
                                     qkv.stride(0), num_heads, num_kv_heads, head_dim, qn, kn, eps);
    } else {
      rotary_rows<scalar_t>(qkv.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                            q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), slot,
                            num_slots, tokens, qkv.stride(0), num_heads, num_kv_heads, head_dim, qn_t, kn_t, eps);
    }
  });
  return q;
}

}  // namespace

at::Tensor gemel::ops::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> gemel::ops::add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                            const at::Tensor& weight, double eps,
                                                            const std::optional<at::Tensor>& delta_weight) {
  return ::add_rms_norm(x, delta, weight, eps, delta_weight);
}

at::Tensor gemel::ops::gelu_tanh_and_mul(const at::Tensor& x) { return ::gelu_tanh_and_mul(x); }

at::Tensor gemel::ops::rotary_q_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                         at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                         const std::optional<at::Tensor>& q_norm,
                                         const std::optional<at::Tensor>& k_norm, double norm_eps) {
  return ::rotary_q_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm,
                             k_norm, norm_eps);
}

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, Tensor? delta_weight=None) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim) -> (Tensor, Tensor)");
  m.def("rotary_q_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float norm_eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rotary_qk", &rotary_qk);
  m.impl("rotary_q_store_kv", &rotary_q_store_kv);
}
