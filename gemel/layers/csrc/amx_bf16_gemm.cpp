// y = x W^T for bf16 rows of x on AMX tiles (`tdpbf16ps`), W a bf16 weight laid out as tiles
// once at load (gemel.layers.linear.pack_amx_tiles).
//
// Why: at decode batch sizes a projection streams its whole weight from memory for a few
// dozen rows of x. oneDNN's bf16 GEMM did that at 0.3-0.4 TFLOP/s on a 2-core Xeon with AMX
// and int8_act_gemm's 4-bit weights were bound by VNNI's rate; here the weights arrive in
// the tiles' own layout (one 1 KB tile per 16 outputs x 32 inputs, no reordering at run
// time), the next output pair's tiles are prefetched into L2 while the current pair
// computes, and each tile meets every row tile of x while it is in L1.
//
// Numerics: the bf16 GEMM's (bf16 inputs, float32 sums, the result rounded to bf16 to
// nearest even), up to the order of the sums.
//
// Tiles: 0-3 hold C (two row tiles of x by two blocks of 16 outputs), 4-5 two row tiles of
// x (16 rows x 32 inputs), 6-7 two blocks' weights (16 pairs of inputs x 16 outputs, the
// pair format tdpbf16ps wants). Threads split the outputs in pairs of blocks.
//
// A gated MLP's fused gate/up projection can be laid out with its blocks interleaved (gate
// block j, then up block j: pack_amx_tiles(..., gate_up=True)), so that each pair holds the
// gate and the up values of the same 16 outputs: the pair's C tiles then give
// silu(gate) * up directly (rounded as the silu_and_mul op rounds the GEMM's bf16 output, so
// the bits are the same), and the [rows, 2 I] product is never written nor read again.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "silu.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kTileValues = 16 * 32;  // bf16 values in one tile

// What the output pairs of w_tiles hold and what a call writes (the op's `gated` argument).
enum Layout : int64_t {
  kPlain = 0,         // blocks in output order; y = x W^T
  kGateUpHalves = 1,  // blocks interleaved gate j, up j; y = x W^T in output order [gate | up]
  kSiluMul = 2,       // the same tiles; y = silu(gate) * up, [rows, out_features / 2]
};

using gemel::amx_usable;

#if defined(GEMEL_AMX)

using gemel::configure_tiles;

// Two C tiles side by side (a pair's 32 outputs, whole) -> bf16 rows of y with non-temporal
// stores: for outputs larger than the caches (the LM head's logits) this skips reading each
// line of y before writing it and keeps x and the weights in cache; 64-byte aligned rows.
inline void stream_pair(const float* c0, const float* c1, at::BFloat16* y, int64_t ld, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_load_ps(c0 + 16 * r));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_load_ps(c1 + 16 * r));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(y + r * ld),
                        _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)lo), (__m256i)hi, 1));
  }
}

// A pair's C tiles as gate and up values (16 outputs) -> bf16 rows of silu(gate) * up: each
// rounded to bf16 first, as the GEMM's output would be, then silu_and_mul's own arithmetic.
inline void store_silu_mul(const float* gate, const float* up, at::BFloat16* y, int64_t ld, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = _mm512_castsi512_ps(gemel::round_to_bf16_bits(_mm512_load_ps(gate + 16 * r)));
    const __m512 u = _mm512_castsi512_ps(gemel::round_to_bf16_bits(_mm512_load_ps(up + 16 * r)));
    const __m512 product = gemel::silu_and_mul16(g, u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ld),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(product), 16)));
  }
}

// C tiles (float32 16 x 16) -> bf16 rows of y, the rows and outputs that exist.
inline void store_tile(const float* c, at::BFloat16* y, int64_t ld, int64_t rows, int64_t cols) {
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(c + 16 * r));
    _mm256_mask_storeu_epi16(y + r * ld, mask, (__m256i)v);
  }
}

