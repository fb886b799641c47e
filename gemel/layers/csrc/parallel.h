// Work handed out one item at a time on PyTorch's OpenMP thread pool.
//
// at::parallel_for gives each thread a fixed share of the range. Where items differ in
// size (attention tasks over contexts of different lengths), one thread then finishes early
// and waits at the barrier; handing items out one at a time (dynamic scheduling) keeps both
// busy to the end.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
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

}  // namespace gemel
