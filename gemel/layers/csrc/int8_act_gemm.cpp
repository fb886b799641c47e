// y = x W^T for many rows of x (large decode batches, prefill), on a weight stored as groups
// of 32 along the input dimension with one scale and one offset each (w = d * u + low,
// u in 0..255: GGUF Q4_0/Q4_1 with u = q, Q8_0 with u = q + 128), with integer dot products
// (AVX512-VNNI).
//
// This is llama.cpp's own arithmetic for such weights: x is rounded to int8 per group of 32
// (unit max|x|/127), the 32 products of a group are integer (vpdpbusd: 64 unsigned-by-signed
// byte products per instruction, twice bf16's vdpbf16ps) and each group's sum is scaled once.
// The weights are the file's exact values; only x is rounded. Where a CPU has AMX, bf16
// GEMMs are faster still, and the caller keeps them.
//
// Weight layout (gemel.layers.linear.pack_group_codes): output rows in blocks of 16 (the last
// zero-padded); per block and group 8 vectors of 64 bytes, where bytes 4i..4i+3 of vector j
// hold row i's codes 4j..4j+3, so each 32-bit lane of a dot product is one output row. The
// scales and offsets are separate float32 tensors [blocks, groups, 16].
//
// 4-bit codes (Q4_0, Q4_1) are stored two to a byte: vector j < 4 of a block's group in the
// low nibbles, vector j + 4 in the high ones (256 bytes per block and group). A decode step
// streams every weight from memory, so half the bytes matter more than the two extra
// instructions per vector that unpack them.
//
// 5-bit codes (GGUF Q5_0) are stored as those nibbles plus a plane of their fifth bits: 64 more
// bytes per block and group, where bit p of byte i is the fifth bit of vector p's byte i (320
// bytes against the 512 of 8-bit codes).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops.h"

#include "argmax.h"
#include "bf16.h"
#include "int8_act_layout.h"
#include "silu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GEMEL_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GEMEL_AVX2 1
#if defined(__AVXVNNI__)
#define GEMEL_AVX_VNNI 1  // 256-bit vpdpbusd without AVX-512 (Intel Alder Lake and later, Sierra Forest)
#endif
#elif defined(__aarch64__)
#include "int8_act_neon.h"
#define GEMEL_NEON 1  // 64-bit ARM: gemel::neon's tiles (sdot where the build has dot products)
#endif

namespace {

// Which codes the AVX2 and AVX-512 (VNNI) tiles ask for ahead of use in calls of one or two rows
// (a decode step's, which stream their weights from memory): kStreamBytes, 8-bit codes and Q6_K's
// 6-bit ones; kStreamNibbles, 4- and 5-bit codes. Whether asking pays depends on the CPU's own
// prefetchers (see kPrefetchAhead), so the engine times both ways on its model at start-up
// (gemel/layers/stream_prefetch.py) and sets this once, before it serves. The portable build
// never asks; the results are the same either way, bit for bit.
constexpr int64_t kStreamBytes = 1, kStreamNibbles = 2;
std::atomic<int64_t> stream_prefetch_kinds{kStreamBytes | kStreamNibbles};

// Sets the kinds (a mask of kStreamBytes and kStreamNibbles) and returns the previous ones;
// -1 only reads them.
int64_t set_stream_prefetch(int64_t kinds) {
  TORCH_CHECK(kinds >= -1 && kinds <= (kStreamBytes | kStreamNibbles),
              "set_stream_prefetch: kinds is -1 (read only) or a mask of 1 (8-bit and 6-bit codes) and 2 (4- and 5-bit)");
  return kinds < 0 ? stream_prefetch_kinds.load() : stream_prefetch_kinds.exchange(kinds);
}

using gemel::int8_act::kBlockBytes;
using gemel::int8_act::kBlockRows;
using gemel::int8_act::kFiveBlockBytes;
using gemel::int8_act::kGroup;
using gemel::int8_act::kGroupCodeBytes;
using gemel::int8_act::kNibbleBlockBytes;
constexpr int64_t kTileRows = 4;                     // rows of x per register tile
constexpr int64_t kTileBlocks = 3;                   // blocks of 16 outputs per register tile
static_assert(kTileRows == 4, "tile_rows handles the last 1-3 rows of x case by case");

// A row's inputs as float32: x itself, or for a gated MLP's down projection (`up` given)
// silu(x) * up, rounded as the silu_and_mul op rounds it (the SiLU to T, then the product to
// T). Fusing it here saves that op and a pass over its output. Vectorised (exp by libmvec).
template <typename T>
void input_row(const T* x, const T* up, int64_t in_features, float* out) {
  if (up == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < in_features; ++i) out[i] = gemel::to_f<T>(x[i]);
    return;
  }
#if defined(GEMEL_SILU16)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // the silu_and_mul op's own arithmetic
    for (int64_t i = 0; i < in_features; i += 16) {
      const __mmask16 m = gemel::first_lanes(in_features - i);
      _mm512_mask_storeu_ps(out + i, m, gemel::silu_and_mul16(gemel::load_bf16x16(x + i, m), gemel::load_bf16x16(up + i, m)));
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < in_features; ++i) {
    const float g = gemel::to_f<T>(x[i]);
    out[i] = gemel::round_as<T>(gemel::round_as<T>(g / (1.f + std::exp(-g))) * gemel::to_f<T>(up[i]));
  }
}

// One row of inputs [K] -> int8 codes per group of 32 (unit max|x|/127, rounded to nearest
// even), each group's unit, and unit * (sum of the codes): the group's sum as the codes carry
// it, which multiplies `low`. With an integer zero point z (low = -z d), zero_sum gets z *
// (sum of the codes) as well, or with `halves` (a scale per 16 codes) z * the sum of each 16.
void quantize_row(const float* x, int64_t in_features, int8_t* codes, float* unit, float* code_sum,
                  int32_t zero_point, int32_t* zero_sum, bool halves) {
  for (int64_t g = 0; g < in_features / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    int8_t* cg = codes + g * kGroup;
    int32_t total = 0, first_half = 0;
    float amax = 0.f;
#if defined(GEMEL_VNNI)
    const __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i code_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));  // round to nearest even
    const __m512i code_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cg), _mm512_cvtepi32_epi8(code_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cg + 16), _mm512_cvtepi32_epi8(code_hi));
    first_half = _mm512_reduce_add_epi32(code_lo);
    total = first_half + _mm512_reduce_add_epi32(code_hi);
#elif defined(GEMEL_AVX2)
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xg + 8 * k);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    amax = _mm_cvtss_f32(m4);
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i c[4];
    for (int k = 0; k < 4; ++k) c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));  // nearest even
    const auto hsum = [](__m256i v) {
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      return _mm_cvtsi128_si32(s4);
    };
    first_half = hsum(_mm256_add_epi32(c[0], c[1]));
    total = first_half + hsum(_mm256_add_epi32(c[2], c[3]));
    // int32 -> int8 with the order kept: packs interleave 128-bit lanes, the permute undoes it.
    const __m256i words = _mm256_packs_epi32(c[0], c[1]), words2 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cg), bytes);
#else
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t j = 0; j < kGroup; ++j) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(xg[j] * inverse));
      cg[j] = static_cast<int8_t>(code);
      total += code;
      if (j < kGroup / 2) first_half += code;
    }
#endif
    unit[g] = amax / 127.f;
    code_sum[g] = unit[g] * static_cast<float>(total);
    if (zero_sum != nullptr && halves) {
      zero_sum[2 * g] = zero_point * first_half;
      zero_sum[2 * g + 1] = zero_point * (total - first_half);
    } else if (zero_sum != nullptr) {
      zero_sum[g] = zero_point * total;
    }
  }
}

template <typename T>
inline void store_row(T* y, const float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = static_cast<T>(values[i]);
}

