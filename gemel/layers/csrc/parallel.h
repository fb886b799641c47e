// Work shared out on PyTorch's OpenMP thread pool by its cost, not by its count.
//
// at::parallel_for gives each thread a fixed share of the range. Where items differ in
// size (attention tasks over contexts of different lengths), one thread then finishes early
// and waits at the barrier. parallel_items hands items out one at a time (dynamic
// scheduling), which keeps both busy to the end; parallel_ranges gives each thread a
// contiguous run of about equal cost, so a thread knows its next item in advance.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>

namespace gemel {

// fn(i) for i in [0, count), each item on whichever thread is free next.
template <typename F>
inline void parallel_items(int64_t count, const F& fn) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) fn(i);
}

constexpr int64_t kMaxRangeThreads = 256;

// fn(begin, end) once per thread, over contiguous ranges of [0, count) of about equal total
// cost (cost(i) >= 0). Each thread then knows the items it runs next, so it can ask for their
// data while it works on the current one, which items handed out one at a time do not allow.
template <typename C, typename F>
inline void parallel_ranges(int64_t count, const C& cost, const F& fn) {
  const int threads = static_cast<int>(std::min<int64_t>({at::get_num_threads(), count, kMaxRangeThreads}));
  if (threads <= 1 || at::in_parallel_region()) {
    fn(int64_t{0}, count);
    return;
  }
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) total += static_cast<double>(cost(i));
  std::array<int64_t, kMaxRangeThreads + 1> bounds;  // thread j runs [bounds[j], bounds[j + 1])
  bounds[0] = 0;
  double running = 0.0;
  int64_t i = 0;
  for (int j = 1; j < threads; ++j) {
    for (const double share = total * j / threads; i < count && running < share; ++i) running += cost(i);
    bounds[j] = i;
  }
  bounds[threads] = count;
#pragma omp parallel num_threads(threads)
  {
    const int j = omp_get_thread_num();
    if (j < threads && bounds[j] < bounds[j + 1]) fn(bounds[j], bounds[j + 1]);
  }
}

}  // namespace gemel
