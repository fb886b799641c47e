// Attention over the paged KV cache, reading each sequence's keys and values where they lie
// in the cache instead of gathering them into a padded copy first. Decode (one query per
// sequence) and prefill (each query token of a prompt against its own causal prefix).
//
// One task per (query token, KV head): the GQA query heads that share that KV head are scored
// together, so each cached key and value row is read once per task; too few tasks to share out
// (one sequence decoding) have their keys cut into runs for the threads (KeyRun). Prefill on AVX-512 CPUs
// takes tiles of consecutive tokens instead (prefill_attention_tiled below), on AMX tiles
// where the CPU has them and the queries are bf16. Scores, softmax and the weighted sum are
// float32 (on AMX: products of bf16 values summed in float32). Tasks run on PyTorch's own
// intra-op thread pool.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "silu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One cache row to float32. bfloat16 is the top half of a float32, so a shift does it in a
// loop the compiler vectorises (c10::BFloat16's scalar conversion does not vectorise).
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void row_to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

#if defined(__AVX512F__)
// 16 consecutive cache elements as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
constexpr bool kHasLoad16 = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The 8-lane loops below, in the AVX2 build and the AVX-512 ones (whose CPUs run them too).
#define GEMEL_ATTENTION_AVX2 1
// 8 consecutive cache elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {  // int8 codes (a row's scale is applied after)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
constexpr bool kHasLoad8 = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The lane sums of eight vectors, as one vector (lane i: the sum of v[i]'s lanes).
inline __m256 sum8x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128-bit half
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a's low half holds partial sums of v0-v3 (lanes 0-3), its high half the rest of them
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// The largest of s[0..n), n >= 1. GCC leaves the plain loop scalar (the omp simd max
// reduction over std::max did not vectorise): one vmaxss after another, each waiting on the
// last, was half the softmax's time in a decode task (SmolLM2 at batch 32, 192 keys).
inline float row_max(const float* s, int64_t n) {
  int64_t t = 0;
  float peak = s[0];
#if defined(GEMEL_ATTENTION_AVX2)
  if (n >= 16) {
    __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
    for (t = 16; t + 16 <= n; t += 16) {
      a = _mm256_max_ps(a, _mm256_loadu_ps(s + t));
      b = _mm256_max_ps(b, _mm256_loadu_ps(s + t + 8));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_max_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1)));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    peak = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
#endif
  for (; t < n; ++t) peak = s[t] > peak ? s[t] : peak;
  return peak;
}

// The cache lines of one row (the first byte of each 64 and the last).
inline void prefetch_bytes(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
  __builtin_prefetch(p + bytes - 1);
}

// int8 caches (layers/kv_cache.py): each row is head_dim int8 codes, then the row's float32
// scale; the value is code * scale. Scores and sums are float32 on the decoded values.
inline float row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(scale));
  return scale;
}

// Cache rows are fetched this many keys ahead of their use: a sequence's context lies in
// 16-slot blocks scattered over the cache, so the hardware prefetchers see short streams
// only, and from memory (a decode step reads every layer's cache once) a shorter distance
// leaves the loop waiting on loads. The first rows of each task are fetched all at once
// before its loop starts (int8 at 32 x 192: ~7% faster).
constexpr int64_t kPrefetchKeys = 48;

// Key `at` of a context and its value (none where v_cache is null), asked for ahead of use.
template <typename T>
inline void prefetch_key_value(const T* k_cache, const T* v_cache, const int64_t* slots, int64_t at,
                               int64_t head_dim) {
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  prefetch_bytes(k_cache + slots[at] * head_dim, row_bytes);
  if (v_cache != nullptr) prefetch_bytes(v_cache + slots[at] * head_dim, row_bytes);
}

#if defined(GEMEL_ATTENTION_AVX2)
// Keys (and values) fetched this many keys ahead by the AVX2 loops: a context lies in 16-slot
// blocks scattered over the cache, too short a stream for the hardware prefetchers, and at
// batch 32 the caches are most of what a decode step reads from memory.
constexpr int64_t kAvx2AheadKeys = 16;
#endif

// The next decode task's key and value rows, asked for into L2 in step with the current task's
// loops (keep_up after each step), so that the next task finds them there. All at once at the
// start of a task they held the core up instead: it can only have so many misses in flight
// (SmolLM2's layer at batch 32 from memory, AVX2: 296 against 165 us). Spread over the scoring
// pass alone, they left the memory idle while the values were weighed: spread over both passes
// a few keys at a time, a layer at batch 32 and 192 keys from memory took 349-375 against
// 434-437 us (SmolLM2) and 440-475 against 533-576 (Gemma 3) on an AMD Zen 2 (asked for in one
// burst at the start of each pass over the values, half that gain).
struct NextRows {
  const char* k_head = nullptr;
  const char* v_head = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0, fetched = 0, row_bytes = 0;
  float share = 0.f;  // the next task's rows per step of the current one

  // The current task has `steps` steps: its keys scored, then its values weighed.
  void start(int64_t steps) { share = steps > 0 ? static_cast<float>(n) / static_cast<float>(steps) : 0.f; }
  // The current task has done `done` of its steps: ask for as large a share of the next's rows.
  void keep_up(float done) { fetch_to(static_cast<int64_t>(done * share) + 1); }

  void fetch_to(int64_t end) {
    for (end = std::min(n, end); fetched < end; ++fetched) {
      const char* k = k_head + slots[fetched] * row_bytes;
      const char* v = v_head + slots[fetched] * row_bytes;
      for (int64_t i = 0; i < row_bytes; i += 64) {
        __builtin_prefetch(k + i, 0, 2);  // into L2
        __builtin_prefetch(v + i, 0, 2);
      }
    }
  }
};

#if defined(GEMEL_ATTENTION_AVX2)
// The lane sums of K vectors into out[0..K).
template <int K>
inline void store_sums(const __m256* v, float* out) {
  if constexpr (K == 8) {
    _mm256_storeu_ps(out, sum8x8(v));
  } else if constexpr (K == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128-bit half
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  } else {
    for (int i = 0; i < K; ++i) out[i] = sum8(v[i]);
  }
}

// score_keys for G query heads per KV head, K keys at a time: each key's row is widened to
// float32 once for all G heads, with G x K accumulators in registers. The general loops below
// widen a row once per head, which made the widening most of their work: with these and
// weigh_values_grouped, SmolLM2's layer at batch 32 and 170 keys in cache 141-190 -> 115-133
// us (float16 rows, a Zen 5 capped at AVX2, runs alternated). The AVX2 build's int8 rows
// (T = int8_t: codes, then the row's scale) take the same loops, fetched kPrefetchKeys ahead;
// before, it ran the general loops: SmolLM2's layer at 32 x 192 keys from memory 648-798 ->
// 159-198 us, where the float16 cache took 162-242 (`bench/decode_attention.py`, 2026-12-04).
template <int G, int K, typename T>
void score_keys_grouped(const float* query, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t n,
                        int64_t head_dim, float* scores, NextRows* next) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  constexpr int64_t kAhead = kInt8 ? kPrefetchKeys : kAvx2AheadKeys;
  const int64_t row = head_dim + (kInt8 ? 4 : 0), row_bytes = row * static_cast<int64_t>(sizeof(T));
  const auto fetch = [&](int64_t at) {
    prefetch_bytes(k_cache + slots[at] * row, row_bytes);
    if (v_cache != nullptr) prefetch_bytes(v_cache + slots[at] * row, row_bytes);
  };
  for (int64_t t = 0; t < std::min<int64_t>(n, kAhead); ++t) fetch(t);
  int64_t t = 0;
  for (; t + K <= n; t += K) {
    const T* key[K];
    for (int i = 0; i < K; ++i) key[i] = k_cache + slots[t + i] * row;
    for (int64_t ahead = t + kAhead; ahead < std::min(n, t + kAhead + K); ++ahead) fetch(ahead);
    if (next != nullptr) next->keep_up(static_cast<float>(t + K));
    __m256 a[G][K];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < K; ++i) a[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      __m256 qv[G];
      for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(query + g * head_dim + d);
      for (int i = 0; i < K; ++i) {
        const __m256 kv = load8(key[i] + d);
        for (int g = 0; g < G; ++g) a[g][i] = _mm256_fmadd_ps(qv[g], kv, a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      store_sums<K>(a[g], scores + g * n + t);
      if constexpr (kInt8)
        for (int i = 0; i < K; ++i) scores[g * n + t + i] *= row_scale(key[i], head_dim);
    }
  }
  for (; t < n; ++t) {
    const T* key = k_cache + slots[t] * row;
    __m256 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 kv = load8(key + d);
      for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(query + g * head_dim + d), kv, a[g]);
    }
    for (int g = 0; g < G; ++g) {
      scores[g * n + t] = sum8(a[g]);
      if constexpr (kInt8) scores[g * n + t] *= row_scale(key, head_dim);
    }
  }
}