#if defined(GEMEL_VNNI)
// 16 scales or offsets, stored as float32 or float16.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// kRows rows of x against kBlocks blocks of 16 outputs, over all groups. kIntZero: the weights
// are w = d * (u - z) with an integer z (Q8_0: 128, Q4_0: 8), and z * sum(x codes) comes off
// the integer dot product itself, one floating-point op less per group than `low`'s FMA.
// kSub16 (8-bit codes, kIntZero): a scale per 16 codes (GGUF Q6_K), d [blocks, groups, 2, 16]
// and zero_sum per 16 codes: each half of a group is summed and scaled on its own.
//
// ask_ahead (a tile of 1-2 rows: a decode step's, which streams its weights from memory): each
// group asks for the same group of the next tile's blocks into L2, so the next tile's codes
// arrive while this one computes. Set by the engine from timings like the AVX2 tiles' (see
// stream_prefetch_kinds); the results are the same either way, bit for bit.
// wb: the codes of output block `block` on (the packed weight's, or 5-bit codes unpacked to
// bytes by unpack_five_blocks). kFive (with kNibbles and kIntZero, tiles of 1-2 rows): 5-bit
// codes, each vector's fifth bits ORed onto its nibbles as the AVX2 tiles do; two ternary-logic
// ops and two shifts a block and step more than 4-bit codes, where a call of one row waits on
// memory anyway, and 62.5% of 8-bit codes' bytes.
template <int kRows, int kBlocks, bool kNibbles, bool kIntZero, bool kSub16, bool kFive, typename S, typename T>
void tile(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum, const uint8_t* wb,
          const S* d, const S* low, T* y, int64_t in_features, int64_t out_features, int64_t block, bool ask_ahead) {
  static_assert(!kSub16 || (kIntZero && !kNibbles), "scales per 16 codes come with 8-bit codes and a zero point");
  static_assert(!kFive || (kNibbles && kIntZero && kRows <= 2), "5-bit codes: nibbles, a zero point, 1-2 rows");
  constexpr int kHalves = kSub16 ? 2 : 1;
  constexpr int kSteps = (kNibbles ? kGroup / 8 : kGroup / 4) / kHalves;  // steps of 4 codes (a lane) per scale
  constexpr int64_t kGroupBytes = kGroupCodeBytes<kNibbles, kFive>;
  const int64_t groups = in_features / kGroup;
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kBlocks; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (kRows <= 2 && ask_ahead) {
      for (int c = 0; c < kBlocks; ++c) {
        const uint8_t* next = wb + ((kBlocks + c) * groups + g) * kGroupBytes;
        for (int64_t line = 0; line < kGroupBytes / 64; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
      }
    }
    // 5-bit codes: vector j's fifth bit is bit j of its plane byte, vector j + 4's bit j + 4; each
    // step shifts both planes right by one (in 16-bit lanes: bit 4 of either byte comes from
    // the same byte).
    [[maybe_unused]] __m512i fifth_lo[kFive ? kBlocks : 1], fifth_hi[kFive ? kBlocks : 1];
    if constexpr (kFive) {
      for (int c = 0; c < kBlocks; ++c) {
        fifth_hi[c] = _mm512_loadu_si512(wb + (c * groups + g) * kGroupBytes + kNibbleBlockBytes);
        fifth_lo[c] = _mm512_slli_epi16(fifth_hi[c], 4);
      }
    }
    for (int h = 0; h < kHalves; ++h) {
      __m512i dot[kRows][kBlocks];
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < kBlocks; ++c) dot[r][c] = _mm512_setzero_si512();
      for (int j = h * kSteps; j < (h + 1) * kSteps; ++j) {
        __m512i wv[kBlocks], wh[kBlocks];
        for (int c = 0; c < kBlocks; ++c) {
          const __m512i v = _mm512_loadu_si512(wb + (c * groups + g) * kGroupBytes + j * 64);
          if constexpr (kNibbles) {
            const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
            wv[c] = _mm512_and_si512(v, low_nibbles);
            wh[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
          } else {
            wv[c] = v;
          }
          if constexpr (kFive) {  // a | (b & c): the nibbles with each byte's bit 4 from the plane
            const __m512i bit4 = _mm512_set1_epi8(0x10);
            wv[c] = _mm512_ternarylogic_epi32(wv[c], fifth_lo[c], bit4, 0xF8);
            wh[c] = _mm512_ternarylogic_epi32(wh[c], fifth_hi[c], bit4, 0xF8);
            fifth_lo[c] = _mm512_srli_epi16(fifth_lo[c], 1);
            fifth_hi[c] = _mm512_srli_epi16(fifth_hi[c], 1);
          }
        }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* xr = codes + r * in_features + g * kGroup;
          int32_t four;
          std::memcpy(&four, xr + j * 4, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          for (int c = 0; c < kBlocks; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wv[c], xv);
          if constexpr (kNibbles) {
            std::memcpy(&four, xr + (j + 4) * 4, 4);
            const __m512i xh = _mm512_set1_epi32(four);
            for (int c = 0; c < kBlocks; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wh[c], xh);
          }
        }
      }
      for (int c = 0; c < kBlocks; ++c) {
        const int64_t at = ((block + c) * groups + g) * kHalves * kBlockRows + h * kBlockRows;
        const __m512 dv = load16(d + at);
        if constexpr (kIntZero) {
          for (int r = 0; r < kRows; ++r) {
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(unit[r * groups + g]));
            const __m512i centred =
                _mm512_sub_epi32(dot[r][c], _mm512_set1_epi32(zero_sum[(r * groups + g) * kHalves + h]));
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scale, acc[r][c]);
          }
        } else {
          const __m512 lv = load16(low + at);
          for (int r = 0; r < kRows; ++r) {
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(unit[r * groups + g]));
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), scale, acc[r][c]);
            acc[r][c] = _mm512_fmadd_ps(lv, _mm512_set1_ps(code_sum[r * groups + g]), acc[r][c]);
          }
        }
      }
    }
  }
  for (int c = 0; c < kBlocks; ++c) {
    const int64_t n = (block + c) * kBlockRows;
    const int64_t count = std::min<int64_t>(kBlockRows, out_features - n);
    for (int r = 0; r < kRows; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(y + r * out_features + n, static_cast<__mmask16>((1u << count) - 1), acc[r][c]);
#if defined(__AVX512BF16__)
      } else if constexpr (std::is_same_v<T, at::BFloat16>) {
        _mm256_mask_storeu_epi16(y + r * out_features + n, static_cast<__mmask16>((1u << count) - 1),
                                 (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
#endif
      } else {
        alignas(64) float out[kBlockRows];
        _mm512_store_ps(out, acc[r][c]);
        store_row(y + r * out_features + n, out, count);
      }
    }
  }
}

// Output blocks [block, block + count) of 5-bit codes as bytes, [count][groups][512] (the 8-bit
// codes' layout, the zero point staying 16). Calls of more than 2 rows unpack their blocks'
// codes once here, and every tile of rows reads those bytes: unpacked in each tile, the fifth
// bits' registers would leave too few for a 4-row tile's accumulators.
void unpack_five_blocks(const uint8_t* w, int64_t groups, int64_t block, int64_t count, uint8_t* out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + ((block + c) * groups + g) * kFiveBlockBytes;
      uint8_t* og = out + (c * groups + g) * kBlockBytes;
      __m512i fifth_hi = _mm512_loadu_si512(wg + kNibbleBlockBytes);
      __m512i fifth_lo = _mm512_slli_epi16(fifth_hi, 4);
      for (int j = 0; j < kGroup / 8; ++j) {
        const __m512i v = _mm512_loadu_si512(wg + j * 64);
        _mm512_storeu_si512(og + j * 64, _mm512_ternarylogic_epi32(_mm512_and_si512(v, low_nibbles), fifth_lo, bit4, 0xF8));
        _mm512_storeu_si512(og + (j + 4) * 64, _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles),
                                                                         fifth_hi, bit4, 0xF8));
        fifth_lo = _mm512_srli_epi16(fifth_lo, 1);
        fifth_hi = _mm512_srli_epi16(fifth_hi, 1);
      }
    }
  }
}

