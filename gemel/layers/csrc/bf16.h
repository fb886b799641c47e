// float32 <-> T conversions for the fused element-wise kernels, written so that loops over
// them vectorise (c10's do not), with PyTorch's rounding: every PyTorch op on bf16 computes
// in float32 and rounds its result to bf16, and the fused kernels round at the same points.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace gemel {

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_f<at::BFloat16>(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_f(float f) {
  return static_cast<T>(f);
}
template <>
inline at::BFloat16 from_f<at::BFloat16>(float f) {
  // Round to nearest even, as PyTorch does; NaN stays NaN (tested on the bits: the build
  // uses -ffast-math, under which f != f may be folded away).
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  at::BFloat16 out;
  out.x = static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  return out;
}

// Value as stored in T (the rounding a PyTorch op with a T result applies).
template <typename T>
inline float round_as(float f) {
  return to_f<T>(from_f<T>(f));
}

}  // namespace gemel