// weigh_values for G query heads per KV head, W vectors (8 W dimensions) of the head at a
// time: each value row's slice is widened once for all G heads, G x W sums in registers.
// int8 rows (T = int8_t) weigh each row's codes by its probability times its scale.
template <int G, int W, typename T>
void weigh_values_grouped(const float* probs, const T* v_cache, const int64_t* slots, int64_t n, int64_t head_dim,
                          float* acc, NextRows* next = nullptr) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  const int64_t row = head_dim + (kInt8 ? 4 : 0);
  // The next task's rows are asked for as the keys go by (next->keep_up), in steps of the
  // task: its n keys scored, then n more over all the passes here.
  const float step_per_key = static_cast<float>(8 * W) / static_cast<float>(head_dim);
  float done = static_cast<float>(n);
  for (int64_t d0 = 0; d0 < head_dim; d0 += 8 * W) {
    __m256 s[G][W];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) s[g][w] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (next != nullptr && (t & 1) == 1) next->keep_up(done += 2 * step_per_key);
      const T* value = v_cache + slots[t] * row + d0;
      float scale = 1.f;
      if constexpr (kInt8) scale = row_scale(value - d0, head_dim);
      __m256 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(kInt8 ? probs[g * n + t] * scale : probs[g * n + t]);
      for (int w = 0; w < W; ++w) {
        const __m256 v = load8(value + 8 * w);
        for (int g = 0; g < G; ++g) s[g][w] = _mm256_fmadd_ps(p[g], v, s[g][w]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) {
        float* a = acc + g * head_dim + d0 + 8 * w;
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), s[g][w]));
      }
  }
}

// The grouped loops for 1-4 query heads per KV head; false where they do not cover (the
// caller's loops then run).
template <typename T>
bool score_keys_by_group(const float* query, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t n,
                         int64_t group, int64_t head_dim, float* scores, NextRows* next) {
  if (head_dim % 8 != 0) return false;
  switch (group) {
    case 1: score_keys_grouped<1, 8>(query, k_cache, v_cache, slots, n, head_dim, scores, next); return true;
    case 2: score_keys_grouped<2, 4>(query, k_cache, v_cache, slots, n, head_dim, scores, next); return true;
    case 3: score_keys_grouped<3, 4>(query, k_cache, v_cache, slots, n, head_dim, scores, next); return true;
    case 4: score_keys_grouped<4, 2>(query, k_cache, v_cache, slots, n, head_dim, scores, next); return true;
    default: return false;
  }
}

template <typename T>
bool weigh_values_by_group(const float* probs, const T* v_cache, const int64_t* slots, int64_t n, int64_t group,
                           int64_t head_dim, float* acc, NextRows* next = nullptr) {
  if (head_dim % 8 != 0) return false;
  const int64_t vectors = head_dim / 8;
  switch (group) {
    case 1:
      if (vectors % 8 == 0) return weigh_values_grouped<1, 8>(probs, v_cache, slots, n, head_dim, acc, next), true;
      if (vectors % 4 == 0) return weigh_values_grouped<1, 4>(probs, v_cache, slots, n, head_dim, acc, next), true;
      return false;
    case 2:
      if (vectors % 4 == 0) return weigh_values_grouped<2, 4>(probs, v_cache, slots, n, head_dim, acc, next), true;
      return false;
    case 3:
      if (vectors % 4 == 0) return weigh_values_grouped<3, 4>(probs, v_cache, slots, n, head_dim, acc, next), true;
      if (vectors % 2 == 0) return weigh_values_grouped<3, 2>(probs, v_cache, slots, n, head_dim, acc, next), true;
      return false;
    case 4:
      if (vectors % 2 == 0) return weigh_values_grouped<4, 2>(probs, v_cache, slots, n, head_dim, acc, next), true;
      return false;
    default:
      return false;
  }
}
#endif

// scores[g * n + t] = query_g . key_t for the task's n keys (query already scaled).
// v_cache: the values' rows, fetched ahead with the keys on AVX2 CPUs (may be null).
template <typename T>
inline void score_keys(const float* query, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t n,
                       int64_t group, int64_t head_dim, float* scores, float* row, NextRows* next = nullptr) {
#if defined(GEMEL_ATTENTION_AVX2)
  // Every level: the grouped loops widen each key once for all the query heads of its KV head
  // (the AVX-512 loop below widens it once per head: a float16 cache at 32 x 192 keys, 636 us
  // a layer in the AVX-512 build against 272 in the AVX2 one, on a Zen 5).
  if constexpr (kHasLoad8<T>) {
    if (score_keys_by_group(query, k_cache, v_cache, slots, n, group, head_dim, scores, next)) return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kHasLoad16<T>) {
    if (head_dim % 16 == 0) {
      for (int64_t t = 0; t < n; ++t) {
        const T* key = k_cache + slots[t] * head_dim;
        if (t + 2 < n) _mm_prefetch(reinterpret_cast<const char*>(k_cache + slots[t + 2] * head_dim), _MM_HINT_T0);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query + g * head_dim;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t d = 0; d < head_dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), load16(key + d), acc);
          scores[g * n + t] = _mm512_reduce_add_ps(acc);
        }
      }
      return;
    }
  }
#elif defined(GEMEL_ATTENTION_AVX2)
  if constexpr (kHasLoad8<T>) {
    if (head_dim % 8 == 0) {
      // Eight keys against each query head at a time, one accumulator per key: eight
      // independent FMA chains keep both FMA pipes busy (a chain per key or two waits out the
      // FMA's latency at every step), and one transposing reduction yields the eight scores.
      const auto fetch = [&](int64_t at) { prefetch_key_value(k_cache, v_cache, slots, at, head_dim); };
      // the first rows, which the loop below does not fetch ahead
      for (int64_t t = 0; t < std::min<int64_t>(n, kAvx2AheadKeys); ++t) fetch(t);
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        const T* key[8];
        for (int i = 0; i < 8; ++i) key[i] = k_cache + slots[t + i] * head_dim;
        // the rows kAvx2AheadKeys on, and their values for the pass after this one
        for (int64_t ahead = t + kAvx2AheadKeys; ahead < std::min(n, t + kAvx2AheadKeys + 8); ++ahead) fetch(ahead);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query + g * head_dim;
          __m256 a[8];
          for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
          for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + d);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(key[i] + d), a[i]);
          }
          _mm256_storeu_ps(scores + g * n + t, sum8x8(a));
        }
      }
      for (; t < n; ++t) {
        const T* key = k_cache + slots[t] * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < head_dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + g * head_dim + d), load8(key + d), acc);
          scores[g * n + t] = sum8(acc);
        }
      }
      return;
    }
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    row_to_float(k_cache + slots[t] * head_dim, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
      scores[g * n + t] = dot;
    }
  }
}

// acc[g * head_dim + d] += sum_t probs[g * n + t] * value_t[d].
template <typename T>
inline void weigh_values(const float* probs, const T* v_cache, const int64_t* slots, int64_t n,
                         int64_t group, int64_t head_dim, float* acc, float* row, NextRows* next = nullptr) {
#if defined(GEMEL_ATTENTION_AVX2)
  if constexpr (kHasLoad8<T>) {  // every level, as in score_keys
    if (weigh_values_by_group(probs, v_cache, slots, n, group, head_dim, acc, next)) return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kHasLoad16<T>) {
    if (head_dim % 16 == 0) {
      for (int64_t t = 0; t < n; ++t) {
        const T* value = v_cache + slots[t] * head_dim;
        if (t + 2 < n) _mm_prefetch(reinterpret_cast<const char*>(v_cache + slots[t + 2] * head_dim), _MM_HINT_T0);
        for (int64_t d = 0; d < head_dim; d += 16) {
          const __m512 v = load16(value + d);
          for (int64_t g = 0; g < group; ++g) {
            float* a = acc + g * head_dim + d;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(probs[g * n + t]), v, _mm512_loadu_ps(a)));
          }
        }
      }
      return;
    }
  }