// All rows of x against blocks [block, block + kBlocks). next_blocks: how many blocks after
// those this thread computes next (up to kBlocks). In a call of more than 2 rows only the first
// tile of rows reads these blocks' codes from memory, in a burst the hardware prefetchers do not
// get ahead of, so every tile asks for a slice of the next blocks' codes into L2 (as the AVX2
// tiles do). Zen 4, 2 threads, 32 rows: Gemma 3's Q8_0 LM head (262,144 x 640) 252 GMAC/s
// against 318 for a 4,096 x 640 slice of it held in cache, before this.
// kFive: 5-bit codes, taken by the tiles as they are in calls of 1-2 rows, else unpacked to
// bytes first (unpack_five_blocks).
template <int kBlocks, bool kNibbles, bool kIntZero, bool kSub16, bool kFive, typename S, typename T>
void tile_rows(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
               const uint8_t* w, const S* d, const S* low, T* y, int64_t rows, int64_t in_features,
               int64_t out_features, int64_t block, bool ask_ahead, int64_t next_blocks) {
  const int64_t groups = in_features / kGroup;
  constexpr int64_t kGroupBytes = kGroupCodeBytes<kNibbles, kFive>;
  const uint8_t* wb = w + block * groups * kGroupBytes;
  if constexpr (kFive) {
    if (rows <= 2) {
      if (rows == 1) {
        tile<1, kBlocks, true, true, false, true, S, T>(codes, unit, code_sum, zero_sum, wb, d, low, y, in_features,
                                                        out_features, block, ask_ahead);
      } else {
        tile<2, kBlocks, true, true, false, true, S, T>(codes, unit, code_sum, zero_sum, wb, d, low, y, in_features,
                                                        out_features, block, ask_ahead);
      }
      return;
    }
  }
  [[maybe_unused]] constexpr bool kBytes = !kNibbles || kFive;  // what the tiles below read
  if constexpr (kFive) {
    thread_local std::vector<uint8_t> five_bytes;
    five_bytes.resize(kBlocks * groups * kBlockBytes);
    unpack_five_blocks(w, groups, block, kBlocks, five_bytes.data());
    wb = five_bytes.data();
    ask_ahead = false;  // the bytes are in cache; the packed codes are asked for below
  }
  const char* next = reinterpret_cast<const char*>(w + (block + kBlocks) * groups * kGroupBytes);
  const int64_t next_lines = rows > 2 ? next_blocks * groups * kGroupBytes / 64 : 0;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t lines_per_tile = (next_lines + row_tiles - 1) / row_tiles;
  int64_t line = 0;
  for (int64_t m = 0; m < rows; m += kTileRows) {
    for (const int64_t end = std::min(next_lines, line + lines_per_tile); line < end; ++line)
      _mm_prefetch(next + 64 * line, _MM_HINT_T1);
    const int8_t* c = codes + m * in_features;
    const float *u = unit + m * groups, *s = code_sum + m * groups;
    const int32_t* z = kIntZero ? zero_sum + m * groups * (kSub16 ? 2 : 1) : nullptr;
    T* out = y + m * out_features;
#define GEMEL_VNNI_TILE(R) \
  tile<R, kBlocks, !kBytes, kIntZero, kSub16, false, S, T>(c, u, s, z, wb, d, low, out, in_features, out_features, \
                                                           block, ask_ahead)
    switch (std::min<int64_t>(kTileRows, rows - m)) {
      case 1: GEMEL_VNNI_TILE(1); break;
      case 2: GEMEL_VNNI_TILE(2); break;
      case 3: GEMEL_VNNI_TILE(3); break;
      default: GEMEL_VNNI_TILE(kTileRows); break;
    }
#undef GEMEL_VNNI_TILE
  }
}
#endif

#if defined(GEMEL_AVX2)
// AVX2 without VNNI (x86-64-v3: AMD Zen 1-3, Intel Haswell to Comet Lake): the same layout and
// arithmetic with 256-bit vectors, one half of a 16-row block (8 outputs) a tile. vpmaddubsw
// multiplies unsigned weight bytes by signed x codes and adds pairs into int16 (saturating),
// vpmaddwd adds those pairs into the int32 lanes.
//  - 4-bit codes: a pair of products is at most 2 * 15 * 127, so the eight vpmaddubsw of a
//    group add up in int16 without saturating and one vpmaddwd a group widens them.
//  - 5-bit codes: a pair of products is at most 2 * 31 * 127, so two steps of the group loop
//    (four vpmaddubsw) add up in int16 and a vpmaddwd widens every two. The fifth bits are
//    shifted to bit 4 of each byte and ORed onto the nibbles: fewer ops than 8-bit codes from
//    4 rows of x up (no sign trick, one widening per 64 products), 62.5% of their bytes.
//  - 6-bit codes with a scale per 16 (GGUF Q6_K, zero point 32): a pair of products is at most
//    2 * 63 * 127, so two vpmaddubsw add up in int16 before a vpmaddwd widens them; half the ops
//    of 8-bit codes' sign trick.
//  - 8-bit codes: a pair of products could reach 2 * 255 * 127 and saturate, so each code
//    is taken as s = u - 128 and multiplied as |s| by x with s's sign (at most 2 * 127 * 127,
//    which fits): llama.cpp's sign trick turned round, so that |s| is taken once for all the
//    rows of a tile rather than |x| for each (one op fewer per row and 32 products: 8-bit
//    tiles 70 -> 77 GMAC/s on one Zen 5 core). It needs s != -128 (no code 0), which the
//    packing guarantees; the dot product is then sum (u - 128) x, and the callers' zero point
//    and offset are shifted by 128 to match.
// Built with AVX-VNNI (-march=native on a CPU that has it but not AVX-512), each vpmaddubsw and
// the adds after it are one vpdpbusd, which sums four products straight into int32: no int16
// stage, nothing to widen, and the same integer sums, so the same results bit for bit.

// How far ahead of the weights being read (bytes) a small call asks for the next ones. 8-bit
// codes, into L1: Gemma 3's 178 MB Q8_0 LM head, batch-1 step 11.1-11.4 -> 10.2-10.3 ms on a
// Zen 5 capped at AVX2. 4-bit codes, into L2 (into L1 it made no difference): SmolLM2's
// batch-1 step 6.85 -> 6.15-6.19 ms on a Zen 4 capped at AVX2 (Gemma 3's within the noise).
// On an AMD Zen 2 the 8-bit codes' asking costs instead: the same head at one row 7.3 ms with
// it, 6.25 without (a plain 2-thread read of its bytes: 5.4-5.7), so it is a switch
// (stream_prefetch_kinds) that the engine sets by timing.
constexpr int64_t kPrefetchAhead = 4096;

// 8 scales or offsets, stored as float32 or float16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t four_codes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return four;
}

