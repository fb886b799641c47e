// y = x W^T for a weight stored as the checkpoint's own int8 groups (GGUF Q8_0: 32 weights
// along the input dimension share one scale), for the few rows of a small decode step.
//
// At one row a projection is bound by reading its weight: int8 is half the bytes of bf16,
// and the groups are the file's exact weights. Each int8 group is widened to float once and
// used for every row of x; rows of the weight are split over PyTorch's thread pool.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;
// Weight rows ahead of the one being read that its thread asks for (rows are read in order;
// the hardware prefetcher alone left the LM head at ~8.5 GB/s of the two cores' 11-12).
constexpr int64_t kPrefetchRows = 4;

void int8_group_rows(const float* x, const int8_t* q, const float* scales, float* y, int64_t rows,
                     int64_t in_features, int64_t out_features, int64_t n0, int64_t n1) {
  const int64_t groups = in_features / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = q + n * in_features;
    const float* srow = scales + n * groups;
#if defined(__AVX512F__)
    const char* next_w = reinterpret_cast<const char*>(wrow + kPrefetchRows * in_features);
    const char* next_s = reinterpret_cast<const char*>(srow + kPrefetchRows * groups);
    for (int64_t line = 0; line < in_features; line += 64) _mm_prefetch(next_w + line, _MM_HINT_T0);
    for (int64_t line = 0; line < groups * 4; line += 64) _mm_prefetch(next_s + line, _MM_HINT_T0);
    __m512 total[kMaxRows];
    for (int64_t m = 0; m < rows; ++m) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const auto* w = reinterpret_cast<const __m128i*>(wrow + g * kGroup);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w + 1)));
      const __m512 scale = _mm512_set1_ps(srow[g]);
      for (int64_t m = 0; m < rows; ++m) {
        const float* xg = x + m * in_features + g * kGroup;
        const __m512 part = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16), hi, _mm512_mul_ps(_mm512_loadu_ps(xg), lo));
        total[m] = _mm512_fmadd_ps(scale, part, total[m]);
      }
    }
    for (int64_t m = 0; m < rows; ++m) y[m * out_features + n] = _mm512_reduce_add_ps(total[m]);
#else
    for (int64_t m = 0; m < rows; ++m) {
      const float* xr = x + m * in_features;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float part = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) part += xr[g * kGroup + j] * static_cast<float>(wrow[g * kGroup + j]);
        total += part * srow[g];
      }
      y[m * out_features + n] = total;
    }
#endif
  }
}

// x: [M, K] (M <= 8), q: [N, K] int8, scales: [N, K / 32] float32. Returns [M, N] in x's dtype.
at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "x [M,K], q [N,K], scales [N,K/32]");
  TORCH_CHECK(q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "q int8, scales float32");
  TORCH_CHECK(x.size(1) == q.size(1) && q.size(1) % kGroup == 0, "K must match and be a multiple of 32");
  TORCH_CHECK(scales.size(0) == q.size(0) && scales.size(1) == q.size(1) / kGroup, "one scale per group");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most 8 rows");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous(), "q and scales must be contiguous");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0), in_features = xf.size(1), out_features = q.size(0);
  auto y = at::empty({rows, out_features}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out_features, 256, [&](int64_t n0, int64_t n1) {
    int8_group_rows(xp, qp, sp, yp, rows, in_features, out_features, n0, n1);
  });
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) { m.def("int8_group_mm(Tensor x, Tensor q, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(gemel, CPU, m) { m.impl("int8_group_mm", &int8_group_mm); }