#elif defined(GEMEL_ATTENTION_AVX2)
  if constexpr (kHasLoad8<T>) {
    if (head_dim % 8 == 0 && head_dim <= 256) {
      // Each query head's sums in registers, 32 lanes at a time, two values per step into
      // separate sums (eight FMA chains instead of four: a step no longer waits on the last).
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * head_dim;
        const float* p = probs + g * n;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
          const int64_t width = std::min<int64_t>(32, head_dim - d0);
          __m256 s[8];
          for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_ps();
          int64_t t = 0;
          for (; t + 2 <= n; t += 2) {
            const T* v0 = v_cache + slots[t] * head_dim + d0;
            const T* v1 = v_cache + slots[t + 1] * head_dim + d0;
            const __m256 w0 = _mm256_set1_ps(p[t]), w1 = _mm256_set1_ps(p[t + 1]);
            for (int i = 0; i < 4; ++i) {
              if (8 * i >= width) break;
              s[i] = _mm256_fmadd_ps(w0, load8(v0 + 8 * i), s[i]);
              s[4 + i] = _mm256_fmadd_ps(w1, load8(v1 + 8 * i), s[4 + i]);
            }
          }
          for (; t < n; ++t) {
            const T* v0 = v_cache + slots[t] * head_dim + d0;
            const __m256 w0 = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 4 && 8 * i < width; ++i) s[i] = _mm256_fmadd_ps(w0, load8(v0 + 8 * i), s[i]);
          }
          for (int i = 0; i < 4 && 8 * i < width; ++i)
            _mm256_storeu_ps(a + d0 + 8 * i, _mm256_add_ps(_mm256_loadu_ps(a + d0 + 8 * i), _mm256_add_ps(s[i], s[4 + i])));
        }
      }
      return;
    }
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    row_to_float(v_cache + slots[t] * head_dim, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * n + t];
      float* a = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
    }
  }
}

// A 68-byte int8 row can straddle two cache lines.
inline void prefetch_row(const int8_t* row) { prefetch_bytes(row, 68); }

#if defined(__AVX512F__)
// 16 int8 codes as float32 lanes.
inline __m512 codes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// out[i] = sum of the 16 lanes of v[i].
inline __m512 sum_lanes_of_16(const __m512* v) {
  __m512 half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves added: vectors 2i, 2i+1 in one register
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L now holds 4 partial sums of vector 4i + L
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4L + j now holds vector 4j + L: transpose the 4x4 order back.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Fast path for int8 rows with a head size of 16 * W: 16 keys at a time, each key's codes
// converted once for all G query heads, the 16 horizontal sums of each head done together.
template <int G, int W>
void score_keys_int8_fast(const float* query, const int8_t* k_cache, const int8_t* v_cache, const int64_t* slots,
                          int64_t n, float* scores) {
  constexpr int64_t kRow = 16 * W + 4;
  __m512 q[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) q[g][w] = _mm512_loadu_ps(query + (g * W + w) * 16);
  for (int64_t t = 0; t < std::min(n, kPrefetchKeys); ++t) {  // the rows the loop does not fetch ahead
    prefetch_row(k_cache + slots[t] * kRow);
    if (v_cache != nullptr) prefetch_row(v_cache + slots[t] * kRow);
  }
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
    alignas(64) float scale[16];
    __m512 dots[G][16];
    for (int j = 0; j < 16; ++j) {
      const int8_t* key = k_cache + slots[t0 + std::min(j, m - 1)] * kRow;
      if (t0 + kPrefetchKeys + j < n) {  // and the values, for the pass after this one
        prefetch_row(k_cache + slots[t0 + kPrefetchKeys + j] * kRow);
        if (v_cache != nullptr) prefetch_row(v_cache + slots[t0 + kPrefetchKeys + j] * kRow);
      }
      scale[j] = row_scale(key, 16 * W);
      __m512 x[W];
      for (int w = 0; w < W; ++w) x[w] = codes16(key + 16 * w);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(q[g][0], x[0]);
        for (int w = 1; w < W; ++w) acc = _mm512_fmadd_ps(q[g][w], x[w], acc);
        dots[g][j] = acc;
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
    const __m512 scales = _mm512_load_ps(scale);
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * n + t0, valid, _mm512_mul_ps(sum_lanes_of_16(dots[g]), scales));
  }
}

// Value sums in registers: acc[g * 16 * W + d] = sum_t probs[g * n + t] * value_t[d].
template <int G, int W>
void weigh_values_int8_fast(const float* probs, const int8_t* v_cache, const int64_t* slots, int64_t n, float* acc) {
  constexpr int64_t kRow = 16 * W + 4;
  __m512 sums[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) sums[g][w] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* value = v_cache + slots[t] * kRow;
    if (t + kPrefetchKeys < n) prefetch_row(v_cache + slots[t + kPrefetchKeys] * kRow);
    const float scale = row_scale(value, 16 * W);
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(probs[g * n + t] * scale);
    for (int w = 0; w < W; ++w) {
      const __m512 x = codes16(value + 16 * w);
      for (int g = 0; g < G; ++g) sums[g][w] = _mm512_fmadd_ps(p[g], x, sums[g][w]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc + (g * W + w) * 16, sums[g][w]);
}

template <int G, int W>
inline void attend_int8(bool scores_pass, const float* in, const int8_t* cache, const int8_t* v_cache,
                        const int64_t* slots, int64_t n, float* out) {
  if (scores_pass) score_keys_int8_fast<G, W>(in, cache, v_cache, slots, n, out);
  else weigh_values_int8_fast<G, W>(in, cache, slots, n, out);
}

// Dispatch for head size 64 with up to 4 query heads per KV head, and 128 with up to 2 (the
// value sums stay in registers); false where none covers.
inline bool attend_int8_fast(int64_t group, int64_t head_dim, bool scores_pass, const float* in,
                             const int8_t* cache, const int8_t* v_cache, const int64_t* slots, int64_t n, float* out) {
  if (head_dim == 64 && group >= 1 && group <= 4) {
    switch (group) {
      case 1: attend_int8<1, 4>(scores_pass, in, cache, v_cache, slots, n, out); break;
      case 2: attend_int8<2, 4>(scores_pass, in, cache, v_cache, slots, n, out); break;
      case 3: attend_int8<3, 4>(scores_pass, in, cache, v_cache, slots, n, out); break;
      default: attend_int8<4, 4>(scores_pass, in, cache, v_cache, slots, n, out); break;
    }
    return true;
  }
  if (head_dim == 128 && group >= 1 && group <= 2) {
    if (group == 1) attend_int8<1, 8>(scores_pass, in, cache, v_cache, slots, n, out);
    else attend_int8<2, 8>(scores_pass, in, cache, v_cache, slots, n, out);
    return true;
  }
  return false;
}
#endif

// scores[g * n + t] = query_g . key_t (query already scaled), keys as int8 rows.
// next: the next decode task's rows, asked for in step with this loop (AVX2 builds; may be null).
inline void score_keys_int8(const float* query, const int8_t* k_cache, const int8_t* v_cache, const int64_t* slots,
                            int64_t n, int64_t group, int64_t head_dim, float* scores,
                            [[maybe_unused]] NextRows* next = nullptr) {
#if defined(__AVX512F__)
  if (attend_int8_fast(group, head_dim, true, query, k_cache, v_cache, slots, n, scores)) return;
#elif defined(GEMEL_ATTENTION_AVX2)
  if (score_keys_by_group(query, k_cache, v_cache, slots, n, group, head_dim, scores, next)) return;
#endif
  const int64_t row = head_dim + 4;
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* key = k_cache + slots[t] * row;
    if (t + 2 < n) prefetch_row(k_cache + slots[t + 2] * row);
    const float scale = row_scale(key, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
      scores[g * n + t] = dot * scale;
    }
  }
}

// acc[g * head_dim + d] += sum_t probs[g * n + t] * value_t[d], values as int8 rows.
inline void weigh_values_int8(const float* probs, const int8_t* v_cache, const int64_t* slots, int64_t n,
                              int64_t group, int64_t head_dim, float* acc, [[maybe_unused]] NextRows* next = nullptr) {
#if defined(__AVX512F__)
  if (attend_int8_fast(group, head_dim, false, probs, v_cache, nullptr, slots, n, acc)) return;
#elif defined(GEMEL_ATTENTION_AVX2)
  if (weigh_values_by_group(probs, v_cache, slots, n, group, head_dim, acc, next)) return;
#endif
  const int64_t row = head_dim + 4;
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* value = v_cache + slots[t] * row;
    if (t + 2 < n) prefetch_row(v_cache + slots[t + 2] * row);
    const float scale = row_scale(value, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * n + t] * scale;
      float* a = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(value[d]);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Fast path for bf16 caches with a head size of 64 or 128 (AVX512-BF16): the scores of 16
// keys at a time with bf16 dot products (vdpbf16ps, float32 sums), their 16 horizontal sums
// done together, and the value sums kept in registers rather than in memory.
// scores[g * n + t] = scale * (query_g . key_t), G query heads, head size 32 * W.
template <int G, int W>
void score_keys_bf16(const at::BFloat16* q_rows, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* slots, int64_t n, float scale, float* scores) {
  __m512bh query[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w)
      query[g][w] = (__m512bh)_mm512_loadu_si512(q_rows + g * 32 * W + 32 * w);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < std::min(n, kPrefetchKeys); ++t) {  // the rows the loop does not fetch ahead
    prefetch_bytes(k_cache + slots[t] * 32 * W, 64 * W);
    prefetch_bytes(v_cache + slots[t] * 32 * W, 64 * W);
  }
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
    const at::BFloat16* keys[16];
    for (int j = 0; j < 16; ++j) keys[j] = k_cache + slots[t0 + std::min(j, m - 1)] * 32 * W;
    for (int j = 0; j < 16 && t0 + kPrefetchKeys + j < n; ++j) {  // and the values, for the next pass
      prefetch_bytes(k_cache + slots[t0 + kPrefetchKeys + j] * 32 * W, 64 * W);
      prefetch_bytes(v_cache + slots[t0 + kPrefetchKeys + j] * 32 * W, 64 * W);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int w = 0; w < W; ++w)
          acc = _mm512_dpbf16_ps(acc, query[g][w], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * w));
        dots[j] = acc;
      }
      _mm512_mask_storeu_ps(scores + g * n + t0, valid, _mm512_mul_ps(sum_lanes_of_16(dots), scale_v));
    }
  }
}