#if defined(GEMEL_AVX_VNNI)
// acc + the sums of four products of unsigned bytes of u and signed bytes of s, per int32 lane.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// One half of output block `block`'s 5-bit codes as bytes, all groups: [groups][8 vectors][32].
// Calls of more than one tile of rows unpack them once here and every tile reads the bytes:
// unpacked per tile, the nibbles and fifth bits cost 9 ops a step of the group loop, and held
// all tile long they left too few registers (Gemma 3's gate_up at 32 and 128 rows: 135 and
// 137 GMAC/s unpacked per tile, 151 and 158 once, alternated in one process, Zen 4 capped at
// AVX2). 4-bit codes gain nothing from it (their unpacking is 3 ops a step).
void unpack_five_half(const uint8_t* w, int64_t groups, int64_t block, int half, uint8_t* out) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + (block * groups + g) * kFiveBlockBytes + half * 32;
    __m256i fifth_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + kNibbleBlockBytes));
    __m256i fifth_lo = _mm256_slli_epi16(fifth_hi, 4);
    uint8_t* og = out + g * 256;
    for (int j = 0; j < kGroup / 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low_nibbles), _mm256_and_si256(fifth_lo, bit4));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles),
                                         _mm256_and_si256(fifth_hi, bit4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(og + j * 32), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(og + (j + 4) * 32), hi);
      fifth_lo = _mm256_srli_epi16(fifth_lo, 1);
      fifth_hi = _mm256_srli_epi16(fifth_hi, 1);
    }
  }
}

// kRows rows of x against one half (`half`: outputs 0-7 or 8-15) of output block `block`.
// ask_ahead: a tile of 1-2 rows asks for the weights kPrefetchAhead bytes on (the caller reads
// stream_prefetch_kinds). kBytes (5-bit codes): that half's codes already as bytes in
// `unpacked` (unpack_five_half).
// kSix (with kSub16): 6-bit codes 0-63 with zero point 32, zero_sum per 16 codes.
template <int kRows, bool kNibbles, bool kIntZero, bool kSub16, bool kFive, bool kBytes, bool kSix, typename S, typename T>
void tile_half(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
               const uint8_t* w, const S* d, const S* low, T* y, int64_t in_features, int64_t out_features,
               int64_t block, int half, bool ask_ahead, const uint8_t* unpacked = nullptr) {
  const int64_t groups = in_features / kGroup;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // widens int16 pairs (not with AVX-VNNI)
  using Fresh = std::true_type;  // a step whose sums start the group's (see `step` below)
  using Adding = std::false_type;
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* xg = codes + g * kGroup;
    if constexpr (kSix) {
      const uint8_t* wg = w + (block * groups + g) * kBlockBytes + half * 32;
      if (ask_ahead && half == 0 && kRows <= 2) {  // a decode step streams the weights: ask for them ahead
        for (int line = 0; line < 8; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 64 * line), _MM_HINT_T0);
      }
      const S* dg = d + (block * groups + g) * 2 * kBlockRows + half * 8;
      for (int h = 0; h < 2; ++h) {  // codes 0-15, then 16-31, each with its own scale
        __m256i dot[kRows];
        for (int j = 4 * h; j < 4 * h + 4; j += 2) {  // the first pair of steps starts dot
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (j + 1) * 64));
          for (int r = 0; r < kRows; ++r) {
            const int8_t* xr = xg + r * in_features;
#if defined(GEMEL_AVX_VNNI)
            const __m256i d = dot4(j == 4 * h ? _mm256_setzero_si256() : dot[r], v0, _mm256_set1_epi32(four_codes(xr + j * 4)));
            dot[r] = dot4(d, v1, _mm256_set1_epi32(four_codes(xr + j * 4 + 4)));
#else
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(v0, _mm256_set1_epi32(four_codes(xr + j * 4))),
                                                   _mm256_maddubs_epi16(v1, _mm256_set1_epi32(four_codes(xr + j * 4 + 4))));
            const __m256i sums = _mm256_madd_epi16(pairs, ones);
            dot[r] = j == 4 * h ? sums : _mm256_add_epi32(dot[r], sums);
#endif
          }
        }
        const __m256 dh = load8(dg + h * kBlockRows);
        for (int r = 0; r < kRows; ++r) {
          const __m256i centred = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(zero_sum[(r * groups + g) * 2 + h]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(dh, _mm256_set1_ps(unit[r * groups + g])),
                                   acc[r]);
        }
      }
      continue;
    }
    __m256i dot[kRows], dot2[kSub16 ? kRows : 1];  // kSub16: dot of codes 0-15, dot2 of 16-31
    if constexpr (kNibbles) {
      constexpr int64_t kGroupBytes = kFive ? kFiveBlockBytes : kNibbleBlockBytes;
      const uint8_t* wg = w + (block * groups + g) * kGroupBytes + half * 32;
      const __m256i low_nibbles = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
      __m256i sum16[kRows];
      if (ask_ahead && !kBytes && half == 0 && kRows <= 2) {  // a decode step streams the weights: into L2 ahead of use
        for (int line = 0; line < kGroupBytes / 64; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 64 * line), _MM_HINT_T1);
      }
      // 5-bit codes: vector j's fifth bit is bit j of its plane byte and vector j + 4's bit j + 4;
      // each step of the loop shifts both planes right by one (in 16-bit lanes: bit 4 of either
      // byte comes from the same byte).
      __m256i fifth_lo = _mm256_setzero_si256(), fifth_hi = fifth_lo;
      const uint8_t* ug = kBytes ? unpacked + g * 256 : nullptr;
      if constexpr (kFive && !kBytes) {
        fifth_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + kNibbleBlockBytes));
        fifth_lo = _mm256_slli_epi16(fifth_hi, 4);
      }
      // One step: codes 4j..4j+3 and 4j+16..4j+19 of every row. `fresh`: sum16 holds nothing yet,
      // so the step's products become it (one vpaddw a row fewer than adding them to zero).
      const auto step = [&](int j, auto fresh) {
        __m256i lo, hi;
        if constexpr (kBytes) {
          lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ug + j * 32));
          hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ug + (j + 4) * 32));
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
          lo = _mm256_and_si256(v, low_nibbles);
          hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        }
        if constexpr (kFive && !kBytes) {
          lo = _mm256_or_si256(lo, _mm256_and_si256(fifth_lo, bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(fifth_hi, bit4));
          fifth_lo = _mm256_srli_epi16(fifth_lo, 1);
          fifth_hi = _mm256_srli_epi16(fifth_hi, 1);
        }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* xr = xg + r * in_features;
#if defined(GEMEL_AVX_VNNI)
          const __m256i d = dot4(decltype(fresh)::value ? _mm256_setzero_si256() : dot[r], lo,
                                 _mm256_set1_epi32(four_codes(xr + j * 4)));
          dot[r] = dot4(d, hi, _mm256_set1_epi32(four_codes(xr + (j + 4) * 4)));
#else
          const __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_codes(xr + j * 4)));
          const __m256i b = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_codes(xr + (j + 4) * 4)));
          if constexpr (decltype(fresh)::value) {
            sum16[r] = _mm256_add_epi16(a, b);
          } else {
            sum16[r] = _mm256_add_epi16(sum16[r], _mm256_add_epi16(a, b));
          }
#endif
        }
      };
#if defined(GEMEL_AVX_VNNI)
      (void)sum16;
      step(0, Fresh{});  // int32 sums from the start: every code width takes the same loop
#pragma GCC unroll 1
      for (int j = 1; j < kGroup / 8; ++j) step(j, Adding{});
#else
      if constexpr (kFive) {  // two steps' 5-bit products are as much as int16 holds
        for (int j = 0; j < kGroup / 8; j += 2) {
          step(j, Fresh{});
          step(j + 1, Adding{});
          for (int r = 0; r < kRows; ++r) {
            const __m256i sums = _mm256_madd_epi16(sum16[r], ones);
            dot[r] = j == 0 ? sums : _mm256_add_epi32(dot[r], sums);
          }
        }
      } else {
        step(0, Fresh{});
        // Not unrolled: unrolled, GCC hoists every vpmaddubsw of the group ahead of the adds and
        // spills their results to the stack (about half the speed at 32 rows).
#pragma GCC unroll 1
        for (int j = 1; j < kGroup / 8; ++j) step(j, Adding{});
      }
      if constexpr (!kFive) {
        for (int r = 0; r < kRows; ++r) dot[r] = _mm256_madd_epi16(sum16[r], ones);
      }
