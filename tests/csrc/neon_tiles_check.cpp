// Checks gemel/layers/csrc/int8_act_neon.h against int8_act_gemm's weight layout written out:
// for each kind of codes the kernel takes (4-bit with offsets or a zero point, 5-bit, 8-bit, and
// scales per 16 codes on 8- and 6-bit codes), float32 and float16 scales, and calls whose rows and
// outputs do not fill a tile or a block. Built for 64-bit ARM, with the dot-product extension and
// without, and run under an emulator by tests/unit/test_neon_tiles.py; prints "ok <cases>" or the
// first mismatch and exits 1.
#include "../../gemel/layers/csrc/int8_act_neon.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using gemel::int8_act::kBlockRows;
using gemel::int8_act::kGroup;

struct Kind {
  const char* name;
  int bits;        // 4, 5, 6 or 8
  int zero_point;  // 0: float offsets
  bool sub16;      // a scale per 16 codes
};

std::mt19937 rng(1234);

int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
float uniform_f(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

// Packs codes u [out, in] (0 .. 2^bits - 1) into the kernel's layout.
std::vector<uint8_t> pack(const std::vector<int>& u, int bits, int64_t out, int64_t in) {
  const int64_t blocks = (out + kBlockRows - 1) / kBlockRows, groups = in / kGroup;
  const int64_t group_bytes = bits == 4 ? 256 : bits == 5 ? 320 : 512;
  std::vector<uint8_t> w(blocks * groups * group_bytes, 0);
  for (int64_t o = 0; o < out; ++o) {
    const int64_t b = o / kBlockRows, i = o % kBlockRows;
    for (int64_t k = 0; k < in; ++k) {
      const int64_t g = k / kGroup, j = (k % kGroup) / 4, c = k % 4;
      uint8_t* wg = w.data() + (b * groups + g) * group_bytes;
      const int code = u[o * in + k];
      if (bits == 4 || bits == 5) {
        wg[(j % 4) * 64 + 4 * i + c] |= static_cast<uint8_t>(j < 4 ? (code & 15) : (code & 15) << 4);
        if (bits == 5) wg[256 + 4 * i + c] |= static_cast<uint8_t>(((code >> 4) & 1) << j);
      } else {
        wg[j * 64 + 4 * i + c] = static_cast<uint8_t>(code);
      }
    }
  }
  return w;
}

template <typename S>
bool check(const Kind& kind, int64_t rows, int64_t out, int64_t groups) {
  const int64_t in = groups * kGroup, blocks = (out + kBlockRows - 1) / kBlockRows;
  const int top = (1 << kind.bits) - 1;
  std::vector<int> u(out * in);
  for (auto& code : u) code = uniform(0, top);
  const std::vector<uint8_t> w = pack(u, kind.bits, out, in);
  const int64_t per_group = (kind.sub16 ? 2 : 1) * kBlockRows;
  std::vector<S> d(blocks * groups * per_group), low(kind.zero_point ? 0 : d.size());
  for (auto& s : d) s = static_cast<S>(uniform_f(0.001f, 0.05f));
  for (auto& s : low) s = static_cast<S>(uniform_f(-0.5f, 0.5f));
  std::vector<int8_t> x(rows * in);
  for (auto& c : x) c = static_cast<int8_t>(uniform(-127, 127));
  std::vector<float> unit(rows * groups), code_sum(rows * groups);
  std::vector<int32_t> zero_sum(kind.zero_point ? rows * groups * (kind.sub16 ? 2 : 1) : 0);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      int32_t total = 0, first = 0;
      for (int64_t k = 0; k < kGroup; ++k) {
        total += x[m * in + g * kGroup + k];
        if (k < 16) first += x[m * in + g * kGroup + k];
      }
      unit[m * groups + g] = uniform_f(0.001f, 0.1f);
      code_sum[m * groups + g] = unit[m * groups + g] * static_cast<float>(total);
      if (kind.sub16) {
        zero_sum[(m * groups + g) * 2] = kind.zero_point * first;
        zero_sum[(m * groups + g) * 2 + 1] = kind.zero_point * (total - first);
      } else if (kind.zero_point) {
        zero_sum[m * groups + g] = kind.zero_point * total;
      }
    }
  }
  const float sentinel = 12345.f;
  std::vector<float> y(rows * out, sentinel);
  const auto run = [&](auto nibbles, auto int_zero, auto sub16, auto five) {
    gemel::neon::gemm_blocks<decltype(nibbles)::value, decltype(int_zero)::value, decltype(sub16)::value,
                             decltype(five)::value>(x.data(), unit.data(), code_sum.data(),
                                                    zero_sum.empty() ? nullptr : zero_sum.data(), w.data(), d.data(),
                                                    low.empty() ? nullptr : low.data(), y.data(), rows, in, out, 0,
                                                    blocks);
  };
  using Y = std::true_type;
  using N = std::false_type;
  if (kind.bits == 4 && kind.zero_point) run(Y{}, Y{}, N{}, N{});
  else if (kind.bits == 4) run(Y{}, N{}, N{}, N{});
  else if (kind.bits == 5) run(Y{}, Y{}, N{}, Y{});
  else if (kind.sub16) run(N{}, Y{}, Y{}, N{});
  else if (kind.zero_point) run(N{}, Y{}, N{}, N{});
  else run(N{}, N{}, N{}, N{});
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t o = 0; o < out; ++o) {
      const int64_t b = o / kBlockRows, i = o % kBlockRows;
      double expect = 0., scale = 0.;
      for (int64_t g = 0; g < groups; ++g) {
        int64_t dots[2] = {0, 0};
        for (int64_t k = 0; k < kGroup; ++k) dots[k / 16] += int64_t{u[o * in + g * kGroup + k]} * x[m * in + g * kGroup + k];
        const double xu = unit[m * groups + g];
        // scale: the sum of the terms' magnitudes, which bounds float32's rounding of them
        if (kind.sub16) {
          for (int h = 0; h < 2; ++h) {
            const double term =
                (dots[h] - zero_sum[(m * groups + g) * 2 + h]) * static_cast<double>(d[(b * groups + g) * 32 + h * 16 + i]) * xu;
            expect += term;
            scale += std::fabs(term);
          }
        } else {
          const int64_t at = (b * groups + g) * kBlockRows + i;
          const int64_t dot = dots[0] + dots[1] - (kind.zero_point ? zero_sum[m * groups + g] : 0);
          const double scaled = dot * static_cast<double>(d[at]) * xu;
          const double offset = kind.zero_point ? 0. : static_cast<double>(low[at]) * code_sum[m * groups + g];
          expect += scaled + offset;
          scale += std::fabs(scaled) + std::fabs(offset);
        }
      }
      const float got = y[m * out + o];
      if (!(std::fabs(got - expect) <= 1e-5 * scale + 1e-6)) {
        std::printf("mismatch: %s, %s scales, rows %lld, outputs %lld, groups %lld: y[%lld, %lld] = %.7g, expected %.7g\n",
                    kind.name, sizeof(S) == 4 ? "float32" : "float16", static_cast<long long>(rows),
                    static_cast<long long>(out), static_cast<long long>(groups), static_cast<long long>(m),
                    static_cast<long long>(o), got, expect);
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main() {
  const Kind kinds[] = {
      {"4-bit with offsets (Q4_1)", 4, 0, false}, {"4-bit, zero point 8 (Q4_0)", 4, 8, false},
      {"5-bit, zero point 16 (Q5_0)", 5, 16, false}, {"8-bit, zero point 128 (Q8_0)", 8, 128, false},
      {"8-bit with offsets", 8, 0, false}, {"8-bit, a scale per 16 codes (Q6_K as bytes)", 8, 128, true},
      {"6-bit, a scale per 16 codes (Q6_K)", 6, 32, true},
  };
  int cases = 0;
  for (const Kind& kind : kinds) {
    for (int64_t rows : {1, 2, 3, 4, 5, 7, 9}) {
      for (int64_t out : {1, 5, 16, 20, 37}) {
        for (int64_t groups : {1, 3}) {
          if (!check<float>(kind, rows, out, groups) || !check<__fp16>(kind, rows, out, groups)) return 1;
          cases += 2;
        }
      }
    }
  }
  std::printf("ok %d\n", cases);
  return 0;
}
