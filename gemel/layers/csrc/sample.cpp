// Random sampling from each row's softmax(logits / temperature), one row per sequence, with
// top-k, top-p and min-p, by inverting the distribution's cumulative sum at one uniform draw u per row: the
// token is the first whose running sum of exp((logit - max) / T) passes u times the row's
// total. One uniform a row rather than one exponential per vocabulary entry (the exponential
// race PyTorch's path uses): drawing those cost 33 ms a step for 32 rows of SmolLM2's 49,152
// logits and 180 ms for Gemma 3's 262,144 on two threads, more than the step's forward; this
// reads each logit twice and computes its exponential once or twice.
//
// A row is cut into fixed chunks (kChunk logits), so the sums and the answer do not depend on
// the number of threads, and a single row still splits over them (batch 1).
//
// Rows cut by top-k or top-p are drawn from their candidates alone, found without sorting the
// vocabulary: the tokens at or above the k-th largest logit (a bounded heap), and for top-p a
// selection over the tokens heavy enough to matter, less the octaves of weight below the one that
// holds the crossing; one pass over the row at most. PyTorch's sort of the whole [rows, vocab] tensor took 80 ms for 32
// rows of SmolLM2's logits and 440-500 ms for Gemma 3's. Ties at the floor are kept (vLLM's
// top-k keeps them too). Rows with
// temperature 0 get the greedy token (the first largest logit); a row with a NaN or +inf gets
// torch.argmax's answer (the first NaN, else the first +inf); a row with no finite logit (all
// masked) its first entry.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 2048;
constexpr float kGreedyBelow = 1e-5f;  // temperatures under this are greedy (as SamplingParams)

// Bit tests: the kernels are built with -ffast-math, under which the compiler may fold
// std::isnan and std::isinf to false.
constexpr uint32_t kAbsMask = 0x7FFFFFFFu, kInfBits = 0x7F800000u;
inline uint32_t magnitude_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & kAbsMask;
}
inline bool is_finite(float v) { return magnitude_bits(v) < kInfBits; }

struct ChunkPeak {
  float peak;   // largest finite logit of the chunk (the lowest float where it has none)
  bool finite;  // it has one
  bool nan;
  bool pos_inf;
};

ChunkPeak chunk_peak(const float* x, int64_t n) {
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  float peak = kLowest;
  int finite = 0, nan = 0, pos_inf = 0;
  for (int64_t i = 0; i < n; ++i) {  // no branch, the tests on bits
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    const uint32_t m = bits & kAbsMask;
    nan |= m > kInfBits;
    pos_inf |= bits == kInfBits;
    finite |= m < kInfBits;
    peak = std::max(peak, m < kInfBits ? x[i] : kLowest);
  }
  return {peak, finite != 0, nan != 0, pos_inf != 0};
}

// e[i] = exp((x[i] - peak) / T); 0 below min_p (relative to the peak's 1) and for -inf logits.
// The same function serves the chunk sums and the walk, so both see the same values.
void chunk_weights(const float* x, int64_t n, float peak, float inv_temperature, float min_p, float* e) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float z = std::max((x[i] - peak) * inv_temperature, -104.f);  // exp(-104) is 0 in float32
    const float w = std::exp(z);
    e[i] = w >= min_p && is_finite(x[i]) ? w : 0.f;
  }
}

int64_t first_max(const float* x, int64_t n, float peak) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == peak) return i;
  return 0;
}