#endif
    } else {
      const uint8_t* wg = w + (block * groups + g) * kBlockBytes + half * 32;
      if (ask_ahead && half == 0 && kRows <= 2) {  // a decode step streams the weights: ask for them ahead
        for (int line = 0; line < 8; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 64 * line), _MM_HINT_T0);
      }
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      // One step: codes 4j..4j+3 of every row. `fresh`: the step's sums start dot (one add a row
      // fewer than adding them to zero).
      const auto step = [&](int j, auto fresh) {
        const __m256i s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
        const __m256i magnitude = _mm256_abs_epi8(s);  // once for all rows: x takes s's sign instead
        for (int r = 0; r < kRows; ++r) {
          const __m256i xv = _mm256_set1_epi32(four_codes(xg + r * in_features + j * 4));
#if defined(GEMEL_AVX_VNNI)
          dot[r] = dot4(decltype(fresh)::value ? _mm256_setzero_si256() : dot[r], magnitude, _mm256_sign_epi8(xv, s));
#else
          const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, s)), ones);
          if constexpr (decltype(fresh)::value) {
            dot[r] = sums;
          } else {
            dot[r] = _mm256_add_epi32(dot[r], sums);
          }
#endif
        }
      };
      if constexpr (kSub16) {  // codes 0-15 and 16-31 have their own scales: their own sums
        step(0, Fresh{});
#pragma GCC unroll 3
        for (int j = 1; j < kGroup / 8; ++j) step(j, Adding{});
        for (int r = 0; r < kRows; ++r) dot2[r] = dot[r];
        step(kGroup / 8, Fresh{});
#pragma GCC unroll 3
        for (int j = kGroup / 8 + 1; j < kGroup / 4; ++j) step(j, Adding{});
      } else {
        step(0, Fresh{});
#pragma GCC unroll 4
        for (int j = 1; j < kGroup / 4; ++j) step(j, Adding{});
      }
    }
    if constexpr (kSub16) {  // zero point 128 (checked by the caller): the dots are already centred
      const S* dg = d + (block * groups + g) * 2 * kBlockRows + half * 8;
      const __m256 d0 = load8(dg), d1 = load8(dg + kBlockRows);
      for (int r = 0; r < kRows; ++r) {
        const __m256 u = _mm256_set1_ps(unit[r * groups + g]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2[r]), _mm256_mul_ps(d0, u), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d1, u), acc[r]);
      }
      continue;
    }
    const int64_t at = (block * groups + g) * kBlockRows + half * 8;
    const __m256 dv = load8(d + at);
    if constexpr (kIntZero) {
      for (int r = 0; r < kRows; ++r) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(unit[r * groups + g]));
        __m256i centred = dot[r];  // zero_sum null: the dots are already centred (8-bit codes)
        if (zero_sum != nullptr) centred = _mm256_sub_epi32(centred, _mm256_set1_epi32(zero_sum[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale, acc[r]);
      }
    } else {
      __m256 lv = load8(low + at);
      if constexpr (!kNibbles) lv = _mm256_fmadd_ps(dv, _mm256_set1_ps(128.f), lv);  // dot is sum (u - 128) x
      for (int r = 0; r < kRows; ++r) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(unit[r * groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
        acc[r] = _mm256_fmadd_ps(lv, _mm256_set1_ps(code_sum[r * groups + g]), acc[r]);
      }
    }
  }
  const int64_t n = block * kBlockRows + half * 8;
  const int64_t count = std::min<int64_t>(8, out_features - n);
  for (int r = 0; r < kRows; ++r) {
    if (std::is_same_v<T, float> && count == 8) {
      _mm256_storeu_ps(reinterpret_cast<float*>(y + r * out_features + n), acc[r]);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      store_row(y + r * out_features + n, out, count);
    }
  }
}

// All rows of x against output blocks [b0, b1): each half block's weights (a few KB) stay in
// L1 while every tile of 4 rows of x passes over them.
template <bool kNibbles, bool kIntZero, bool kSub16, bool kFive, bool kSix, typename S, typename T>
void gemm_blocks_avx2(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
                      const uint8_t* w, const S* d, const S* low, T* y, int64_t rows, int64_t in_features,
                      int64_t out_features, int64_t b0, int64_t b1) {
  const int64_t groups = in_features / kGroup;
  thread_local std::vector<uint8_t> five_bytes;  // one half block's 5-bit codes as bytes
  const bool unpack = kFive && rows > kTileRows;
  if (unpack) five_bytes.resize(groups * 256);
  // Calls of more than 2 rows ask for the next block's codes into L2 while this block's tiles
  // run, a slice a tile: only the first tile of a block reads its codes from memory, in a
  // burst the hardware prefetchers do not get ahead of. With the sign trick above, at 32 rows
  // on a Zen 5 capped at AVX2 (2 threads, three alternated runs): Gemma 3's Q8_0 LM head
  // (262,144 x 640) 64-82 -> 57-63 ms; thirty 3,072 x 576 4-bit weights called in turn (so
  // read from memory, as in a decode step) 119-128 -> 135-169 GMAC/s.
  constexpr int64_t kGroupBytes = kGroupCodeBytes<kNibbles, kFive>;
  const int64_t block_lines = groups * kGroupBytes / 64;
  const int64_t tiles_per_block = 2 * ((rows + kTileRows - 1) / kTileRows);
  const int64_t lines_per_tile = rows > 2 ? (block_lines + tiles_per_block - 1) / tiles_per_block : 0;
  const bool ask_ahead =
      (stream_prefetch_kinds.load(std::memory_order_relaxed) & (kNibbles ? kStreamNibbles : kStreamBytes)) != 0;
  for (int64_t b = b0; b < b1; ++b) {
    const char* next = reinterpret_cast<const char*>(w + (b + 1) * groups * kGroupBytes);
    int64_t next_line = b + 1 < b1 ? 0 : block_lines;
    for (int half = 0; half < 2 && b * kBlockRows + half * 8 < out_features; ++half) {
      const uint8_t* unpacked = nullptr;
      if (unpack) {
        unpack_five_half(w, groups, b, half, five_bytes.data());
        unpacked = five_bytes.data();
      }
      for (int64_t m = 0; m < rows; m += kTileRows) {
        for (int64_t end = std::min(block_lines, next_line + lines_per_tile); next_line < end; ++next_line)
          _mm_prefetch(next + 64 * next_line, _MM_HINT_T1);
        const int8_t* c = codes + m * in_features;
        const float *u = unit + m * groups, *s = code_sum + m * groups;
        const int32_t* z = kIntZero && zero_sum != nullptr ? zero_sum + m * groups * (kSub16 ? 2 : 1) : nullptr;
        T* out = y + m * out_features;
#define GEMEL_TILE_HALF(R, B) tile_half<R, kNibbles, kIntZero, kSub16, kFive, B, kSix, S, T>(c, u, s, z, w, d, low, out, in_features, out_features, b, half, ask_ahead, unpacked)
        const int64_t tile_rows = std::min<int64_t>(kTileRows, rows - m);
        if (unpacked != nullptr) {
          switch (tile_rows) {
            case 1: GEMEL_TILE_HALF(1, kFive); break;
            case 2: GEMEL_TILE_HALF(2, kFive); break;
            case 3: GEMEL_TILE_HALF(3, kFive); break;
            default: GEMEL_TILE_HALF(kTileRows, kFive); break;
          }
          continue;
        }
        switch (tile_rows) {
          case 1: GEMEL_TILE_HALF(1, false); break;
          case 2: GEMEL_TILE_HALF(2, false); break;
          case 3: GEMEL_TILE_HALF(3, false); break;
          default: GEMEL_TILE_HALF(kTileRows, false); break;
        }
#undef GEMEL_TILE_HALF
      }
    }
  }
}
#endif