// Rows [m0, m1) of x (whole tiles but the last) against output pairs [pair0, pair1): C tiles
// 0-3 are two row tiles by the pair's two blocks, one K pass each. While the first row tiles
// meet a pair, the tiles of the next pair below `prefetch_end` are fetched into L2.
void tile_pass(const at::BFloat16* x, const at::BFloat16* x_tail, int64_t rows, int64_t in_features,
               int64_t out_features, const uint16_t* w, at::BFloat16* y, int64_t m0, int64_t m1, int64_t pair0,
               int64_t pair1, int64_t prefetch_end, bool stream, Layout layout) {
  const int64_t groups = in_features / kGroup, blocks = (out_features + kBlockRows - 1) / kBlockRows;
  const int64_t stride = in_features * 2, half = out_features / 2;
  alignas(64) float c[4][256];
  const auto tile = [&](int64_t pair, int64_t g, int64_t t) { return w + ((2 * pair + t) * groups + g) * kTileValues; };
  for (int64_t pair = pair0; pair < pair1; ++pair) {
    const int64_t b0 = 2 * pair, nb = std::min<int64_t>(2, blocks - b0);
    for (int64_t r = m0; r < m1; r += 32) {
      const int64_t nm = r + 16 < m1 ? 2 : 1;
      const auto row_tile = [&](int64_t i) {  // the partial last tile reads the zero-padded copy
        return r + 16 * i + 16 <= rows ? x + (r + 16 * i) * in_features : x_tail;
      };
      const at::BFloat16 *a0 = row_tile(0), *a1 = nm > 1 ? row_tile(1) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < groups; ++g) {
        if (r == m0 && pair + 1 < prefetch_end) {
          for (int64_t t = 0; t < std::min<int64_t>(2, blocks - b0 - 2); ++t) {
            const char* next = reinterpret_cast<const char*>(tile(pair + 1, g, t));
            for (int line = 0; line < 1024; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
          }
        }
        _tile_loadd(4, a0 + g * kGroup, stride);
        _tile_loadd(6, tile(pair, g, 0), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nb > 1) {
          _tile_loadd(7, tile(pair, g, 1), 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (nm > 1) {
          _tile_loadd(5, a1 + g * kGroup, stride);
          _tile_dpbf16ps(2, 5, 6);
          if (nb > 1) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int64_t i = 0; i < nm; ++i) {
        const int64_t rt = r + 16 * i, nr = std::min<int64_t>(16, rows - rt);
        if (layout == kSiluMul) {
          store_silu_mul(c[2 * i], c[2 * i + 1], y + rt * half + pair * kBlockRows, half, nr);
          continue;
        }
        if (layout == kGateUpHalves) {
          store_tile(c[2 * i], y + rt * out_features + pair * kBlockRows, out_features, nr, 16);
          store_tile(c[2 * i + 1], y + rt * out_features + half + pair * kBlockRows, out_features, nr, 16);
          continue;
        }
        if (stream && nb == 2) {
          stream_pair(c[2 * i], c[2 * i + 1], y + rt * out_features + b0 * kBlockRows, out_features, nr);
          continue;
        }
        for (int64_t t = 0; t < nb; ++t) {
          const int64_t n0 = (b0 + t) * kBlockRows;
          store_tile(c[2 * i + t], y + rt * out_features + n0, out_features, nr, std::min<int64_t>(16, out_features - n0));
        }
      }
    }
  }
}

// One thread's output pairs [pair0, pair1) for all rows, blocked so that the pairs' weights
// (a panel of about 256 KB) and a chunk of x's rows stay in L2 while every row tile of the
// chunk meets every pair of the panel: the weights stream from memory once a call, and
// at prefill sizes x's chunk is not re-read from L3 for each pair.
void gemm_pairs(const at::BFloat16* x, const at::BFloat16* x_tail, int64_t rows, int64_t in_features,
                int64_t out_features, const uint16_t* w, at::BFloat16* y, int64_t pair0, int64_t pair1, bool stream,
                Layout layout) {
  constexpr int64_t kPanelBytes = 256 * 1024, kChunkBytes = 256 * 1024;
  const int64_t pair_bytes = in_features / kGroup * 2 * kTileValues * 2;
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / pair_bytes);
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (in_features * 2) / 32 * 32);
  configure_tiles();
  for (int64_t p = pair0; p < pair1; p += panel) {
    for (int64_t m = 0; m < rows; m += chunk) {
      // The first chunk of rows reads the panel from memory: prefetch across the panel's end
      // too, so the next panel's first pair is on its way.
      tile_pass(x, x_tail, rows, in_features, out_features, w, y, m, std::min(rows, m + chunk), p,
                std::min(pair1, p + panel), m == 0 ? pair1 : 0, stream, layout);
    }
  }
  if (stream) _mm_sfence();  // the streamed rows are visible before the call returns
  _tile_release();  // leave no tile state for others on this thread (oneDNN configures its own)
}

#endif  // GEMEL_AMX

bool amx_bf16_gemm_available() { return amx_usable(); }

#if defined(GEMEL_AMX)
// x's last, partial tile of rows as a zero-padded copy (undefined when rows % 16 == 0).
at::Tensor padded_tail(const at::Tensor& xc) {
  const int64_t rows = xc.size(0), tail_rows = rows % 16;
  if (tail_rows == 0) return {};
  auto tail = at::zeros({16, xc.size(1)}, xc.options());
  tail.narrow(0, 0, tail_rows).copy_(xc.narrow(0, rows - tail_rows, tail_rows));
  return tail;
}
#endif

at::Tensor amx_bf16_gemm(const at::Tensor& x, const at::Tensor& w_tiles, int64_t out_features, int64_t gated) {
  TORCH_CHECK(amx_usable(), "amx_bf16_gemm needs a CPU with AMX-BF16 and a kernel build for it");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  const int64_t rows = x.size(0), in_features = x.size(1), groups = in_features / kGroup;
  const int64_t blocks = (out_features + kBlockRows - 1) / kBlockRows;
  TORCH_CHECK(in_features % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(w_tiles.scalar_type() == at::kBFloat16 && w_tiles.is_contiguous() && w_tiles.dim() == 3 &&
                  w_tiles.size(0) == blocks && w_tiles.size(1) == groups && w_tiles.size(2) == kTileValues,
              "w_tiles: contiguous bf16 [blocks, groups, 512] (pack_amx_tiles)");
  TORCH_CHECK(gated >= kPlain && gated <= kSiluMul, "gated: 0 (plain), 1 (gate/up halves) or 2 (silu(gate) * up)");
  const auto layout = static_cast<Layout>(gated);
  TORCH_CHECK(layout == kPlain || out_features % 32 == 0,
              "gate/up tiles need out_features a multiple of 32 (pack_amx_tiles(..., gate_up=True))");
  auto y = at::empty({rows, layout == kSiluMul ? out_features / 2 : out_features}, x.options());
#if defined(GEMEL_AMX)
  if (rows == 0) return y;
  const auto xc = x.contiguous();
  const auto tail = padded_tail(xc);
  const auto* tp = tail.defined() ? tail.data_ptr<at::BFloat16>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(w_tiles.data_ptr<at::BFloat16>());
  // Stream outputs of 1 MB and more (whole pairs, 64-byte aligned rows): the logits of the LM
  // head at decode sizes; smaller ones stay in cache for the op that reads them next.
  constexpr int64_t kStreamBytes = 1 << 20;
  const bool stream = layout == kPlain && rows * out_features * 2 >= kStreamBytes && out_features % 32 == 0 &&
                      reinterpret_cast<uintptr_t>(y.data_ptr()) % 64 == 0;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    gemm_pairs(xc.data_ptr<at::BFloat16>(), tp, rows, in_features, out_features, wp, y.data_ptr<at::BFloat16>(), p0, p1,
               stream, layout);
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("amx_bf16_gemm(Tensor x, Tensor w_tiles, int out_features, int gated=0) -> Tensor");
  m.def("amx_bf16_gemm_available() -> bool", &amx_bf16_gemm_available);
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) {
  m.impl("amx_bf16_gemm", &amx_bf16_gemm);
}
