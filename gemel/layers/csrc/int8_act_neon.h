// int8_act_gemm's tiles for 64-bit ARM CPUs. The weight layout
// (gemel.layers.linear.pack_group_codes) is the dot-product instructions' shape: bytes 4i..4i+3
// of each 64-byte vector of a block's group are output row i's codes 4j..4j+3, so 16 bytes of a
// vector are four outputs' codes, and one step multiplies all four by four of x's codes.
//
// - With Armv8.2's dot products (DotProd: Neoverse N1 and later, Graviton 2-4, Ampere Altra,
//   Apple M1 and later, Cortex-A76 and later) a step is one `sdot` by lane j % 4 of x's 16
//   codes: 16 signed byte products, each four summed into a 32-bit lane.
// - Without them (Armv8.0: Cortex-A53/A72, the Raspberry Pi 4, Graviton 1) a step is two
//   widening multiplies (`smull`/`smlal`) of the four outputs' codes by x's four codes repeated,
//   one int16 product a lane, and pairwise adds widen those to one 32-bit sum an output. The
//   portable loops there multiply a code at a time; these tiles read the file's 4-bit codes
//   instead of float32 weights (an eighth of the bytes a decode step streams).
//
// Both give the integer sums of the portable loops (u times x, u the stored unsigned code), so
// only the float epilogue's order of additions differs. 4-, 5- and 6-bit codes are at most 63
// and fit a signed byte as they are; 8-bit codes go in as u - 128 (an exclusive-or) and get 128
// times the sum of x's codes back.
//
// Torch-free on purpose (the layout's constants are int8_act_layout.h's):
// tests/csrc/neon_tiles_check.cpp compiles this header for ARM, with and without dot products,
// and runs it under an emulator against the layout written out, since the test machines are x86.
#pragma once

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "int8_act_layout.h"

namespace gemel::neon {

using int8_act::kBlockRows;
using int8_act::kGroup;
using int8_act::kGroupCodeBytes;
using int8_act::kNibbleBlockBytes;
constexpr int kTileRows = 4;  // rows of x a tile multiplies at once

// Four scales or offsets (float32 or float16) as float32.
template <typename S>
inline float32x4_t load4(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return vld1q_f32(p);
  } else {
    const float v[4] = {static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                        static_cast<float>(p[3])};
    return vld1q_f32(v);
  }
}

// Sum of 16 signed bytes, times 128: what an 8-bit code's u - 128 takes off a dot product.
inline int32x4_t times128_sum(int8x16_t x) { return vdupq_n_s32(128 * static_cast<int32_t>(vaddlvq_s8(x))); }

#if defined(__ARM_FEATURE_DOTPROD)
// One output's sum of code times x a lane, for four outputs, over the steps of a group.
template <bool kNibbles>
struct FourSums {
  int32x4_t sums = vdupq_n_s32(0);
  template <int lane>
  void add(int8x16_t codes, int8x16_t x) { sums = vdotq_laneq_s32(sums, codes, x, lane); }
  int32x4_t total() const { return sums; }
};
#else
// The same sums without `sdot`: x's codes 4 lane .. 4 lane + 3 repeated across the vector, so
// that each widening multiply puts code times x in an int16 lane (outputs 0-1 in `first`, 2-3 in
// `second`, four lanes an output). 4- and 5-bit codes (at most 31, |x| at most 128) keep the four
// steps' products in int16 (at most 4 * 31 * 128) and widen once; 8-bit ones (u - 128) widen every
// step into pairs of int32, since two such products may already pass int16's range.
template <bool kNibbles>
struct FourSums;

template <int lane>
inline int8x16_t repeat_four(int8x16_t x) {
  return vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), lane));
}

template <>
struct FourSums<true> {
  int16x8_t first = vdupq_n_s16(0), second = vdupq_n_s16(0);
  template <int lane>
  void add(int8x16_t codes, int8x16_t x) {
    const int8x16_t xs = repeat_four<lane>(x);
    first = vmlal_s8(first, vget_low_s8(codes), vget_low_s8(xs));
    second = vmlal_high_s8(second, codes, xs);
  }
  int32x4_t total() const { return vpaddq_s32(vpaddlq_s16(first), vpaddlq_s16(second)); }
};

