// Cycles a row of x and a group of 32 inputs x 8 outputs (256 products) cost in standalone copies
// of int8_act_gemm's AVX2 tiles (4 rows of x x 8 outputs, weights and x hot in L1, one core),
// with variants that take parts away, and throughput loops of the instructions they mix. It
// shows how close the tiles run to the CPU's vector-integer multiplier, which on AMD Zen 2 is one
// pipe shared by vpmaddubsw and vpmaddwd (and by vpsignb and the float multiplies with one other).
//
//     g++ -O3 -march=native -std=c++17 bench/avx2_tile_cycles.cpp -o /tmp/avx2_tile_cycles
//     /tmp/avx2_tile_cycles [GHz]     # GHz: the core's clock (default: timed on a chain of adds)
//
// The layout and arithmetic are those of gemel/layers/csrc/int8_act_gemm.cpp (tile_half): 4-bit
// codes two to a byte, summed in int16 over a group, widened once; 8-bit codes by the sign trick
// (|s| times x with s's sign), widened every step. Timing only: the weights are random bytes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace {

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

constexpr int kRows = 4, kGroup = 32;

inline int32_t four_codes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return four;
}

struct Data {
  int64_t in_features, groups;
  std::vector<int8_t> x;  // kRows rows of int8 codes
  std::vector<int16_t> x16;  // the same codes as int16 (the vpmaddwd variant)
  std::vector<float> unit, code_sum, d, low;
  std::vector<int32_t> zero_sum;
  std::vector<uint8_t> w;  // one output block's codes, 512 bytes a group (the 4-bit tiles use 256)
  mutable std::vector<float> y;  // the tiles' output, written through a const Data
  explicit Data(int64_t k) : in_features(k), groups(k / kGroup) {
    x.resize(kRows * k);
    for (auto& v : x) v = static_cast<int8_t>(std::rand() % 255 - 127);
    x16.assign(x.begin(), x.end());
    unit.assign(kRows * groups, 0.01f);
    code_sum.assign(kRows * groups, 1.f);
    zero_sum.assign(kRows * groups, 3);
    d.assign(groups * 16, 0.1f);
    low.assign(groups * 16, 0.2f);
    w.resize(groups * 512);
    for (auto& v : w) v = static_cast<uint8_t>(1 + std::rand() % 255);
    y.resize(kRows * 16);
  }
};

// How the 4-bit tile scales a group's sums: kFloat as the kernel does (Q4_1: the weights' and
// x's scales multiplied, then an FMA, and an FMA for the offset); kNone: the int32 sums only
// added up (what the multiplies and their adds alone cost); kWeightInMadd: the weights' scales
// as int16 (fixed point, a unit per output) taken as vpmaddwd's multiplier instead of ones, so
// that the float part is an FMA by x's scale and the offset's FMA (one float multiply fewer).
enum class Scale { kNone, kFloat, kWeightInMadd };

template <Scale kScale>
__attribute__((noinline)) void tile4(const Data& a, int half) {
  const __m256i ones = _mm256_set1_epi16(1), low_nibbles = _mm256_set1_epi8(0x0F);
  __m256 acc[kRows];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const int8_t* xg = a.x.data() + g * kGroup;
    const uint8_t* wg = a.w.data() + g * 256 + half * 32;
    __m256i sum16[kRows], dot[kRows];
    const auto step = [&](int j, bool fresh) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
      const __m256i lo = _mm256_and_si256(v, low_nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* xr = xg + r * a.in_features;
        const __m256i p = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_codes(xr + j * 4)));
        const __m256i q = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_codes(xr + (j + 4) * 4)));
        sum16[r] = fresh ? _mm256_add_epi16(p, q) : _mm256_add_epi16(sum16[r], _mm256_add_epi16(p, q));
      }
    };
    step(0, true);
#pragma GCC unroll 1
    for (int j = 1; j < kGroup / 8; ++j) step(j, false);
    if constexpr (kScale == Scale::kWeightInMadd) {
      const __m256i dw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.w.data() + g * 16)));
      const __m256 lv = _mm256_loadu_ps(a.low.data() + g * 16 + half * 8);
      for (int r = 0; r < kRows; ++r) {
        dot[r] = _mm256_madd_epi16(sum16[r], dw);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(a.unit[r * a.groups + g]), acc[r]);
        acc[r] = _mm256_fmadd_ps(lv, _mm256_set1_ps(a.code_sum[r * a.groups + g]), acc[r]);
      }
      continue;
    }
    for (int r = 0; r < kRows; ++r) dot[r] = _mm256_madd_epi16(sum16[r], ones);
    if constexpr (kScale == Scale::kFloat) {
      const __m256 dv = _mm256_loadu_ps(a.d.data() + g * 16 + half * 8), lv = _mm256_loadu_ps(a.low.data() + g * 16 + half * 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(a.unit[r * a.groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
        acc[r] = _mm256_fmadd_ps(lv, _mm256_set1_ps(a.code_sum[r * a.groups + g]), acc[r]);
      }
    } else {
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(acc[r]), dot[r]));
    }
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(a.y.data() + r * 16 + half * 8, acc[r]);
}