// acc[g * 16 * V + d] = sum_t probs[g * n + t] * value_t[d], G query heads, head size 16 * V.
template <int G, int V>
void weigh_values_bf16(const float* probs, const at::BFloat16* v_cache, const int64_t* slots, int64_t n, float* acc) {
  __m512 sums[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) sums[g][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const at::BFloat16* value = v_cache + slots[t] * 16 * V;
    if (t + kPrefetchKeys < n) prefetch_bytes(v_cache + slots[t + kPrefetchKeys] * 16 * V, 32 * V);
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(probs[g * n + t]);
    for (int v = 0; v < V; ++v) {
      const __m512 x = load16(value + 16 * v);
      for (int g = 0; g < G; ++g) sums[g][v] = _mm512_fmadd_ps(p[g], x, sums[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (g * V + v) * 16, sums[g][v]);
}

// Dispatch to the instantiations above; false where none covers (group, head_dim).
template <int G>
bool score_keys_fast_g(const at::BFloat16* q_rows, const at::BFloat16* k_head, const at::BFloat16* v_head,
                       const int64_t* slots, int64_t n, int64_t head_dim, float scale, float* scores) {
  if (head_dim == 64) return score_keys_bf16<G, 2>(q_rows, k_head, v_head, slots, n, scale, scores), true;
  if (head_dim == 128) return score_keys_bf16<G, 4>(q_rows, k_head, v_head, slots, n, scale, scores), true;
  return false;
}

inline bool score_keys_fast(int64_t group, const at::BFloat16* q_rows, const at::BFloat16* k_head,
                            const at::BFloat16* v_head, const int64_t* slots, int64_t n, int64_t head_dim, float scale,
                            float* scores) {
  switch (group) {
    case 1: return score_keys_fast_g<1>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 2: return score_keys_fast_g<2>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 3: return score_keys_fast_g<3>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 4: return score_keys_fast_g<4>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 5: return score_keys_fast_g<5>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 6: return score_keys_fast_g<6>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 7: return score_keys_fast_g<7>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    case 8: return score_keys_fast_g<8>(q_rows, k_head, v_head, slots, n, head_dim, scale, scores);
    default: return false;
  }
}

// Value sums in registers while they fit (group * head_dim / 16 <= 16 vectors).
inline bool weigh_values_fast(int64_t group, const float* probs, const at::BFloat16* v_head, const int64_t* slots,
                              int64_t n, int64_t head_dim, float* acc) {
  if (head_dim == 64) {
    switch (group) {
      case 1: return weigh_values_bf16<1, 4>(probs, v_head, slots, n, acc), true;
      case 2: return weigh_values_bf16<2, 4>(probs, v_head, slots, n, acc), true;
      case 3: return weigh_values_bf16<3, 4>(probs, v_head, slots, n, acc), true;
      case 4: return weigh_values_bf16<4, 4>(probs, v_head, slots, n, acc), true;
      default: return false;
    }
  }
  if (head_dim == 128 && group <= 2) {
    return group == 1 ? (weigh_values_bf16<1, 8>(probs, v_head, slots, n, acc), true)
                      : (weigh_values_bf16<2, 8>(probs, v_head, slots, n, acc), true);
  }
  return false;
}

#endif

// A task's keys, or a run of them. With fewer tasks than the threads can share evenly (one
// sequence decoding, and few KV heads: Gemma 3 has one), each task's keys are split into runs
// that the threads attend apart, and the runs' results are merged afterwards, as vLLM's
// paged attention v2 and flash-decoding do: a run keeps its scores' largest value, the sum of
// their exponentials from it and the values weighed by them.
struct KeyRun {
  int64_t task, begin, count;  // begin: the run's first key among the task's keys
};

// Runs shorter than this are not split off: each costs its query's preparation and a merge.
constexpr int64_t kMinRunKeys = 64;

// The runs of each task: one a task unless the tasks are too few to keep `threads` busy, in
// which case each is cut into runs of about total / (2 threads) keys (at least kMinRunKeys).
template <typename K>
std::vector<KeyRun> key_runs(int64_t tasks, const K& keys_of, int threads) {
  std::vector<KeyRun> runs;
  runs.reserve(tasks);
  int64_t total = 0;
  for (int64_t t = 0; t < tasks; ++t) total += keys_of(t);
  const int64_t target = std::max<int64_t>(kMinRunKeys, (total + 2 * threads - 1) / (2 * threads));
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n = keys_of(t);
    const int64_t parts =
        threads > 1 ? std::max<int64_t>(1, std::min((n + target - 1) / target, n / kMinRunKeys)) : 1;
    for (int64_t i = 0; i < parts; ++i) runs.push_back({t, n * i / parts, n * (i + 1) / parts - n * i / parts});
  }
  return runs;
}

// One query token per row b of q. Its keys are the first context_lens[b] slots of row
// token_seq[b] of kv_slots (row b when token_seq is null: decode, one token per sequence;
// prefill tokens of one sequence share its row, each with its own causal length). The cache
// holds T, or (C = int8_t) int8 rows of head_dim + 4.
template <typename T, typename C = T>
void decode_attention(const T* q, const C* k_cache, const C* v_cache, const int64_t* kv_slots,
                      const int64_t* token_seq, const int64_t* context_lens, T* out, int64_t batch,
                      int64_t num_heads, int64_t num_kv, int64_t head_dim, int64_t num_slots,
                      int64_t max_ctx, float scale, int64_t window) {
  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
  const int64_t group = num_heads / num_kv;
  const int64_t row_width = kInt8Cache ? head_dim + 4 : head_dim;
  const auto keys_of = [&](int64_t task) {  // the keys a task attends to: its last `window` at most
    const int64_t len = context_lens[task / num_kv];
    return window > 0 ? std::min(len, window) : len;
  };
  const auto slots_of = [&](int64_t task, int64_t begin) {  // the slot of a task's key `begin`
    const int64_t b = task / num_kv;
    return kv_slots + (token_seq != nullptr ? token_seq[b] : b) * max_ctx + context_lens[b] - keys_of(task) + begin;
  };
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const std::vector<KeyRun> runs = key_runs(batch * num_kv, keys_of, threads);
  const bool split = static_cast<int64_t>(runs.size()) > batch * num_kv;
  // Split runs leave their partial results here: per run, per query head, the scores' largest
  // value and the sum of exp(score - it), then the values weighed by those exponentials.
  const int64_t partial_width = group * (2 + head_dim);
  std::vector<float> partials(split ? runs.size() * partial_width : 0);
  const auto attend = [&](int64_t r, NextRows* next) {
    thread_local std::vector<float> query, acc, row, total, scores;
    query.resize(group * head_dim), acc.resize(group * head_dim), row.resize(head_dim), total.resize(group);
    const KeyRun& run = runs[r];
    const int64_t b = run.task / num_kv, h = run.task % num_kv;
    const int64_t n = run.count;
    const bool whole = run.count == keys_of(run.task);
    const int64_t* slots = slots_of(run.task, run.begin);
    const T* q_rows = q + (b * num_heads + h * group) * head_dim;
    T* out_rows = out + (b * num_heads + h * group) * head_dim;
    if (n <= 0) {
      std::fill(out_rows, out_rows + group * head_dim, T(0));
      return;
    }
    scores.resize(group * n);
    // Scores: one pass over the keys, every query head of the group per key.
    const C* k_head = k_cache + h * num_slots * row_width;
    const C* v_head = v_cache + h * num_slots * row_width;
    bool scored = false, weighed = false;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16> && !kInt8Cache)
      scored = score_keys_fast(group, q_rows, k_head, v_head, slots, n, head_dim, scale, scores.data());
#endif
    if (!scored) {
      row_to_float(q_rows, query.data(), group * head_dim);
      for (int64_t i = 0; i < group * head_dim; ++i) query[i] *= scale;
      if constexpr (kInt8Cache)
        score_keys_int8(query.data(), k_head, v_head, slots, n, group, head_dim, scores.data(), next);
      else
        score_keys(query.data(), k_head, v_head, slots, n, group, head_dim, scores.data(), row.data(), next);
    }
    // Softmax per query head (unnormalised; divided out at the end).
    float* partial = whole ? nullptr : partials.data() + r * partial_width;
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * n;
      const float peak = row_max(s, n);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - peak);  // vectorised by libmvec (built with -ffast-math)
        sum += s[t];
      }
      total[g] = sum;
      if (partial != nullptr) partial[g] = peak, partial[group + g] = sum;
    }
    // Weighted sum of the values: one pass over the values.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16> && !kInt8Cache)
      weighed = weigh_values_fast(group, scores.data(), v_head, slots, n, head_dim, acc.data());
