// y = x W^T for a weight stored as 4-bit groups of 32 along the input dimension
// (w = scale * q + low, q in 0..15: GGUF Q4_0/Q4_1 and gemel's own int4 groups), for the
// few rows of a small decode step, with integer dot products (AVX512-VNNI).
//
// llama.cpp runs 4-bit weights this way: x is rounded to int8 per group of 32, the products
// within a group are integer (vpdpbusd: 64 unsigned-by-signed byte products per
// instruction) and scaled once per group. That rounding alone visibly changes greedy
// outputs of a small model, so here each group of x is two int8 codes: a coarse one (unit
// max|x|/127) and one for what it misses (unit 1/254 of that). x is then carried to within
// 1/64516 of its group's largest value, finer than bf16's own rounding, for one more
// vpdpbusd per weight vector: at batch 1 the kernel waits on memory anyway. The group sums
// that multiply `low` use x itself.
//
// Weight layout (made once by gemel.layers.linear.pack_int4_rows): output rows in blocks of
// 16 (the last block zero-padded), and per block and group 4 vectors of 64 bytes. In vector
// j, bytes 4i..4i+3 hold row i's weights 8j..8j+3 in their low nibbles and 8j+4..8j+7 in
// their high nibbles, so each 32-bit lane of a dot product belongs to one output row: the
// 16 lanes are 16 outputs, and no horizontal sums are needed. The 256 bytes are followed by
// the 16 rows' scales, then their lows: one record per block and group, so the kernel reads
// one stream and torch.compile guards one tensor per projection. Scales and lows are float16
// where that holds them exactly (GGUF Q4_0/Q4_1 store them so; a 320-byte record): at batch 1
// the kernel runs at memory bandwidth, and every byte counts; float32 otherwise (384 bytes).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GEMEL_VNNI 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kBlockBytes = kBlockRows * kGroup / 2;  // the 4-bit codes of one group of one block
template <typename S>
constexpr int64_t kRecord = kBlockBytes + 2 * kBlockRows * sizeof(S);  // codes, scales, lows
constexpr int64_t kMaxRows = 8;
constexpr int64_t kCodes = 2 * kGroup;  // coarse and fine int8 codes of one group of x
constexpr float kFine = 254.f;          // fine code unit: 1/254 of the coarse one
// How far ahead of the record being read its thread asks for the next ones. A thread's
// blocks are one sequential stream, but the hardware prefetcher alone left the kernel at
// 6-8 GB/s of the two cores' 11-12 at one row (docs/performance.md, "Prefetching to the memory's rate").
constexpr int64_t kPrefetchBytes = 4096;

// x [M, K] (float or bf16) -> per group of 32: int8 codes and int8 codes of what they miss
// (kCodes bytes: coarse then fine), the coarse scale, and the group's sum of x itself.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in_features, int8_t* qx, float* dx, float* sx) {
  const int64_t groups = in_features / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float xg[kGroup];
      float amax = 0.f, total = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) {
        xg[j] = static_cast<float>(x[m * in_features + g * kGroup + j]);
        amax = std::max(amax, std::fabs(xg[j]));
        total += xg[j];
      }
      const float scale = amax / 127.f;
      dx[m * groups + g] = scale;
      sx[m * groups + g] = total;
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* coarse = qx + (m * groups + g) * kCodes;
      int8_t* fine = coarse + kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        const float code = std::nearbyint(xg[j] * inverse);
        coarse[j] = static_cast<int8_t>(code);
        // |x - scale * code| <= scale / 2, so the fine code fits in [-127, 127].
        fine[j] = static_cast<int8_t>(std::clamp(std::nearbyint((xg[j] - scale * code) * inverse * kFine), -127.f, 127.f));
      }
    }
  }
}

#if defined(GEMEL_VNNI)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// One block of 16 output rows for kRows rows of x.
template <int kRows, typename T, typename S>
void int4_block(const int8_t* qx, const float* dx, const float* sx, const uint8_t* packed, T* y, int64_t groups,
                int64_t out_features, int64_t block) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[kRows];
  for (int m = 0; m < kRows; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = packed + (block * groups + g) * kRecord<S>;
    for (int64_t line = 0; line < kRecord<S>; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchBytes + line), _MM_HINT_T0);
    // Per row of x: coarse and fine dot products, two chains each (low and high nibbles),
    // so consecutive vpdpbusd do not wait on each other.
    __m512i dot[kRows][4];
    for (int m = 0; m < kRows; ++m) dot[m][0] = dot[m][1] = dot[m][2] = dot[m][3] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i bytes = _mm512_loadu_si512(record + j * 64);
      const __m512i lo = _mm512_and_si512(bytes, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      for (int m = 0; m < kRows; ++m) {
        const int8_t* xg = qx + (m * groups + g) * kCodes + 8 * j;
        int32_t x_lo, x_hi, r_lo, r_hi;
        std::memcpy(&x_lo, xg, 4);
        std::memcpy(&x_hi, xg + 4, 4);
        std::memcpy(&r_lo, xg + kGroup, 4);
        std::memcpy(&r_hi, xg + kGroup + 4, 4);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, _mm512_set1_epi32(x_lo));
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], hi, _mm512_set1_epi32(x_hi));
        dot[m][2] = _mm512_dpbusd_epi32(dot[m][2], lo, _mm512_set1_epi32(r_lo));
        dot[m][3] = _mm512_dpbusd_epi32(dot[m][3], hi, _mm512_set1_epi32(r_hi));
      }
    }
    const __m512 d = load16(reinterpret_cast<const S*>(record + kBlockBytes));
    const __m512 low = load16(reinterpret_cast<const S*>(record + kBlockBytes) + kBlockRows);
    for (int m = 0; m < kRows; ++m) {
      // 254 * coarse + fine in int32: |sum| <= 32 * 15 * 127 * 255 < 2^24, so exact as float too.
      const __m512i coarse = _mm512_add_epi32(dot[m][0], dot[m][1]), fine = _mm512_add_epi32(dot[m][2], dot[m][3]);
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_mullo_epi32(coarse, _mm512_set1_epi32(254)), fine));
      total[m] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(dx[m * groups + g] / kFine)), total[m]);
      total[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(sx[m * groups + g]), total[m]);
    }
  }
  const int64_t n = block * kBlockRows;
  const __mmask16 mask = out_features - n >= kBlockRows ? 0xFFFF : static_cast<__mmask16>((1u << (out_features - n)) - 1);
  for (int m = 0; m < kRows; ++m) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(y + m * out_features + n, mask, total[m]);
    } else {
      alignas(64) float out[kBlockRows];
      _mm512_store_ps(out, total[m]);
      for (int64_t i = 0; i < kBlockRows && n + i < out_features; ++i) y[m * out_features + n + i] = static_cast<T>(out[i]);
    }
  }
}