// How the 8-bit tile gives x the weight's sign (kSign), or leaves it (timing what that costs);
// kInt16: no sign trick at all, the codes widened to int16 once a step for the 4 rows and
// multiplied by x as int16 with vpmaddwd alone (two multiplies per 32 products, as the sign
// trick needs, but nothing else on the multiplier's pipes); kTwoSteps: the sign trick with two
// steps' int16 pair sums added before one vpmaddwd widens them (12 multiplies instead of 16),
// which is exact only where each 4 products stay within int16 (timing only).
enum class Eight { kSign, kNoSign, kInt16, kTwoSteps };

template <Eight kHow, bool kScale>
__attribute__((noinline)) void tile8(const Data& a, int half) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[kRows];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = a.w.data() + g * 512 + half * 32;
    __m256i dot[kRows];
    if constexpr (kHow == Eight::kInt16) {
      __m256i dlo[kRows], dhi[kRows];  // outputs 0-3 and 4-7, each as two int32 halves
      const auto step = [&](int j, bool fresh) {
        const __m256i s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
        const __m256i wlo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s));
        const __m256i whi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s, 1));
        for (int r = 0; r < kRows; ++r) {
          int64_t four;
          std::memcpy(&four, a.x16.data() + r * a.in_features + g * kGroup + j * 4, 8);
          const __m256i xv = _mm256_set1_epi64x(four);
          const __m256i p = _mm256_madd_epi16(wlo, xv), q = _mm256_madd_epi16(whi, xv);
          dlo[r] = fresh ? p : _mm256_add_epi32(dlo[r], p);
          dhi[r] = fresh ? q : _mm256_add_epi32(dhi[r], q);
        }
      };
      step(0, true);
#pragma GCC unroll 1
      for (int j = 1; j < kGroup / 4; ++j) step(j, false);
      for (int r = 0; r < kRows; ++r) dot[r] = _mm256_hadd_epi32(dlo[r], dhi[r]);  // outputs permuted: timing only
    } else if constexpr (kHow == Eight::kTwoSteps) {
      const int8_t* xg = a.x.data() + g * kGroup;
      const auto two_steps = [&](int j, bool fresh) {
        const __m256i s0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
        const __m256i s1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + 64)), flip);
        const __m256i m0 = _mm256_abs_epi8(s0), m1 = _mm256_abs_epi8(s1);
        for (int r = 0; r < kRows; ++r) {
          const int8_t* xr = xg + r * a.in_features;
          const __m256i p = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(_mm256_set1_epi32(four_codes(xr + j * 4)), s0));
          const __m256i q = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(_mm256_set1_epi32(four_codes(xr + j * 4 + 4)), s1));
          const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(p, q), ones);
          dot[r] = fresh ? sums : _mm256_add_epi32(dot[r], sums);
        }
      };
      two_steps(0, true);
#pragma GCC unroll 2
      for (int j = 2; j < kGroup / 4; j += 2) two_steps(j, false);
    } else {
      const int8_t* xg = a.x.data() + g * kGroup;
      const auto step = [&](int j, bool fresh) {
        const __m256i s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
        const __m256i magnitude = _mm256_abs_epi8(s);
        for (int r = 0; r < kRows; ++r) {
          const __m256i xv = _mm256_set1_epi32(four_codes(xg + r * a.in_features + j * 4));
          const __m256i signed_x = kHow == Eight::kSign ? _mm256_sign_epi8(xv, s) : xv;
          const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
          dot[r] = fresh ? sums : _mm256_add_epi32(dot[r], sums);
        }
      };
      step(0, true);
#pragma GCC unroll 4
      for (int j = 1; j < kGroup / 4; ++j) step(j, false);
    }
    if constexpr (kScale) {
      const __m256 dv = _mm256_loadu_ps(a.d.data() + g * 16 + half * 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(a.unit[r * a.groups + g]));
        const __m256i centred = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(a.zero_sum[r * a.groups + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale, acc[r]);
      }
    } else {
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(acc[r]), dot[r]));
    }
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(a.y.data() + r * 16 + half * 8, acc[r]);
}

// Cycles per row and group: the median of 5 timings of `calls` calls.
template <typename F>
double cycles_per_row_group(F call, const Data& a, double ghz, long calls) {
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    const double t = now();
    for (long i = 0; i < calls; ++i) {
      call(a, static_cast<int>(i & 1));
      __asm__ volatile("" : : "r"(a.y.data()) : "memory");
    }
    runs.push_back((now() - t) * ghz * 1e9 / (static_cast<double>(calls) * kRows * a.groups));
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

// A chain of dependent adds: one a cycle, so this is the clock the core runs scalar code at.
double clock_ghz() {
  const long n = 400000000;
  uint64_t v = 1;
  const double t = now();
  for (long i = 0; i < n; i += 4) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(v));
  return n / (now() - t) / 1e9;
}