// The indices, in increasing order, of a row's finite logits at or above its k-th largest finite
// logit (ties included; every finite one where there are k or fewer). The maxima of
// blocks of 64 logits come first (a vectorised pass): at least k blocks reach the k-th largest
// of them, so at least k logits do, and only the blocks that reach it can hold the answer or a
// candidate. A min-heap of the k largest seen then goes over those blocks alone (on Gemma 3's
// 262,144 logits and top_k 64, about a hundred blocks instead of every logit).
std::vector<int64_t> top_k_candidates(const float* x, int64_t n, int64_t k) {
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> maxima(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kBlock, i1 = std::min(n, i0 + kBlock);
    float m = kLowest;
#pragma omp simd reduction(max : m)
    for (int64_t i = i0; i < i1; ++i) m = std::max(m, is_finite(x[i]) ? x[i] : kLowest);
    maxima[b] = m;
  }
  float bound = kLowest;
  if (blocks > k) {
    std::vector<float> ranked(maxima);
    std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(), std::greater<float>());
    bound = ranked[k - 1];
  }
  std::vector<float> heap;
  heap.reserve(k);
  for (int64_t b = 0; b < blocks; ++b) {
    if (maxima[b] < bound) continue;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      if (!is_finite(x[i])) continue;
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push_back(x[i]);
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      } else if (x[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = x[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
  }
  const float floor = heap.empty() ? kLowest : heap.front();
  std::vector<int64_t> at_or_above;
  for (int64_t b = 0; b < blocks; ++b) {
    if (maxima[b] < floor) continue;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      if (x[i] >= floor && is_finite(x[i])) at_or_above.push_back(i);
  }
  return at_or_above;
}

// A token of a row cut by top-k or top-p: its weight exp((logit - peak) / T), logit, index.
struct Candidate {
  float weight, logit;
  int64_t index;
};

// Drops candidates lighter than the power of two under the token where the running mass, heaviest
// first, reaches `need` (top-p's crossing token), without ordering them: each candidate's weight
// (at most the peak's 1) goes to the octave its float exponent names, and the octaves' masses are
// added from the heaviest down. Under a flat distribution the tokens heavy enough to matter can
// be thousands (11,208 of SmolLM2's 49,152 on a chat reply at temperature 0.7, of which top_p
// 0.9 keeps 345), and ordering them all had cost more than the rest of the row.
void cut_below_crossing_octave(std::vector<Candidate>& kept, double need) {
  constexpr int kOctaves = 64;  // 2^-63 and lighter share the last
  constexpr size_t kWorthCutting = 64;  // fewer candidates are ordered as fast as counted
  if (kept.size() < kWorthCutting) return;
  std::array<double, kOctaves> mass{};
  for (const Candidate& c : kept) {
    uint32_t bits;
    std::memcpy(&bits, &c.weight, sizeof bits);
    const int octave = std::min(kOctaves - 1, std::max(0, 127 - static_cast<int>(bits >> 23)));
    mass[octave] += c.weight;
  }
  // The first octave whose running mass passes `need` with room for the sums' rounding holds the
  // crossing token or one heavier; every token the crossing needs is at or above its floor.
  double running = 0.0;
  for (int octave = 0; octave < kOctaves - 1; ++octave) {
    running += mass[octave];
    if (running >= (1.0 + 1e-6) * need) {
      const float floor = std::ldexp(1.f, -octave);  // the octave's lightest weight
      kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Candidate& c) { return c.weight < floor; }),
                 kept.end());
      return;
    }
  }
}