#endif
    if (!weighed) {
      std::fill(acc.begin(), acc.end(), 0.f);
      if constexpr (kInt8Cache)
        weigh_values_int8(scores.data(), v_head, slots, n, group, head_dim, acc.data(), next);
      else
        weigh_values(scores.data(), v_head, slots, n, group, head_dim, acc.data(), row.data(), next);
    }
    if (partial != nullptr) {
      std::copy(acc.begin(), acc.end(), partial + 2 * group);
      return;
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        out_rows[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d] / total[g]);
  };
  // The split tasks' runs merged: each run's sums rescaled from its own largest score to the
  // task's.
  const auto merge = [&]() {
    std::vector<float> weight, acc(group * head_dim);
    for (size_t first = 0; first < runs.size();) {
      size_t last = first + 1;
      while (last < runs.size() && runs[last].task == runs[first].task) ++last;
      if (last - first > 1) {
        const int64_t task = runs[first].task, b = task / num_kv, h = task % num_kv;
        T* out_rows = out + (b * num_heads + h * group) * head_dim;
        weight.resize(last - first);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t g = 0; g < group; ++g) {
          float peak = partials[first * partial_width + g], total = 0.f;
          for (size_t r = first + 1; r < last; ++r) peak = std::max(peak, partials[r * partial_width + g]);
          for (size_t r = first; r < last; ++r) {
            const float* partial = partials.data() + r * partial_width;
            weight[r - first] = std::exp(partial[g] - peak);
            total += weight[r - first] * partial[group + g];
          }
          for (size_t r = first; r < last; ++r) {
            const float* values = partials.data() + r * partial_width + 2 * group + g * head_dim;
            const float w = weight[r - first] / total;
            for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += w * values[d];
          }
          for (int64_t d = 0; d < head_dim; ++d) out_rows[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
        }
      }
      first = last;
    }
  };
  const int64_t count = static_cast<int64_t>(runs.size());
#if defined(GEMEL_ATTENTION_AVX2)
#if defined(__AVX512F__)
  // In the AVX-512 builds, the float32 queries that the grouped 8-lane loops serve; their
  // bf16 and int8 loops fetch 48 keys ahead instead.
  constexpr bool kRunsOfTasks = std::is_same_v<T, float> && !kInt8Cache;
#else
  constexpr bool kRunsOfTasks = true;
#endif
  if (kRunsOfTasks && token_seq == nullptr) {
    // Decode: each thread takes a contiguous run of tasks of about equal keys and asks for the
    // next task's rows while it scores and weighs the current one's (NextRows). A task's rows lie in
    // 16-slot blocks scattered over the cache, short streams the hardware prefetchers do not
    // get ahead of, and at batch 32 the caches are most of what a decode step reads: SmolLM2's
    // layer at batch 32 and 170 keys, from memory, 312 -> 165 us on a Zen 5 capped at AVX2.
    // (Prefill tasks of one prompt share their rows, so they gain nothing from it. The AVX-512
    // builds' bf16 loops, which fetch 48 keys ahead, measured no faster with it on a Zen 5:
    // 32 x 192 keys 248-315 against 240-272 us, 32 x 512 579-669 against 618-712.)
    const int64_t row_bytes = row_width * static_cast<int64_t>(sizeof(C));
    gemel::parallel_ranges(
        count, [&](int64_t r) { return runs[r].count + 16; },
        [&](int64_t begin, int64_t end) {
          NextRows next;
          next.row_bytes = row_bytes;
          for (int64_t r = begin; r < end; ++r) {
            next.n = next.fetched = 0;
            if (r + 1 < end) {
              const KeyRun& following = runs[r + 1];
              next.n = following.count;
              next.slots = slots_of(following.task, following.begin);
              next.k_head = reinterpret_cast<const char*>(k_cache + (following.task % num_kv) * num_slots * row_width);
              next.v_head = reinterpret_cast<const char*>(v_cache + (following.task % num_kv) * num_slots * row_width);
            }
            next.start(2 * runs[r].count);
            attend(r, &next);
            next.fetch_to(next.n);  // what the task's loops did not ask for
          }
        });
    if (split) merge();
    return;
  }
#endif
  gemel::parallel_items(count, [&](int64_t r) { attend(r, nullptr); });
  if (split) merge();
}

#if defined(__AVX512F__)
// Prefill in tiles: the query tokens of one sequence are taken up to kTileQueryRows rows
// (tokens x the GQA heads of one KV head) at a time, and each key and value row of the
// tile's context is converted to float32 once for all of them, where the per-token tasks
// above convert it once per token. Scores and value sums are then small matrix products in
// registers (no horizontal sums), with an online softmax over chunks of kTileKeys keys so
// the buffers stay the same size for any context length. float32 throughout, like the
// per-token path; only the order of the sums differs.
constexpr int64_t kTileQueryRows = 48;  // three vectors of 16 rows
constexpr int64_t kTileKeys = 256;
constexpr int64_t kScoreKeys = 8;  // keys scored together in registers
constexpr float kMaskedScore = -1e30f;  // finite: the kernels are built with -ffast-math

// dst[j * dst_stride + i] = src[i * src_stride + j] for a 16 x 16 block of float32s.
inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then pairs of pairs: each 128-bit lane holds 4 rows' column
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4 * g + k] now holds, in its 128-bit lane L, column 4 * L + k of rows 4g..4g+3.
  for (int k = 0; k < 4; ++k) {  // lanes 0 and 2 (t[k]), 1 and 3 (t[k + 4]) of row groups 0, 1; 8..: groups 2, 3
    t[k] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0x88);
    t[k + 4] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0xDD);
    t[k + 8] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0x88);
    t[k + 12] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0xDD);
  }
  for (int k = 0; k < 4; ++k) {  // column 4 * L + k: lane L of all four row groups
    _mm512_storeu_ps(dst + k * dst_stride, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
    _mm512_storeu_ps(dst + (8 + k) * dst_stride, _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD));
    _mm512_storeu_ps(dst + (4 + k) * dst_stride, _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0x88));
    _mm512_storeu_ps(dst + (12 + k) * dst_stride, _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0xDD));
  }
}

// 16 float32s stored as T (rounded to nearest even, as static_cast does).
template <typename T>
inline void store16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, v);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i) dst[i] = static_cast<T>(f[i]);
  }
}

// One cache row (key or value) as head_dim float32s.
template <typename C>
inline void cache_row_to_float(const C* head_cache, int64_t slot, int64_t head_dim, float* dst) {
  if constexpr (std::is_same_v<C, int8_t>) {
    const int8_t* row = head_cache + slot * (head_dim + 4);
    const __m512 scale = _mm512_set1_ps(row_scale(row, head_dim));
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(codes16(row + d), scale));
  } else {
    const C* row = head_cache + slot * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(dst + d, load16(row + d));
  }
}

// The keys and values of context positions c0..c0+n-1 (cache `slots`) as rows of head_dim
// `Dst` values, written by `to_row(head_cache, slot, head_dim, dst)`, then zero rows up to
// `padded`. The rows lie in scattered 16-slot blocks, so each is fetched a few keys ahead.
template <typename C, typename Dst, typename ToRow>
inline void read_context_chunk(const C* k_head, const C* v_head, const int64_t* slots, int64_t c0, int64_t n,
                               int64_t padded, int64_t head_dim, Dst* keys, Dst* values, ToRow to_row) {
  const int64_t row_width = std::is_same_v<C, int8_t> ? head_dim + 4 : head_dim;
  const int64_t row_bytes = row_width * static_cast<int64_t>(sizeof(C));
  for (int64_t t = 0; t < n; ++t) {
    if (t + 8 < n) {
      prefetch_bytes(k_head + slots[c0 + t + 8] * row_width, row_bytes);
      prefetch_bytes(v_head + slots[c0 + t + 8] * row_width, row_bytes);
    }
    to_row(k_head, slots[c0 + t], head_dim, keys + t * head_dim);
    to_row(v_head, slots[c0 + t], head_dim, values + t * head_dim);
  }
  std::fill(keys + n * head_dim, keys + padded * head_dim, Dst{0});
  std::fill(values + n * head_dim, values + padded * head_dim, Dst{0});
}

