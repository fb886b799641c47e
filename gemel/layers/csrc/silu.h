// SiLU-and-multiply on 16 bf16 lanes with AVX-512, shared by fused_ops.cpp's silu_and_mul and
// int8_act_gemm.cpp's gated input, so the two give the same bits (a test checks that).
// Rounded where PyTorch rounds: F.silu's result to bf16, then the product to bf16.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMEL_SILU16 1

namespace gemel {

// Multiply, add and subtract as the compiler's opaque builtins: with -ffast-math it may
// reassociate the plain vector operators behind _mm512_mul_ps and friends differently in each
// function they are inlined into, and a 1-ulp change in the SiLU moves a product that lies
// near a bf16 rounding boundary to the next bf16 value; these keep every caller's bits equal.
inline __m512 mul16(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_CUR_DIRECTION); }
inline __m512 add16(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, _MM_FROUND_CUR_DIRECTION); }
inline __m512 sub16(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, _MM_FROUND_CUR_DIRECTION); }

// e^x for 16 float32 lanes, to about one unit in the last place: x = n ln2 + r with |r| <=
// ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by Cephes' degree-6 polynomial, then
// scaled by 2^n. The compiler's vectorised std::exp (libmvec) costs about twice as much.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(mul16(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = add16(_mm512_fmadd_ps(p, mul16(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// float32 rounded to bf16 (nearest even, as PyTorch rounds), in the top half of each lane.
inline __m512i round_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                          _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// Up to 16 bf16 values (lanes outside `m` zero) as float32.
inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, p)), 16));
}

// round_bf16(round_bf16(silu(g)) * u) as float32 lanes; the division by a reciprocal with one
// Newton step.
inline __m512 silu_and_mul16(__m512 g, __m512 u) {
  const __m512 den = add16(_mm512_set1_ps(1.f), exp16(sub16(_mm512_setzero_ps(), g)));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = mul16(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  const __m512 silu = _mm512_castsi512_ps(round_to_bf16_bits(mul16(g, inv)));
  return _mm512_castsi512_ps(round_to_bf16_bits(mul16(silu, u)));
}

// The lanes of the first `count` (at most 16) elements.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

}  // namespace gemel
#endif