// The row's token for a draw u when top-k or top-p cut it: its candidates (the tokens whose
// logit is at least the k-th largest; or, with top-p alone, those heavy enough to matter),
// then top-p's floor among them, min-p, and the walk over what stays in vocabulary order, as
// the uncut rows' walk goes. With top-p alone, tokens lighter than a quarter of (1 - top_p) / n
// of the total are cut whatever the others weigh (all of them together hold less than the
// (1 - top_p) that is cut), so only the heavier ones are ordered, by selection. Top-p's rule is
// PyTorch's: in descending order a token stays while the mass strictly before it is under
// top_p, so the token whose weight brings the running mass to top_p is the last kept.
int64_t sample_cut_row(const float* x, int64_t n, float peak, float inv_temperature, int64_t top_k, float top_p,
                       float min_p, double u) {
  std::vector<Candidate> kept;
  double total = 0.0;  // of every token top-k keeps: what top_p is a share of
  if (top_k > 0 && top_k < n) {
    std::vector<float> logits;
    for (const int64_t i : top_k_candidates(x, n, top_k)) {
      kept.push_back({0.f, x[i], i});
      logits.push_back(x[i]);
    }
    std::vector<float> e(logits.size());
    chunk_weights(logits.data(), static_cast<int64_t>(logits.size()), peak, inv_temperature, 0.f, e.data());
    for (size_t k = 0; k < kept.size(); ++k) {
      kept[k].weight = e[k];
      total += e[k];
    }
  } else {
    std::vector<float> e(n);
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t len = std::min(kChunk, n - c);
      chunk_weights(x + c, len, peak, inv_temperature, 0.f, e.data() + c);
      for (int64_t i = c; i < c + len; ++i) total += e[i];
    }
    // float, rounded down, and at least the smallest positive float: no fewer candidates than
    // the double bound keeps, and never a zero weight.
    const float light = std::max(std::nextafter(static_cast<float>(0.25 * (1.0 - top_p) * total / static_cast<double>(n)), 0.f),
                                 std::numeric_limits<float>::denorm_min());
    // Their indices first, without a branch (about a fifth of a flat row passes, at random).
    std::vector<int32_t> heavy(n);
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      heavy[count] = static_cast<int32_t>(i);
      count += e[i] >= light;
    }
    kept.reserve(count);
    for (int64_t j = 0; j < count; ++j) kept.push_back({e[heavy[j]], x[heavy[j]], heavy[j]});
  }
  if (top_p < 1.f && !kept.empty()) {
    double need = top_p * total;  // mass the kept tokens must reach
    cut_below_crossing_octave(kept, need);
    auto lo = kept.begin(), hi = kept.end();  // the crossing token lies in [lo, hi)
    while (hi - lo > 1) {
      auto mid = lo + (hi - lo) / 2;
      std::nth_element(lo, mid, hi, [](const Candidate& a, const Candidate& b) { return a.weight > b.weight; });
      double upper = 0.0;  // mass of [lo, mid), all at least as heavy as *mid
      for (auto it = lo; it != mid; ++it) upper += it->weight;
      if (upper >= need) {
        hi = mid;  // the crossing is among the heavier ones
      } else {
        need -= upper;
        lo = mid;
      }
    }
    const float floor = lo->logit;  // ties with the crossing token stay too
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Candidate& c) { return c.logit < floor; }), kept.end());
  }
  kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Candidate& c) { return !(c.weight > 0.f && c.weight >= min_p); }),
             kept.end());
  if (kept.empty()) return first_max(x, n, peak);
  std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.index < b.index; });
  double sum = 0.0;
  for (const auto& c : kept) sum += c.weight;
  const double target = u * sum;
  double running = 0.0;
  for (const auto& c : kept) {
    running += c.weight;
    if (running > target) return c.index;
  }
  return kept.back().index;  // past the end by rounding
}


// A row with a NaN or +inf: torch.argmax's answer, the first NaN, else the first +inf.
int64_t first_special(const float* x, int64_t n, bool nan) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    if (nan ? (bits & kAbsMask) > kInfBits : bits == kInfBits) return i;
  }
  return 0;
}