// scores[t * 16 * RV + r] = sum_d keys[t * D + d] * queries_t[d * 16 * RV + r] for t in
// [0, n), n a multiple of kScoreKeys: query rows across the lanes, kScoreKeys keys at a time.
template <int RV>
void tile_scores(const float* queries_t, const float* keys, int64_t n, int64_t head_dim, float* scores) {
  constexpr int64_t kWidth = 16 * RV;
  for (int64_t t0 = 0; t0 < n; t0 += kScoreKeys) {
    __m512 acc[kScoreKeys][RV];
    for (int k = 0; k < kScoreKeys; ++k)
      for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_setzero_ps();
    const float* key = keys + t0 * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      __m512 q[RV];
      for (int v = 0; v < RV; ++v) q[v] = _mm512_loadu_ps(queries_t + d * kWidth + 16 * v);
      for (int k = 0; k < kScoreKeys; ++k) {
        const __m512 x = _mm512_set1_ps(key[k * head_dim + d]);
        for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_fmadd_ps(x, q[v], acc[k][v]);
      }
    }
    for (int k = 0; k < kScoreKeys; ++k)
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(scores + (t0 + k) * kWidth + 16 * v, acc[k][v]);
  }
}

// sums[r * D + d] += sum_t probs[t * width + r] * values[t * D + d] for rows [0, rows), head
// size 16 * DV: a few rows' sums in registers at a time, each value row loaded once for them.
template <int DV>
void tile_value_sums(const float* probs, int64_t width, const float* values, int64_t n, int64_t rows, float* sums) {
  constexpr int kRowsAtOnce = DV >= 24 ? 1 : 24 / DV;
  constexpr int64_t kDim = 16 * DV;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsAtOnce) {
    const int m = static_cast<int>(std::min<int64_t>(kRowsAtOnce, rows - r0));
    __m512 acc[kRowsAtOnce][DV];
    for (int i = 0; i < m; ++i)
      for (int v = 0; v < DV; ++v) acc[i][v] = _mm512_loadu_ps(sums + (r0 + i) * kDim + 16 * v);
    for (int64_t t = 0; t < n; ++t) {
      __m512 x[DV];
      for (int v = 0; v < DV; ++v) x[v] = _mm512_loadu_ps(values + t * kDim + 16 * v);
      const float* p = probs + t * width + r0;
      for (int i = 0; i < kRowsAtOnce; ++i) {
        if (i >= m) break;
        const __m512 pi = _mm512_set1_ps(p[i]);
        for (int v = 0; v < DV; ++v) acc[i][v] = _mm512_fmadd_ps(pi, x[v], acc[i][v]);
      }
    }
    for (int i = 0; i < m; ++i)
      for (int v = 0; v < DV; ++v) _mm512_storeu_ps(sums + (r0 + i) * kDim + 16 * v, acc[i][v]);
  }
}

// The head sizes tile_value_sums is instantiated for (tile_value_sums_for's cases).
inline bool tiled_prefill_covers(int64_t group, int64_t head_dim) {
  return group <= kTileQueryRows && (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
}

inline void tile_value_sums_for(int64_t head_dim, const float* probs, int64_t width, const float* values, int64_t n,
                                int64_t rows, float* sums) {
  switch (head_dim) {
    case 32: tile_value_sums<2>(probs, width, values, n, rows, sums); break;
    case 64: tile_value_sums<4>(probs, width, values, n, rows, sums); break;
    case 128: tile_value_sums<8>(probs, width, values, n, rows, sums); break;
    default: tile_value_sums<16>(probs, width, values, n, rows, sums); break;  // 256
  }
}

// Queries b0..b1-1 (tokens of one sequence, whose context slots are `slots`) against KV head h.
template <typename T, typename C>
void prefill_tile(const T* q, const C* k_head, const C* v_head, const int64_t* slots, const int64_t* context_lens,
                  T* out, int64_t b0, int64_t b1, int64_t h, int64_t num_heads, int64_t group, int64_t head_dim,
                  float scale, int64_t window) {
  const int64_t rows = (b1 - b0) * group, vectors = (rows + 15) / 16, width = 16 * vectors;
  thread_local std::vector<float> queries, queries_t, keys, values, scores, sums;
  queries.assign(width * head_dim, 0.f), queries_t.resize(head_dim * width);
  keys.resize(kTileKeys * head_dim), values.resize(kTileKeys * head_dim), scores.resize(kTileKeys * width);
  sums.assign(rows * head_dim, 0.f);
  alignas(64) int32_t row_end[kTileQueryRows], row_start[kTileQueryRows];
  alignas(64) float peak[kTileQueryRows], total[kTileQueryRows];
  int64_t first = INT64_MAX, last = 0;
  for (int64_t r = 0; r < width; ++r) {  // rows past `rows` see no key
    row_end[r] = 0, row_start[r] = 0, peak[r] = kMaskedScore, total[r] = 0.f;
    if (r >= rows) continue;
    const int64_t b = b0 + r / group, g = r % group, len = context_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    row_end[r] = static_cast<int32_t>(len), row_start[r] = static_cast<int32_t>(start);
    first = std::min(first, start), last = std::max(last, len);
    const T* qr = q + (b * num_heads + h * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm512_storeu_ps(queries.data() + r * head_dim + d, _mm512_mul_ps(load16(qr + d), _mm512_set1_ps(scale)));
  }
  for (int64_t r = 0; r < width; r += 16)  // query rows across the lanes
    for (int64_t d = 0; d < head_dim; d += 16)
      transpose16(queries.data() + r * head_dim + d, head_dim, queries_t.data() + d * width + r, width);
  for (int64_t c0 = first; c0 < last; c0 += kTileKeys) {
    const int64_t n = std::min(kTileKeys, last - c0), padded = (n + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
    read_context_chunk(k_head, v_head, slots, c0, n, padded, head_dim, keys.data(), values.data(),
                       [](const C* head, int64_t slot, int64_t dim, float* dst) { cache_row_to_float(head, slot, dim, dst); });
    switch (vectors) {
      case 1: tile_scores<1>(queries_t.data(), keys.data(), padded, head_dim, scores.data()); break;
      case 2: tile_scores<2>(queries_t.data(), keys.data(), padded, head_dim, scores.data()); break;
      default: tile_scores<3>(queries_t.data(), keys.data(), padded, head_dim, scores.data()); break;
    }
    // Each row's keys are [row_start, row_end): the rest of the chunk is masked out.
    alignas(64) float chunk_peak[kTileQueryRows];
    std::fill(chunk_peak, chunk_peak + width, kMaskedScore);
    for (int64_t t = 0; t < padded; ++t) {
      float* s = scores.data() + t * width;
      const int32_t position = static_cast<int32_t>(c0 + t);
#pragma omp simd
      for (int64_t r = 0; r < width; ++r) {
        s[r] = position >= row_start[r] && position < row_end[r] ? s[r] : kMaskedScore;
        chunk_peak[r] = std::max(chunk_peak[r], s[r]);
      }
    }
    // Online softmax: rescale what earlier chunks summed to this chunk's running peak.
    alignas(64) float rescale[kTileQueryRows];
#pragma omp simd
    for (int64_t r = 0; r < width; ++r) {
      const float updated = std::max(peak[r], chunk_peak[r]);
      rescale[r] = std::exp(peak[r] - updated);
      peak[r] = updated;
      total[r] *= rescale[r];
    }
    for (int64_t r = 0; r < rows; ++r)
      if (rescale[r] != 1.f)
        for (int64_t d = 0; d < head_dim; ++d) sums[r * head_dim + d] *= rescale[r];
    for (int64_t t = 0; t < padded; ++t) {
      float* s = scores.data() + t * width;
#pragma omp simd
      for (int64_t r = 0; r < width; ++r) {
        s[r] = s[r] <= 0.5f * kMaskedScore ? 0.f : std::exp(s[r] - peak[r]);
        total[r] += s[r];
      }
    }
    tile_value_sums_for(head_dim, scores.data(), width, values.data(), padded, rows, sums.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = b0 + r / group, g = r % group;
    T* o = out + (b * num_heads + h * group + g) * head_dim;
    const __m512 inverse = _mm512_set1_ps(total[r] > 0.f ? 1.f / total[r] : 0.f);
    for (int64_t d = 0; d < head_dim; d += 16)
      store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(sums.data() + r * head_dim + d), inverse));
  }
}

#if defined(GEMEL_AMX)
// Prefill in tiles on AMX (bf16 queries, bf16 or int8 caches): the same tasks as
// prefill_tile, with the two products on tdpbf16ps instead of float32 FMAs: scores from the
// bf16 queries and keys, the softmax in float32 (online, over chunks of kAmxKeys keys), the
// probabilities rounded to bf16 for the weighted sum of the values (as PyTorch's bf16 flash
// attention rounds them), sums in float32. A task takes up to 96 query rows, twice the float32
// path's, since its keys and values are converted and laid out as tiles once per task. A
// 64-token chunk against a 2,000-token context (SmolLM2's 9 query and 3 KV heads): 2.8 ms a
// layer on float32 FMAs, 1.5 ms here; 16 prompts of 128 tokens: 5.7 ms, 3.2 ms.
//
// Tiles: 0-3 hold C (16 rows x 16 keys of scores, or 16 rows x 16 dims of the value sums),
// 4 the A operand (16 query rows x 32 dims, or 16 rows x 32 keys of probabilities), 6-7 B
// (keys as 16 dim pairs x 16 keys; values as 16 key pairs x 16 dims).
constexpr int64_t kAmxKeys = 256;  // keys per chunk, a multiple of 32
constexpr int64_t kAmxTileRows = 96;  // query rows a task takes: six A tiles' worth

// 16 bf16 (as uint16) rows of 32 keys x 2 pairs: lanes interleaved [a0, b0, a1, b1, ...].
inline __m512i interleave16(const uint16_t* a, const uint16_t* b) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

// One cache row as head_dim bf16 values (int8 rows decoded, then rounded to nearest even).
template <typename C>
inline void cache_row_to_bf16(const C* head_cache, int64_t slot, int64_t head_dim, uint16_t* dst) {
  if constexpr (std::is_same_v<C, int8_t>) {
    const int8_t* row = head_cache + slot * (head_dim + 4);
    const __m512 scale = _mm512_set1_ps(row_scale(row, head_dim));
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(codes16(row + d), scale)));
  } else {
    std::memcpy(dst, head_cache + slot * head_dim, head_dim * sizeof(uint16_t));
  }
}