template <>
struct FourSums<false> {
  int32x4_t first = vdupq_n_s32(0), second = vdupq_n_s32(0);  // two partial sums an output
  template <int lane>
  void add(int8x16_t codes, int8x16_t x) {
    const int8x16_t xs = repeat_four<lane>(x);
    first = vpadalq_s16(first, vmull_s8(vget_low_s8(codes), vget_low_s8(xs)));
    second = vpadalq_s16(second, vmull_high_s8(codes, xs));
  }
  int32x4_t total() const { return vpaddq_s32(first, second); }
};
#endif

// Vector jj's and vector jj + 4's codes of one quarter (four outputs) of a block's group as
// signed bytes whose dot products are the codes' own (8-bit ones less 128). `wq` points at the
// group's codes plus 16 times the quarter.
template <int jj, bool kNibbles, bool kFive>
inline void quarter_codes(const uint8_t* wq, [[maybe_unused]] uint8x16_t fifth, int8x16_t& first, int8x16_t& second) {
  if constexpr (kNibbles) {
    const uint8x16_t both = vld1q_u8(wq + jj * 64);
    uint8x16_t low = vandq_u8(both, vdupq_n_u8(0x0F)), high = vshrq_n_u8(both, 4);
    if constexpr (kFive) {  // bit p of the plane's byte is vector p's fifth bit: move it to bit 4
      const uint8x16_t bit4 = vdupq_n_u8(0x10);
      low = vorrq_u8(low, vandq_u8(vshlq_n_u8(fifth, 4 - jj), bit4));
      if constexpr (jj == 0) {
        high = vorrq_u8(high, vandq_u8(fifth, bit4));
      } else {
        high = vorrq_u8(high, vandq_u8(vshrq_n_u8(fifth, jj), bit4));
      }
    }
    first = vreinterpretq_s8_u8(low);
    second = vreinterpretq_s8_u8(high);
  } else {
    const uint8x16_t flip = vdupq_n_u8(0x80);
    first = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wq + jj * 64), flip));
    second = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wq + (jj + 4) * 64), flip));
  }
}