// Throughput loops: independent instances of the ops (no chains), cycles an iteration.
#define GEMEL_PIPE_LOOP(name, body)                                                                          \
  {                                                                                                          \
    const long n = 50000000;                                                                                 \
    const double t = now();                                                                                  \
    for (long i = 0; i < n; ++i)                                                                             \
      __asm__ volatile(body : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), \
                       "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11) : "x"(b));                                    \
    std::printf("| %-44s | %5.2f |\n", name, (now() - t) * ghz * 1e9 / n);                                   \
  }
#define MB(r) "vpmaddubsw %12, " #r ", " #r "\n\t"
#define MW(r) "vpmaddwd %12, " #r ", " #r "\n\t"
#define AW(r) "vpaddw %12, " #r ", " #r "\n\t"
#define SG(r) "vpsignb %12, " #r ", " #r "\n\t"
#define ML(r) "vmulps %12, " #r ", " #r "\n\t"
#define SR(r) "vpsrlw $4, " #r ", " #r "\n\t"

void pipe_loops(double ghz) {
  // The bits of 1.0f in every register: as bytes they multiply like any codes, and as floats
  // vmulps keeps them at 1 (small byte patterns read as floats underflow to denormals, whose
  // slow path the loop would time instead).
  __m256i a0 = _mm256_castps_si256(_mm256_set1_ps(1.0f)), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
          a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0, b = a0;
  std::printf("\n| throughput loop (independent ops) | cycles |\n|---|---|\n");
  GEMEL_PIPE_LOOP("4 vpmaddubsw", MB(%0) MB(%1) MB(%2) MB(%3))
  GEMEL_PIPE_LOOP("4 vpmaddubsw + 4 vpmaddwd", MB(%0) MB(%1) MB(%2) MB(%3) MW(%4) MW(%5) MW(%6) MW(%7))
  GEMEL_PIPE_LOOP("4 vpmaddubsw + 8 vpaddw", MB(%0) MB(%1) MB(%2) MB(%3) AW(%4) AW(%5) AW(%6) AW(%7) AW(%8) AW(%9) AW(%10) AW(%11))
  GEMEL_PIPE_LOOP("8 vpsignb", SG(%4) SG(%5) SG(%6) SG(%7) SG(%8) SG(%9) SG(%10) SG(%11))
  GEMEL_PIPE_LOOP("4 vpmaddubsw + 8 vpsignb", MB(%0) MB(%1) MB(%2) MB(%3) SG(%4) SG(%5) SG(%6) SG(%7) SG(%8) SG(%9) SG(%10) SG(%11))
  GEMEL_PIPE_LOOP("4 vpmaddubsw + 8 vmulps", MB(%0) MB(%1) MB(%2) MB(%3) ML(%4) ML(%5) ML(%6) ML(%7) ML(%8) ML(%9) ML(%10) ML(%11))
  GEMEL_PIPE_LOOP("8 vpsrlw", SR(%4) SR(%5) SR(%6) SR(%7) SR(%8) SR(%9) SR(%10) SR(%11))
}

}  // namespace

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : clock_ghz();
  const Data smollm2(576), gemma_head(640);
  std::printf("clock %.2f GHz%s; 4 rows of x x 8 outputs, hot in L1, one core\n\n", ghz, argc > 1 ? "" : " (chain of adds)");
  std::printf("| tile | multiplies a row and group | cycles a row and group | products a cycle |\n|---|---|---|---|\n");
  const auto row = [&](const char* name, int multiplies, double cycles) {
    std::printf("| %-52s | %2d | %5.2f | %4.1f |\n", name, multiplies, cycles, 256.0 / cycles);
  };
  row("4-bit (Q4_1), as the kernel", 9, cycles_per_row_group(tile4<Scale::kFloat>, smollm2, ghz, 2000000));
  row("4-bit, without the group's float scaling", 9, cycles_per_row_group(tile4<Scale::kNone>, smollm2, ghz, 2000000));
  row("4-bit, the weights' scales in vpmaddwd (int16)", 9, cycles_per_row_group(tile4<Scale::kWeightInMadd>, smollm2, ghz, 2000000));
  row("8-bit (Q8_0) sign trick, as the kernel", 16, cycles_per_row_group(tile8<Eight::kSign, true>, gemma_head, ghz, 1000000));
  row("8-bit sign trick, without the float scaling", 16, cycles_per_row_group(tile8<Eight::kSign, false>, gemma_head, ghz, 1000000));
  row("8-bit, neither the sign op nor the scaling (wrong sums)", 16, cycles_per_row_group(tile8<Eight::kNoSign, false>, gemma_head, ghz, 1000000));
  row("8-bit codes as int16, vpmaddwd alone, with scaling", 16, cycles_per_row_group(tile8<Eight::kInt16, true>, gemma_head, ghz, 1000000));
  row("8-bit, two steps a widening, with scaling (can overflow)", 12, cycles_per_row_group(tile8<Eight::kTwoSteps, true>, gemma_head, ghz, 1000000));
  pipe_loops(ghz);
  return 0;
}