// One block for all rows of x, at most 4 at a time (more would not fit the registers; the
// block's weights are still in L1 for the next 4).
template <typename T, typename S>
void int4_block_all_rows(const int8_t* qx, const float* dx, const float* sx, const uint8_t* packed, T* y,
                         int64_t rows, int64_t groups, int64_t out_features, int64_t b) {
  for (int64_t m = 0; m < rows; m += 4) {
    const int8_t* q = qx + m * groups * kCodes;
    const float *d = dx + m * groups, *s = sx + m * groups;
    T* out = y + m * out_features;
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: int4_block<1, T, S>(q, d, s, packed, out, groups, out_features, b); break;
      case 2: int4_block<2, T, S>(q, d, s, packed, out, groups, out_features, b); break;
      case 3: int4_block<3, T, S>(q, d, s, packed, out, groups, out_features, b); break;
      default: int4_block<4, T, S>(q, d, s, packed, out, groups, out_features, b); break;
    }
  }
}
#endif

template <typename T, typename S>
void int4_rows(const int8_t* qx, const float* dx, const float* sx, const uint8_t* packed, T* y, int64_t rows,
               int64_t groups, int64_t out_features, int64_t b0, int64_t b1) {
#if defined(GEMEL_VNNI)
  for (int64_t b = b0; b < b1; ++b)
    int4_block_all_rows<T, S>(qx, dx, sx, packed, y, rows, groups, out_features, b);
#else
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t i = 0; i < kBlockRows && b * kBlockRows + i < out_features; ++i) {
      const int64_t n = b * kBlockRows + i;
      for (int64_t m = 0; m < rows; ++m) {
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t coarse = 0, fine = 0;
          for (int64_t k = 0; k < kGroup; ++k) {
            const uint8_t byte = packed[(b * groups + g) * kRecord<S> + (k / 8) * 64 + 4 * i + k % 4];
            const int32_t w = (k % 8 < 4 ? byte : byte >> 4) & 0x0F;
            coarse += w * qx[(m * groups + g) * kCodes + k];
            fine += w * qx[(m * groups + g) * kCodes + kGroup + k];
          }
          const S* scales = reinterpret_cast<const S*>(packed + (b * groups + g) * kRecord<S> + kBlockBytes);
          const float dot = static_cast<float>(254 * coarse + fine) / kFine;
          total += dot * static_cast<float>(scales[i]) * dx[m * groups + g] +
                   static_cast<float>(scales[kBlockRows + i]) * sx[m * groups + g];
        }
        y[m * out_features + n] = static_cast<T>(total);
      }
    }
  }
#endif
}

// x: [M, K] (M <= 8); packed: [ceil(N/16), K/32, 320 or 384] uint8 records (see the top).
// Returns [M, out_features] in x's dtype.
at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.scalar_type() == at::kByte, "x [M,K], packed [B,G,record] uint8");
  const int64_t rows = x.size(0), in_features = x.size(1), groups = in_features / kGroup;
  const int64_t blocks = (out_features + kBlockRows - 1) / kBlockRows;
  TORCH_CHECK(in_features % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(packed.size(0) == blocks && packed.size(1) == groups, "packed weight does not match x and out_features");
  const bool half_scales = packed.size(2) == kRecord<at::Half>;
  TORCH_CHECK(half_scales || packed.size(2) == kRecord<float>, "records are 320 (float16 scales) or 384 bytes");
  TORCH_CHECK(rows <= kMaxRows, "at most 8 rows");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  const auto xc = x.contiguous();
  // Scratch for x's int8 groups, reused by this thread's later calls.
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, sx;
  qx.resize(rows * groups * kCodes);
  dx.resize(rows * groups);
  sx.resize(rows * groups);
  auto y = at::empty({rows, out_features}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "int4_group_mm", [&] {
    quantize_rows(xc.data_ptr<scalar_t>(), rows, in_features, qx.data(), dx.data(), sx.data());
    const int8_t* qxp = qx.data();
    const float *dxp = dx.data(), *sxp = sx.data();
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      if (half_scales)
        int4_rows<scalar_t, at::Half>(qxp, dxp, sxp, wp, yp, rows, groups, out_features, b0, b1);
      else
        int4_rows<scalar_t, float>(qxp, dxp, sxp, wp, yp, rows, groups, out_features, b0, b1);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("int4_group_mm(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) { m.impl("int4_group_mm", &int4_group_mm); }