// Outputs 16 b + 4 q .. + 3 of rows m0 .. m0 + R - 1, over every group. lo sums vectors 0-3
// (x's codes 0-15) and hi vectors 4-7 (codes 16-31): apart for scales per 16 codes, added
// otherwise. The arguments are those of int8_act_gemm's gemm_blocks.
template <int R, bool kNibbles, bool kIntZero, bool kSub16, bool kFive, typename S, typename T>
void quarter_tile(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
                  const uint8_t* w, const S* d, const S* low, T* y, int64_t m0, int64_t in_features,
                  int64_t out_features, int64_t b, int q) {
  const int64_t groups = in_features / kGroup;
  constexpr int64_t group_bytes = kGroupCodeBytes<kNibbles, kFive>;
  constexpr int64_t scales = (kSub16 ? 2 : 1) * kBlockRows;  // a block's scales per group
  float32x4_t total[R];
  for (int r = 0; r < R; ++r) total[r] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + (b * groups + g) * group_bytes;
    const uint8_t* wq = wg + 16 * q;
    int8x16_t x0[R], x1[R];
    FourSums<kNibbles> lo_sums[R], hi_sums[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = codes + (m0 + r) * in_features + g * kGroup;
      x0[r] = vld1q_s8(xr);
      x1[r] = vld1q_s8(xr + 16);
    }
    uint8x16_t fifth = vdupq_n_u8(0);
    if constexpr (kFive) fifth = vld1q_u8(wg + kNibbleBlockBytes + 16 * q);
    const auto step = [&](auto jj_tag) {
      constexpr int jj = decltype(jj_tag)::value;
      int8x16_t first, second;
      quarter_codes<jj, kNibbles, kFive>(wq, fifth, first, second);
      for (int r = 0; r < R; ++r) {
        lo_sums[r].template add<jj>(first, x0[r]);
        hi_sums[r].template add<jj>(second, x1[r]);
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    const int64_t at = (b * groups + g) * scales + 4 * q;
    for (int r = 0; r < R; ++r) {
      const int64_t mg = (m0 + r) * groups + g;
      int32x4_t lo = lo_sums[r].total(), hi = hi_sums[r].total();
      if constexpr (!kNibbles) {
        lo = vaddq_s32(lo, times128_sum(x0[r]));
        hi = vaddq_s32(hi, times128_sum(x1[r]));
      }
      const float32x4_t x_unit = vdupq_n_f32(unit[mg]);
      if constexpr (kSub16) {
        const float32x4_t first = vcvtq_f32_s32(vsubq_s32(lo, vdupq_n_s32(zero_sum[2 * mg])));
        const float32x4_t second = vcvtq_f32_s32(vsubq_s32(hi, vdupq_n_s32(zero_sum[2 * mg + 1])));
        total[r] = vfmaq_f32(total[r], vmulq_f32(first, load4(d + at)), x_unit);
        total[r] = vfmaq_f32(total[r], vmulq_f32(second, load4(d + at + kBlockRows)), x_unit);
      } else {
        int32x4_t dot = vaddq_s32(lo, hi);
        if constexpr (kIntZero) dot = vsubq_s32(dot, vdupq_n_s32(zero_sum[mg]));
        total[r] = vfmaq_f32(total[r], vmulq_f32(vcvtq_f32_s32(dot), load4(d + at)), x_unit);
        if constexpr (!kIntZero) total[r] = vfmaq_f32(total[r], load4(low + at), vdupq_n_f32(code_sum[mg]));
      }
    }
  }
  const int64_t first = b * kBlockRows + 4 * q, count = std::min<int64_t>(4, out_features - first);
  for (int r = 0; r < R; ++r) {
    float values[4];
    vst1q_f32(values, total[r]);
    for (int64_t c = 0; c < count; ++c) y[(m0 + r) * out_features + first + c] = static_cast<T>(values[c]);
  }
}

// Blocks [b0, b1) of the output for all rows (int8_act_gemm's gemm_blocks). A block's codes
// (at most 16 KB for 2,048 inputs) stay in L1 while its four quarters and every tile of rows
// read them.
template <bool kNibbles, bool kIntZero, bool kSub16, bool kFive, typename S, typename T>
void gemm_blocks(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
                 const uint8_t* w, const S* d, const S* low, T* y, int64_t rows, int64_t in_features,
                 int64_t out_features, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int quarters = static_cast<int>(std::min<int64_t>(4, (out_features - b * kBlockRows + 3) / 4));
    for (int64_t m0 = 0; m0 < rows; m0 += kTileRows) {
      for (int q = 0; q < quarters; ++q) {
        switch (std::min<int64_t>(kTileRows, rows - m0)) {
          case 4:
            quarter_tile<4, kNibbles, kIntZero, kSub16, kFive>(codes, unit, code_sum, zero_sum, w, d, low, y, m0,
                                                               in_features, out_features, b, q);
            break;
          case 3:
            quarter_tile<3, kNibbles, kIntZero, kSub16, kFive>(codes, unit, code_sum, zero_sum, w, d, low, y, m0,
                                                               in_features, out_features, b, q);
            break;
          case 2:
            quarter_tile<2, kNibbles, kIntZero, kSub16, kFive>(codes, unit, code_sum, zero_sum, w, d, low, y, m0,
                                                               in_features, out_features, b, q);
            break;
          default:
            quarter_tile<1, kNibbles, kIntZero, kSub16, kFive>(codes, unit, code_sum, zero_sum, w, d, low, y, m0,
                                                               in_features, out_features, b, q);
        }
      }
    }
  }
}

}  // namespace gemel::neon