// x in float32 or bf16, what the engine runs (fewer instantiations than every floating type).
#define GEMEL_FLOAT_AND_BF16_CASES(...) \
  AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)

// Blocks [b0, b1) of the output for all rows. kSub16: each group of 32 has two scales, one per
// 16 codes (GGUF Q6_K), d is [blocks, groups, 2, 16], and the integer zero point is 128.
// kFive (with kNibbles): 5-bit codes, nibbles and a plane of fifth bits.
// With kSub16, zero_sum is per 16 codes ([rows, groups, 2]); kSix: those are 6-bit codes (AVX2
// tiles without the sign trick; the portable loops take any codes).
template <bool kNibbles, bool kIntZero, bool kSub16, typename S, bool kFive = false, bool kSix = false, typename T>
void gemm_blocks(const int8_t* codes, const float* unit, const float* code_sum, const int32_t* zero_sum,
                 const uint8_t* w, const S* d, const S* low, T* y, int64_t rows, int64_t in_features,
                 int64_t out_features, int64_t b0, int64_t b1) {
  [[maybe_unused]] const int64_t groups = in_features / kGroup;  // the portable loops' own
#if defined(GEMEL_VNNI)
  // 6-bit codes (kSix) are bytes to the VNNI tiles like any others, their zero point 32 taken
  // off the integer sums.
  const bool ask_ahead =  // read by the tiles of 1-2 rows
      (stream_prefetch_kinds.load(std::memory_order_relaxed) & (kNibbles ? kStreamNibbles : kStreamBytes)) != 0;
  int64_t b = b0;
  for (; b + kTileBlocks <= b1; b += kTileBlocks)
    tile_rows<kTileBlocks, kNibbles, kIntZero, kSub16, kFive, S, T>(
        codes, unit, code_sum, zero_sum, w, d, low, y, rows, in_features, out_features, b, ask_ahead,
        std::min<int64_t>(kTileBlocks, b1 - b - kTileBlocks));
  for (; b < b1; ++b)
    tile_rows<1, kNibbles, kIntZero, kSub16, kFive, S, T>(codes, unit, code_sum, zero_sum, w, d, low, y, rows,
                                                       in_features, out_features, b, ask_ahead, b + 1 < b1 ? 1 : 0);
#elif defined(GEMEL_AVX2)
  gemm_blocks_avx2<kNibbles, kIntZero, kSub16, kFive, kSix, S, T>(codes, unit, code_sum, zero_sum, w, d, low, y, rows,
                                                     in_features, out_features, b0, b1);
#elif defined(GEMEL_NEON)
  // 6-bit codes (kSix) are bytes there like any others (u - 128 and back, exactly).
  gemel::neon::gemm_blocks<kNibbles, kIntZero, kSub16, kFive>(codes, unit, code_sum, zero_sum, w, d, low, y, rows,
                                                             in_features, out_features, b0, b1);
#else
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t i = 0; i < kBlockRows && b * kBlockRows + i < out_features; ++i) {
      for (int64_t m = 0; m < rows; ++m) {
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t dot = 0, halves[2] = {0, 0};  // kSub16: sum u x per 16 codes
          for (int64_t k = 0; k < kGroup; ++k) {
            const int64_t vector = k / 4, lane_byte = 4 * i + k % 4;
            int32_t u;
            if constexpr (kNibbles) {
              const uint8_t* wg = w + (b * groups + g) * (kFive ? kFiveBlockBytes : kNibbleBlockBytes);
              const uint8_t both = wg[(vector % 4) * 64 + lane_byte];
              u = vector < 4 ? both & 0x0F : both >> 4;
              if constexpr (kFive) u |= ((wg[kNibbleBlockBytes + lane_byte] >> vector) & 1) << 4;
            } else {
              u = w[(b * groups + g) * kBlockBytes + vector * 64 + lane_byte];
            }
            dot += u * codes[m * in_features + g * kGroup + k];
            if constexpr (kSub16) halves[k / 16] += u * codes[m * in_features + g * kGroup + k];
          }
          if constexpr (kSub16) {
            const int64_t at = (b * groups + g) * 2 * kBlockRows + i;
            for (int h = 0; h < 2; ++h) {
              const int32_t centred = halves[h] - zero_sum[(m * groups + g) * 2 + h];
              total += static_cast<float>(centred) * static_cast<float>(d[at + h * kBlockRows]) * unit[m * groups + g];
            }
            continue;
          }
          const int64_t at = (b * groups + g) * kBlockRows + i;
          if constexpr (kIntZero) {
            total += static_cast<float>(dot - zero_sum[m * groups + g]) * static_cast<float>(d[at]) * unit[m * groups + g];
          } else {
            total += static_cast<float>(dot) * static_cast<float>(d[at]) * unit[m * groups + g] +
                     static_cast<float>(low[at]) * code_sum[m * groups + g];
          }
        }
        y[m * out_features + b * kBlockRows + i] = static_cast<T>(total);
      }
    }
  }
#endif
}

// x rounded to int8 per group of 32, with each group's unit and sums (quantize_row). A batch-1
// step makes some 120 calls, and four tensor allocations a call cost more than rounding x, so
// calls of up to kScratchRows rows use buffers kept per calling thread; larger ones (prefill
// chunks, where the GEMM dwarfs an allocation) get their own, which keeps what a thread holds
// small.
constexpr int64_t kScratchRows = 64;

// Room for n values that is not cleared when it grows (std::vector's resize zeroes): every
// value is written before it is read. Clearing a prefill chunk's rounded x (4,096 rows x
// 1,536 inputs for down: 6 MB a call) was 2.6% of a prefill's samples.
template <typename T>
class Uncleared {
 public:
  void resize(int64_t n) {
    if (n > capacity_) {
      values_.reset(new T[n]);  // default-initialised: left as the allocator gives it
      capacity_ = n;
    }
  }
  T* data() { return values_.get(); }

 private:
  std::unique_ptr<T[]> values_;
  int64_t capacity_ = 0;
};

struct QuantizedRows {
  Uncleared<int8_t> codes;
  Uncleared<float> unit, code_sum;
  Uncleared<int32_t> zero_sum;

  void resize(int64_t rows, int64_t in_features, bool zero_point, bool halves) {
    const int64_t groups = in_features / kGroup;
    codes.resize(rows * in_features);
    unit.resize(rows * groups);
    code_sum.resize(rows * groups);
    zero_sum.resize(zero_point ? rows * groups * (halves ? 2 : 1) : 0);
  }
};

QuantizedRows& thread_scratch() {
  thread_local QuantizedRows rows;
  return rows;
}

// One call's weight and x, checked, with x rounded to int8 per group (what int8_act_gemm and
// int8_act_gemm_argmax share). The rounded rows live in the calling thread's scratch for calls
// of up to kScratchRows rows, else in the caller's `own`.
struct PreparedCall {
  int64_t rows = 0, in_features = 0, groups = 0, blocks = 0;
  int64_t group_bytes = 0, scales_per_group = 0;  // a block's bytes of codes and its scales, per group
  bool five = false, nibbles = false, int_zero = false, sub16 = false, six = false, half_scales = false;
  const int8_t* codes = nullptr;  // x's rows as int8
  const float *unit = nullptr, *code_sum = nullptr;
  const int32_t* zero_sum = nullptr;
};