template <typename C>
void prefill_tile_amx(const at::BFloat16* q, const C* k_head, const C* v_head, const int64_t* slots,
                      const int64_t* context_lens, at::BFloat16* out, int64_t b0, int64_t b1, int64_t h,
                      int64_t num_heads, int64_t group, int64_t head_dim, float scale, int64_t window) {
  const int64_t rows = (b1 - b0) * group, blocks = (rows + 15) / 16;
  const int64_t dim_pairs = head_dim / 32, dim_blocks = head_dim / 16;
  thread_local std::vector<uint16_t> queries, keys, values, packed_keys, packed_values, probs;
  thread_local std::vector<float> scores, sums, block_sums;
  queries.assign(blocks * 16 * head_dim, 0), keys.resize(kAmxKeys * head_dim), values.resize(kAmxKeys * head_dim);
  packed_keys.resize(kAmxKeys * head_dim), packed_values.resize(kAmxKeys * head_dim);
  probs.resize(16 * kAmxKeys), scores.resize(16 * kAmxKeys), block_sums.resize(16 * 64);
  sums.assign(blocks * 16 * head_dim, 0.f);
  alignas(64) int64_t row_end[kAmxTileRows], row_start[kAmxTileRows];
  alignas(64) float peak[kAmxTileRows], total[kAmxTileRows];
  int64_t first = INT64_MAX, last = 0;
  for (int64_t r = 0; r < blocks * 16; ++r) {  // rows past `rows` see no key
    row_end[r] = 0, row_start[r] = 0, peak[r] = kMaskedScore, total[r] = 0.f;
    if (r >= rows) continue;
    const int64_t b = b0 + r / group, g = r % group, len = context_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    row_end[r] = len, row_start[r] = start;
    first = std::min(first, start), last = std::max(last, len);
    std::memcpy(queries.data() + r * head_dim, q + (b * num_heads + h * group + g) * head_dim,
                head_dim * sizeof(uint16_t));
  }
  gemel::configure_tiles();
  for (int64_t c0 = first; c0 < last; c0 += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, last - c0), padded = (n + 31) / 32 * 32;
    read_context_chunk(k_head, v_head, slots, c0, n, padded, head_dim, keys.data(), values.data(),
                       [](const C* head, int64_t slot, int64_t dim, uint16_t* dst) { cache_row_to_bf16(head, slot, dim, dst); });
    // Keys as B tiles of 16 dim pairs x 16 keys: a 16 x 16 transpose of 32-bit pairs.
    for (int64_t kb = 0; kb < padded / 16; ++kb)
      for (int64_t kd = 0; kd < dim_pairs; ++kd)
        transpose16(reinterpret_cast<const float*>(keys.data() + kb * 16 * head_dim + kd * 32), head_dim / 2,
                    reinterpret_cast<float*>(packed_keys.data() + (kb * dim_pairs + kd) * 512), 16);
    // Values as B tiles of 16 key pairs x 16 dims.
    for (int64_t kp = 0; kp < padded / 32; ++kp)
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* a = values.data() + (kp * 32 + 2 * i) * head_dim;
        for (int64_t db = 0; db < dim_blocks; ++db)
          _mm512_storeu_si512(packed_values.data() + ((kp * dim_blocks + db) * 16 + i) * 32,
                              interleave16(a + db * 16, a + head_dim + db * 16));
      }
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint16_t* qa = queries.data() + blk * 16 * head_dim;
      // Scores of the block's 16 rows against the chunk, two key blocks at a time.
      for (int64_t kb = 0; kb < padded / 16; kb += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kd = 0; kd < dim_pairs; ++kd) {
          _tile_loadd(4, qa + kd * 32, head_dim * 2);
          _tile_loadd(6, packed_keys.data() + (kb * dim_pairs + kd) * 512, 64);
          _tile_loadd(7, packed_keys.data() + ((kb + 1) * dim_pairs + kd) * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, scores.data() + kb * 16, kAmxKeys * 4);
        _tile_stored(1, scores.data() + (kb + 1) * 16, kAmxKeys * 4);
      }
      // Online softmax, a row at a time; rows' probabilities as bf16 (0 outside their keys).
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = blk * 16 + i;
        const int64_t lo = std::clamp(row_start[r] - c0, int64_t{0}, n);
        const int64_t hi = std::clamp(row_end[r] - c0, int64_t{0}, n);
        float* s = scores.data() + i * kAmxKeys;
        uint16_t* p = probs.data() + i * kAmxKeys;
        if (lo >= hi) {
          std::fill(p, p + padded, 0);
          continue;
        }
        // Lanes of keys t..t+15 that the row sees.
        const auto seen = [lo, hi](int64_t t) {
          if (t + 16 <= lo || t >= hi) return _cvtu32_mask16(0);
          return _cvtu32_mask16((0xFFFFu << std::max<int64_t>(0, lo - t)) & (0xFFFFu >> std::max<int64_t>(0, t + 16 - hi)));
        };
        const int64_t t_lo = lo / 16 * 16;
        __m512 peaks = _mm512_set1_ps(kMaskedScore);
        for (int64_t t = t_lo; t < hi; t += 16) peaks = _mm512_mask_max_ps(peaks, seen(t), peaks, _mm512_loadu_ps(s + t));
        const float updated = std::max(peak[r], _mm512_reduce_max_ps(peaks) * scale);
        const float rescale = std::exp(peak[r] - updated);
        peak[r] = updated;
        const __m512 scales = _mm512_set1_ps(scale), shift = _mm512_set1_ps(updated);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 16) {
          __m512 e = _mm512_setzero_ps();
          if (t >= t_lo && t < hi) {
            e = _mm512_maskz_mov_ps(seen(t), gemel::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), scales, shift)));
            sum = _mm512_add_ps(sum, e);
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        total[r] = total[r] * rescale + _mm512_reduce_add_ps(sum);
        if (rescale != 1.f)
          for (int64_t d = 0; d < head_dim; ++d) sums[r * head_dim + d] *= rescale;
      }
      // Value sums of the block's rows, 64 dims (four C tiles) at a time.
      for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const bool four = head_dim - d0 >= 64;  // a head of 32 dims takes two tiles
        _tile_zero(0);
        _tile_zero(1);
        if (four) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kp = 0; kp < padded / 32; ++kp) {
          const uint16_t* vb = packed_values.data() + (kp * dim_blocks + d0 / 16) * 512;
          _tile_loadd(4, probs.data() + kp * 32, kAmxKeys * 2);
          _tile_loadd(6, vb, 64);
          _tile_loadd(7, vb + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (four) {
            _tile_loadd(6, vb + 1024, 64);
            _tile_loadd(7, vb + 1536, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
          }
        }
        _tile_stored(0, block_sums.data(), 64 * 4);
        _tile_stored(1, block_sums.data() + 16, 64 * 4);
        if (four) {
          _tile_stored(2, block_sums.data() + 32, 64 * 4);
          _tile_stored(3, block_sums.data() + 48, 64 * 4);
        }
        const int64_t width = four ? 64 : 32;
        for (int64_t i = 0; i < 16; ++i) {
          float* acc = sums.data() + (blk * 16 + i) * head_dim + d0;
          for (int64_t d = 0; d < width; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_loadu_ps(block_sums.data() + i * 64 + d)));
        }
      }
    }
  }
  _tile_release();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = b0 + r / group, g = r % group;
    at::BFloat16* o = out + (b * num_heads + h * group + g) * head_dim;
    const __m512 inverse = _mm512_set1_ps(total[r] > 0.f ? 1.f / total[r] : 0.f);
    for (int64_t d = 0; d < head_dim; d += 16)
      store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(sums.data() + r * head_dim + d), inverse));
  }
}
#endif  // GEMEL_AMX