// logits [rows, vocab] float32; temperature, top_p, min_p [rows] float32; top_k [rows] int64
// (vocab or more, or 0 or less: off); uniform [rows] float64 in [0, 1) -> [rows] int64.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_rows: logits float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: empty rows");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows, "temperature: float32 [rows]");
  TORCH_CHECK(min_p.scalar_type() == at::kFloat && min_p.numel() == rows, "min_p: float32 [rows]");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.numel() == rows, "top_p: float32 [rows]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == rows, "top_k: int64 [rows]");
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.numel() == rows, "uniform: float64 [rows]");
  const auto x = logits.contiguous();
  const auto t = temperature.contiguous(), mp = min_p.contiguous(), u = uniform.contiguous();
  const auto tk = top_k.contiguous(), tpp = top_p.contiguous();
  const float* xp = x.data_ptr<float>();
  const float *tp = t.data_ptr<float>(), *mpp = mp.data_ptr<float>(), *top_pp = tpp.data_ptr<float>();
  const int64_t* top_kp = tk.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  const auto chunk_len = [&](int64_t c) { return std::min(kChunk, vocab - c * kChunk); };

  // Pass 1: each chunk's largest finite logit, and whether it holds a NaN.
  std::vector<ChunkPeak> peaks(rows * chunks);
  at::parallel_for(0, rows * chunks, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / chunks, c = i % chunks;
      peaks[i] = chunk_peak(xp + r * vocab + c * kChunk, chunk_len(c));
    }
  });
  std::vector<ChunkPeak> row(rows, ChunkPeak{std::numeric_limits<float>::lowest(), false, false, false});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const ChunkPeak& p = peaks[r * chunks + c];
      row[r].peak = std::max(row[r].peak, p.peak);
      row[r].finite |= p.finite;
      row[r].nan |= p.nan;
      row[r].pos_inf |= p.pos_inf;
    }
  }
  const auto special = [&](int64_t r) { return row[r].nan || row[r].pos_inf; };
  const auto sampled = [&](int64_t r) { return !special(r) && row[r].finite && tp[r] >= kGreedyBelow; };

  // Rows cut by top-k or top-p: their token from their candidates alone (sample_cut_row).
  const auto cut = [&](int64_t r) { return (top_kp[r] > 0 && top_kp[r] < vocab) || top_pp[r] < 1.f; };
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      if (sampled(r) && cut(r))
        op[r] = sample_cut_row(xp + r * vocab, vocab, row[r].peak, 1.f / tp[r], top_kp[r], top_pp[r], mpp[r], up[r]);
  });
  const auto walked = [&](int64_t r) { return sampled(r) && !cut(r); };

  // Pass 2: each chunk's sum of weights (float within a chunk, double across them).
  std::vector<double> sums(rows * chunks, 0.0);
  at::parallel_for(0, rows * chunks, 4, [&](int64_t i0, int64_t i1) {
    float e[kChunk];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / chunks, c = i % chunks, n = chunk_len(c);
      if (!walked(r)) continue;
      chunk_weights(xp + r * vocab + c * kChunk, n, row[r].peak, 1.f / tp[r], mpp[r], e);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < n; ++k) s += e[k];
      sums[i] = s;
    }
  });

  // Pass 3: the chunk where the running sum passes u * total, then the token within it.
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    float e[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      const float* x_r = xp + r * vocab;
      if (special(r)) {
        op[r] = first_special(x_r, vocab, row[r].nan);
        continue;
      }
      if (!sampled(r)) {  // greedy, or no finite logit (then the first entry)
        op[r] = row[r].finite ? first_max(x_r, vocab, row[r].peak) : 0;
        continue;
      }
      if (!walked(r)) continue;  // cut: answered above
      const double* s = sums.data() + r * chunks;
      double total = 0.0;
      for (int64_t c = 0; c < chunks; ++c) total += s[c];
      double target = up[r] * total, before = 0.0;
      int64_t c = 0;
      while (c + 1 < chunks && (before + s[c] <= target || s[c] == 0.0)) before += s[c++];
      while (c > 0 && s[c] == 0.0) before -= s[--c];  // the walk ran past the last weight
      const int64_t n = chunk_len(c);
      chunk_weights(x_r + c * kChunk, n, row[r].peak, 1.f / tp[r], mpp[r], e);
      const double residual = target - before;
      double running = 0.0;
      int64_t pick = -1, last = 0;
      for (int64_t k = 0; k < n; ++k) {
        if (e[k] == 0.f) continue;
        last = k;
        running += e[k];
        if (running > residual) {
          pick = k;
          break;
        }
      }
      op[r] = c * kChunk + (pick >= 0 ? pick : last);  // past the end by rounding: the chunk's last weight
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) { m.impl("sample_rows", &sample_rows); }