// x: [M, K]; codes: [ceil(N/16), K/32, 512] uint8 (4-bit codes: 256, two a byte; 5-bit codes,
// with an integer zero point: 320, the nibbles and their fifth bits); d, low:
// [ceil(N/16), K/32, 16] float32 or both float16 (half the bytes to stream; GGUF stores its
// scales as float16). d may be [.., 32], a scale per 16 codes (GGUF Q6_K), with
// 8-bit codes and zero_point 128, or 6-bit codes (0-63: GGUF Q6_K) and zero_point 32. zero_point z > 0: w = d * (u - z) and low is empty. 8-bit codes must not
// be 0 (the AVX2 tiles compute with u - 128 as a signed byte; pack_group_codes ensures it).
// gated: x is a gated MLP's [M, 2K] gate and up, and the input is silu(gate) * up.
PreparedCall prepare_call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& low,
                          int64_t out_features, bool gated, int64_t zero_point, QuantizedRows& own) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.scalar_type() == at::kByte, "x [M,K], codes [B,G,512] uint8");
  TORCH_CHECK(!gated || x.size(1) % 2 == 0, "gated: x must be [M, 2K]");
  PreparedCall p;
  p.rows = x.size(0);
  p.in_features = gated ? x.size(1) / 2 : x.size(1);
  p.groups = p.in_features / kGroup;
  p.blocks = (out_features + kBlockRows - 1) / kBlockRows;
  const int64_t rows = p.rows, in_features = p.in_features, groups = p.groups, blocks = p.blocks;
  TORCH_CHECK(in_features % kGroup == 0, "K must be a multiple of 32");
  p.five = codes.size(2) == kFiveBlockBytes;
  p.nibbles = codes.size(2) == kNibbleBlockBytes || p.five;
  TORCH_CHECK(codes.size(0) == blocks && codes.size(1) == groups && (p.nibbles || codes.size(2) == kBlockBytes),
              "codes do not match x and out_features");
  p.group_bytes = codes.size(2);
  p.int_zero = zero_point != 0;
  TORCH_CHECK(zero_point >= 0 && zero_point <= 255, "zero_point must be in 0..255");
  TORCH_CHECK(!p.int_zero || low.numel() == 0, "with an integer zero point, low must be empty");
  p.sub16 = d.dim() == 3 && d.size(2) == 2 * kBlockRows;
  p.scales_per_group = (p.sub16 ? 2 : 1) * kBlockRows;
  TORCH_CHECK(!p.sub16 || ((zero_point == 128 || zero_point == 32) && !p.nibbles),
              "scales per 16 codes need 8-bit codes and zero_point 128, or 6-bit codes (0-63) and zero_point 32");
  p.six = p.sub16 && zero_point == 32;
  TORCH_CHECK(!p.five || p.int_zero, "5-bit codes need an integer zero point");
  const auto check_per_block = [&](const at::Tensor& t) {
    TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) && t.scalar_type() == d.scalar_type() &&
                    t.dim() == 3 && t.size(0) == blocks && t.size(1) == groups && t.size(2) == p.scales_per_group &&
                    t.is_contiguous(),
                "scales and offsets: float32 or float16 (both alike) [blocks, groups, 16] (or 32: a scale per 16 "
                "codes), contiguous");
  };
  check_per_block(d);
  if (!p.int_zero) check_per_block(low);
  TORCH_CHECK(codes.is_contiguous(), "codes must be contiguous");
  p.half_scales = d.scalar_type() == at::kHalf;
  const auto xc = x.contiguous();
  QuantizedRows& q = rows <= kScratchRows ? thread_scratch() : own;
#if defined(GEMEL_AVX2)
  const int32_t dot_offset = p.nibbles || p.six ? 0 : 128;  // the AVX2 tiles' 8-bit dot products are of u - 128
#else
  const int32_t dot_offset = 0;
#endif
  // 8-bit codes whose zero point the AVX2 tiles' dot products already take off (128) would have
  // zero sums of all 0: none are made, and the tiles skip subtracting them, an integer op and a
  // broadcast a row and group that share the multiplier's pipes on AMD Zen 2. The Q8_0 LM heads
  // at 32 rows there (bench/int8_act_rates.py, two alternations): Gemma 3's 73.1-75.1 ->
  // 69.6-70.4 ms, SmolLM2's 11.9 -> 11.3.
  const bool zero_sums = p.int_zero && zero_point != dot_offset;
  const bool sub16 = p.sub16;
  q.resize(rows, in_features, zero_sums, sub16);
  AT_DISPATCH_SWITCH(xc.scalar_type(), "int8_act_gemm", GEMEL_FLOAT_AND_BF16_CASES([&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    int8_t* qp = q.codes.data();
    float *up = q.unit.data(), *sp = q.code_sum.data();
    int32_t* zp = zero_sums ? q.zero_sum.data() : nullptr;
    at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
      thread_local std::vector<float> inputs;  // one row, at most the largest in_features
      inputs.resize(in_features);
      for (int64_t m = m0; m < m1; ++m) {
        const scalar_t* row = xp + m * xc.size(1);
        input_row(row, gated ? row + in_features : nullptr, in_features, inputs.data());
        quantize_row(inputs.data(), in_features, qp + m * in_features, up + m * groups, sp + m * groups,
                     static_cast<int32_t>(zero_point) - dot_offset, zero_sums ? zp + m * groups * (sub16 ? 2 : 1) : nullptr,
                     sub16);
      }
    });
  }));
  p.codes = q.codes.data();
  p.unit = q.unit.data();
  p.code_sum = q.code_sum.data();
  p.zero_sum = zero_sums ? q.zero_sum.data() : nullptr;
  return p;
}

// y[:, 16 b0 .. 16 b1) of the prepared call for output blocks [b0, b1) of a weight whose codes,
// scales and offsets start at w, d and low (a slice of the call's weight: y's row stride and
// bound are this slice's out_features).
template <typename T>
void run_blocks(const PreparedCall& p, const uint8_t* w, const void* d, const void* low, T* y, int64_t out_features,
                int64_t b0, int64_t b1) {
  const int8_t* qp = p.codes;
  const float *up = p.unit, *sp = p.code_sum;
  const int32_t* zp = p.zero_sum;
  const int64_t rows = p.rows, in_features = p.in_features;
  const auto run = [&](auto nibbles_tag, auto int_zero_tag, auto scale_tag) {
    using S = decltype(scale_tag);
    const S* dp = static_cast<const S*>(d);
    const S* lp = p.int_zero ? nullptr : static_cast<const S*>(low);
    constexpr bool kNib = decltype(nibbles_tag)::value, kZero = decltype(int_zero_tag)::value;
    if constexpr (!kNib && kZero) {
      if (p.six) {
        gemm_blocks<false, true, true, S, false, true>(qp, up, sp, zp, w, dp, lp, y, rows, in_features, out_features, b0,
                                                      b1);
        return;
      }
      if (p.sub16) {
        gemm_blocks<false, true, true, S>(qp, up, sp, zp, w, dp, lp, y, rows, in_features, out_features, b0, b1);
        return;
      }
    }
    if constexpr (kNib && kZero) {
      if (p.five) {
        gemm_blocks<true, true, false, S, true>(qp, up, sp, zp, w, dp, lp, y, rows, in_features, out_features, b0, b1);
        return;
      }
    }
    gemm_blocks<kNib, kZero, false, S>(qp, up, sp, zp, w, dp, lp, y, rows, in_features, out_features, b0, b1);
  };
  const auto with_scales = [&](auto nibbles_tag, auto int_zero_tag) {
    p.half_scales ? run(nibbles_tag, int_zero_tag, at::Half{}) : run(nibbles_tag, int_zero_tag, float{});
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (p.nibbles) {
    p.int_zero ? with_scales(Yes{}, Yes{}) : with_scales(Yes{}, No{});
  } else {
    p.int_zero ? with_scales(No{}, Yes{}) : with_scales(No{}, No{});
  }
}

const void* low_or_null(const at::Tensor& low, bool int_zero) { return int_zero ? nullptr : low.data_ptr(); }

// Returns [M, out_features] in x's dtype (see prepare_call for the arguments).
at::Tensor int8_act_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& low,
                         int64_t out_features, bool gated, int64_t zero_point) {
  QuantizedRows own;
  const PreparedCall p = prepare_call(x, codes, d, low, out_features, gated, zero_point, own);
  auto y = at::empty({p.rows, out_features}, x.options());
  AT_DISPATCH_SWITCH(y.scalar_type(), "int8_act_gemm", GEMEL_FLOAT_AND_BF16_CASES([&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Threads split the output blocks in whole register tiles.
    const int64_t tiles = (p.blocks + kTileBlocks - 1) / kTileBlocks;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      run_blocks(p, codes.data_ptr<uint8_t>(), d.data_ptr(), low_or_null(low, p.int_zero), yp, out_features,
                 t0 * kTileBlocks, std::min(p.blocks, t1 * kTileBlocks));
    });
  }));
  return y;
}