// Prefill queries in tiles of consecutive tokens of one sequence, one task per (tile, KV head).
template <typename T, typename C>
void prefill_attention_tiled(const T* q, const C* k_cache, const C* v_cache, const int64_t* kv_slots,
                             const int64_t* token_seq, const int64_t* context_lens, T* out, int64_t batch,
                             int64_t num_heads, int64_t num_kv, int64_t head_dim, int64_t num_slots, int64_t max_ctx,
                             float scale, int64_t window) {
#if defined(GEMEL_AMX)
  // bf16 queries over a bf16 or int8 cache: the types prefill_tile_amx is built for.
  constexpr bool amx_types =
      std::is_same_v<T, at::BFloat16> && (std::is_same_v<C, at::BFloat16> || std::is_same_v<C, int8_t>);
  const bool on_amx = amx_types && gemel::amx_usable();
  const int64_t task_rows = on_amx ? kAmxTileRows : kTileQueryRows;
#else
  const int64_t task_rows = kTileQueryRows;  // AVX-512 without AMX (e.g. AMD Zen 4/5)
#endif
  const int64_t group = num_heads / num_kv, tokens_per_tile = task_rows / group;
  const int64_t row_width = std::is_same_v<C, int8_t> ? head_dim + 4 : head_dim;
  std::vector<int64_t> tile_start;
  for (int64_t b = 0; b < batch; ++b)
    if (tile_start.empty() || token_seq[b] != token_seq[tile_start.back()] || b - tile_start.back() == tokens_per_tile)
      tile_start.push_back(b);
  const int64_t tiles = static_cast<int64_t>(tile_start.size());
  gemel::parallel_items(tiles * num_kv, [&](int64_t task) {
    const int64_t tile = task / num_kv, h = task % num_kv;
    const int64_t b0 = tile_start[tile], b1 = tile + 1 < tiles ? tile_start[tile + 1] : batch;
#if defined(GEMEL_AMX)
    if constexpr (amx_types) {
      if (on_amx) {
        prefill_tile_amx<C>(q, k_cache + h * num_slots * row_width, v_cache + h * num_slots * row_width,
                            kv_slots + token_seq[b0] * max_ctx, context_lens, out, b0, b1, h, num_heads, group,
                            head_dim, scale, window);
        return;
      }
    }
#endif
    prefill_tile<T, C>(q, k_cache + h * num_slots * row_width, v_cache + h * num_slots * row_width,
                       kv_slots + token_seq[b0] * max_ctx, context_lens, out, b0, b1, h, num_heads, group, head_dim,
                       scale, window);
  });
}
#endif

// q: [B, Hq, D]; k_cache, v_cache: [Hkv, slots, D] (same dtype as q, or float16 under float32
// q), or int8 [Hkv, slots, D + 4] (layers/kv_cache.py); kv_slots: [S, max_ctx]
// int64 cache slots of each sequence's positions 0..len-1; token_seq: [B] int64 row of
// kv_slots for each query (undefined: row b); context_lens: [B] int64 keys each query sees.
// window > 0 restricts each query to its last `window` positions (sliding-window layers).
at::Tensor paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& kv_slots, const c10::optional<at::Tensor>& token_seq,
                                const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,Hq,D], caches [Hkv,S,D]");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  // float16 caches under float32 queries: half the bytes of a float32 cache (the AVX2 plan's
  // KV cache, as llama.cpp's f16 default); rows are widened to float32 as they are read.
  const bool half_cache = k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat;
  TORCH_CHECK((int8_cache || half_cache || q.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must have q's dtype, be int8, or be float16 under float32 queries");
  TORCH_CHECK(k_cache.size(2) == (int8_cache ? q.size(2) + 4 : q.size(2)) && v_cache.sizes() == k_cache.sizes(),
              "cache rows must be head_dim wide (int8: head_dim + 4)");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "kv_slots and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(context_lens.numel() == q.size(0), "one context length per query");
  const auto qc = q.contiguous();
  const auto slots = kv_slots.contiguous();
  const auto lens = context_lens.contiguous();
  at::Tensor rows;
  if (token_seq.has_value()) {
    rows = token_seq->contiguous();
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == q.size(0), "token_seq: one int64 row per query");
  }
  auto out = at::empty_like(qc);
  const int64_t batch = qc.size(0), num_heads = qc.size(1), head_dim = qc.size(2);
  const int64_t* row_of = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (half_cache) {
        const float* qp = qc.data_ptr<float>();
        const at::Half *kp = k_cache.data_ptr<at::Half>(), *vp = v_cache.data_ptr<at::Half>();
#if defined(__AVX512F__)
        if (row_of != nullptr && tiled_prefill_covers(num_heads / k_cache.size(0), head_dim)) {
          prefill_attention_tiled<float, at::Half>(qp, kp, vp, slots.data_ptr<int64_t>(), row_of, lens.data_ptr<int64_t>(),
                                                   out.data_ptr<float>(), batch, num_heads, k_cache.size(0), head_dim,
                                                   k_cache.size(1), slots.size(1), static_cast<float>(scale), window);
          return;
        }
#endif
        decode_attention<float, at::Half>(qp, kp, vp, slots.data_ptr<int64_t>(), row_of, lens.data_ptr<int64_t>(),
                                          out.data_ptr<float>(), batch, num_heads, k_cache.size(0), head_dim,
                                          k_cache.size(1), slots.size(1), static_cast<float>(scale), window);
        return;
      }
    }
#if defined(__AVX512F__)
    if constexpr (kHasLoad16<scalar_t>) {
      if (row_of != nullptr && tiled_prefill_covers(num_heads / k_cache.size(0), head_dim)) {
        if (int8_cache)
          prefill_attention_tiled<scalar_t, int8_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(),
                                                    v_cache.data_ptr<int8_t>(), slots.data_ptr<int64_t>(), row_of,
                                                    lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                                                    num_heads, k_cache.size(0), head_dim, k_cache.size(1),
                                                    slots.size(1), static_cast<float>(scale), window);
        else
          prefill_attention_tiled<scalar_t, scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                                      v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), row_of,
                                                      lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                                                      num_heads, k_cache.size(0), head_dim, k_cache.size(1),
                                                      slots.size(1), static_cast<float>(scale), window);
        return;
      }
    }
#endif
    if (int8_cache) {
      decode_attention<scalar_t, int8_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(),
                                         v_cache.data_ptr<int8_t>(), slots.data_ptr<int64_t>(), row_of,
                                         lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, num_heads,
                                         k_cache.size(0), head_dim, k_cache.size(1), slots.size(1),
                                         static_cast<float>(scale), window);
    } else {
      decode_attention<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                 slots.data_ptr<int64_t>(), row_of, lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                 batch, num_heads, k_cache.size(0), head_dim, k_cache.size(1), slots.size(1),
                                 static_cast<float>(scale), window);
    }
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& kv_slots, const at::Tensor& context_lens, double scale,
                                  int64_t window) {
  return paged_attention_impl(q, k_cache, v_cache, kv_slots, c10::nullopt, context_lens, scale, window);
}

// Prefill: several query tokens per sequence, each attending causally to its own prefix.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& kv_slots, const at::Tensor& token_seq,
                                   const at::Tensor& context_lens, double scale, int64_t window) {
  return paged_attention_impl(q, k_cache, v_cache, kv_slots, token_seq, context_lens, scale, window);
}

}  // namespace

at::Tensor gemel::ops::paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& kv_slots, const at::Tensor& context_lens, double scale,
                                              int64_t window) {
  return ::paged_decode_attention(q, k_cache, v_cache, kv_slots, context_lens, scale, window);
}

TORCH_LIBRARY_FRAGMENT(gemel, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_slots, "
        "Tensor context_lens, float scale, int window) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_slots, "
        "Tensor token_seq, Tensor context_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemel, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
