// Greedy sampling's argmax of one row (argmax.cpp; int8_act_gemm.cpp's argmax over the LM
// head's outputs without writing them). Same answer as torch.argmax: the first index of the
// largest value, and the first NaN where a row has one (PyTorch ranks NaN above everything).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gemel {

// NaN tests on the bits: the kernels are built with -ffast-math, which lets the compiler
// assume that no float is NaN and fold std::isnan and unordered compares to false.
inline constexpr uint32_t kAbsMask = 0x7FFFFFFFu, kInfBits = 0x7F800000u;

inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & kAbsMask) > kInfBits;
}

inline int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(lowest, valid, x + i);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kAbsMask));
    nan |= _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(kInfBits));
    best = _mm512_max_ps(best, v);
  }
  if (nan == 0) {
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 valid = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(valid, _mm512_mask_loadu_ps(lowest, valid, x + i), peak, _CMP_EQ_OQ);
      if (hit != 0) return i + __builtin_ctz(hit);
    }
  }
#elif defined(__AVX2__)
  // The same two passes on 8 lanes over the whole vectors; the tail below joins the scalar loop.
  const int64_t whole = n - n % 8;
  if (whole > 0) {
    __m256 best = _mm256_loadu_ps(x);
    __m256i nan = _mm256_setzero_si256();
    const __m256i abs_mask = _mm256_set1_epi32(kAbsMask), inf = _mm256_set1_epi32(kInfBits);
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf));
      best = _mm256_max_ps(best, v);
    }
    if (_mm256_testz_si256(nan, nan)) {
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      float peak = _mm_cvtss_f32(m);
      int64_t tail_best = -1;
      for (int64_t i = whole; i < n; ++i) {
        if (is_nan(x[i])) return i;
        if (x[i] > peak) {
          peak = x[i];
          tail_best = i;
        }
      }
      if (tail_best >= 0) return tail_best;  // strictly larger than every whole vector's value
      const __m256 target = _mm256_set1_ps(peak);
      for (int64_t i = 0; i < whole; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hit != 0) return i + __builtin_ctz(hit);
      }
    }
  }
#endif
  int64_t index = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (is_nan(x[i])) return i;
    if (x[i] > x[index]) index = i;
  }
  return index;
}

}  // namespace gemel