// Output blocks a thread computes into its own buffer before taking each row's argmax there:
// 1,024 outputs, 128 KB for 32 rows, which stays in L2.
constexpr int64_t kArgmaxChunkBlocks = 64;

// A row's best (value, index) so far, in torch.argmax's order: the first NaN, else the first
// index of the largest value.
struct RowBest {
  float value = 0.f;
  int64_t index = -1;
};

void keep_best(RowBest& best, const RowBest& other) {
  if (best.index < 0 || (!gemel::is_nan(best.value) && (gemel::is_nan(other.value) || other.value > best.value)))
    best = other;
}

// A row of outputs as float32: itself, or converted into `room`.
const float* as_floats(const float* row, int64_t, std::vector<float>&) { return row; }

template <typename T>
const float* as_floats(const T* row, int64_t width, std::vector<float>& room) {
  room.resize(width);
  for (int64_t i = 0; i < width; ++i) room[i] = static_cast<float>(row[i]);
  return room.data();
}

// argmax over the outputs of int8_act_gemm (the same arguments, gated off) without writing them:
// greedy sampling's LM head, whose [rows, vocab] float32 logits (33.5 MB for Gemma 3's 262,144
// entries at 32 rows) were written to memory and read back by the argmax. Each thread computes
// its outputs a chunk at a time into a buffer that stays in L2 and keeps each row's best. The
// outputs are rounded to x's dtype first, as int8_act_gemm returns them, so the answer is the
// argmax of what int8_act_gemm returns. Returns [M] int64.
at::Tensor int8_act_gemm_argmax(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                                const at::Tensor& low, int64_t out_features, int64_t zero_point) {
  TORCH_CHECK(out_features > 0, "int8_act_gemm_argmax: no outputs to choose from");
  QuantizedRows own;
  const PreparedCall p = prepare_call(x, codes, d, low, out_features, false, zero_point, own);
  const int64_t rows = p.rows, chunks = (p.blocks + kArgmaxChunkBlocks - 1) / kArgmaxChunkBlocks;
  std::vector<RowBest> best(chunks * rows);  // [chunk, row]
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* dp = static_cast<const char*>(d.data_ptr());
  const auto* lp = static_cast<const char*>(low_or_null(low, p.int_zero));
  const int64_t scale_bytes = p.groups * p.scales_per_group * d.element_size();
  AT_DISPATCH_SWITCH(x.scalar_type(), "int8_act_gemm_argmax", GEMEL_FLOAT_AND_BF16_CASES([&] {
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      thread_local std::vector<scalar_t> outputs;
      thread_local std::vector<float> row_values;
      outputs.resize(rows * kArgmaxChunkBlocks * kBlockRows);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b0 = c * kArgmaxChunkBlocks, b1 = std::min(p.blocks, b0 + kArgmaxChunkBlocks);
        const int64_t first = b0 * kBlockRows, width = std::min(out_features, b1 * kBlockRows) - first;
        run_blocks(p, w + b0 * p.groups * p.group_bytes, dp + b0 * scale_bytes, lp ? lp + b0 * scale_bytes : nullptr,
                   outputs.data(), width, 0, b1 - b0);
        for (int64_t m = 0; m < rows; ++m) {
          const scalar_t* row = outputs.data() + m * width;
          const float* values = as_floats(row, width, row_values);
          const int64_t i = gemel::argmax_row(values, width);
          best[c * rows + m] = {values[i], first + i};
        }
      }
    });
  }));
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows; ++m) {
    RowBest row;
    for (int64_t c = 0; c < chunks; ++c) keep_best(row, best[c * rows + m]);
    op[m] = row.index;
  }
  return out;
}

// Rows `ids` (any shape) of a weight packed as 8-bit codes u = q + 128 with one scale per group
// of 32 (GGUF Q8_0, pack_group_codes' layout): each value q times its group's scale, as float32
// [..ids, K]. A tied embedding table's lookups read the LM head's codes this way
// (Linear.embedding_rows). As a dozen PyTorch ops a lookup took 96 us for one token and 160 for
// 32 (SmolLM2, Zen 2), ~1% of a batch-1 step; this takes 8.6 and 18.
at::Tensor embedding_rows(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& ids, int64_t rows) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kBlockBytes && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: contiguous [blocks, groups, 512] uint8 (8-bit codes)");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == codes.size(0) && scale.size(1) == codes.size(1) &&
                  scale.size(2) == kBlockRows && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale: contiguous [blocks, groups, 16] float32 or float16, matching codes");
  TORCH_CHECK(rows >= 0 && rows <= codes.size(0) * kBlockRows, "rows exceeds the codes' blocks");
  TORCH_CHECK(!ids.is_floating_point() && !ids.is_complex(), "ids must be integers");
  const auto flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t count = flat.numel(), groups = codes.size(1), width = groups * kGroup;
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "index ", ip[i], " is out of range for ", rows, " rows");
  auto out = at::empty({count, width}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto fill = [&](const auto* sp) {
    at::parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t block = ip[i] / kBlockRows, lane = ip[i] % kBlockRows;
        for (int64_t g = 0; g < groups; ++g) {
          const float unit = static_cast<float>(sp[(block * groups + g) * kBlockRows + lane]);
          const uint8_t* cg = cp + (block * groups + g) * kBlockBytes + lane * 4;  // vector j: bytes j * 64 + lane * 4
          float* og = op + i * width + g * kGroup;
          for (int j = 0; j < kGroup / 4; ++j)
            for (int c = 0; c < 4; ++c) og[j * 4 + c] = static_cast<float>(static_cast<int32_t>(cg[j * 64 + c]) - 128) * unit;
        }
      }
    });
  };
  if (scale.scalar_type() == at::kHalf) {
    fill(scale.data_ptr<at::Half>());
  } else {
    fill(scale.data_ptr<float>());
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(width);
  return out.view(shape);
}

}  // namespace

at::Tensor gemel::ops::int8_act_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                                     const at::Tensor& low, int64_t out_features, bool gated, int64_t zero_point) {
  return ::int8_act_gemm(x, codes, d, low, out_features, gated, zero_point);
}

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("int8_act_gemm(Tensor x, Tensor codes, Tensor d, Tensor low, int out_features, bool gated=False, "
        "int zero_point=0) -> Tensor");
  m.def("int8_act_gemm_argmax(Tensor x, Tensor codes, Tensor d, Tensor low, int out_features, int zero_point=0) "
        "-> Tensor");
  m.def("embedding_rows(Tensor codes, Tensor scale, Tensor ids, int rows) -> Tensor");
  m.def("set_stream_prefetch(int kinds) -> int", &set_stream_prefetch);
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) {
  m.impl("int8_act_gemm", &int8_act_gemm);
  m.impl("int8_act_gemm_argmax", &int8_act_gemm_argmax);
  m.impl("embedding_rows", &embedding_rows);
}
