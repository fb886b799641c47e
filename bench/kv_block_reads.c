// How fast this machine reads memory in the pattern of a paged KV cache: runs of RUN bytes (a
// 16-slot block of one head: 2 KB for float16 rows of 64) at random places in a large buffer,
// each thread asking for the run AHEAD runs on as it reads (as decode attention does), against
// one sequential read. The memory-bound floor of decode attention at batch 32 is its bytes
// over the random rate, not the sequential one.
//
//     gcc -O2 -mavx2 -fopenmp bench/kv_block_reads.c -o /tmp/kv_block_reads
//     /tmp/kv_block_reads [RUN bytes ...]     # default: 2048 4096 8192 16384
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// GB/s of reading the runs in `order` (each `run` bytes of `buf`) on `threads` threads.
static double read_runs(const char* buf, const size_t* order, size_t runs, size_t run, int threads, int ahead) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t = now();
    int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const size_t id = omp_get_thread_num(), lo = runs / threads * id, hi = runs / threads * (id + 1);
      __m256i acc = _mm256_setzero_si256();
      for (size_t r = lo; r < hi; ++r) {
        const char* p = buf + order[r] * run;
        const char* next = r + ahead < hi ? buf + order[r + ahead] * run : NULL;
        for (size_t i = 0; i < run; i += 64) {
          if (next) _mm_prefetch(next + i, _MM_HINT_T0);
          acc = _mm256_add_epi8(acc, _mm256_load_si256((const __m256i*)(p + i)));
          acc = _mm256_add_epi8(acc, _mm256_load_si256((const __m256i*)(p + i + 32)));
        }
      }
      sink += _mm256_extract_epi8(acc, 0);
    }
    const double rate = runs * run / (now() - t) / 1e9;
    if (rate > best) best = rate;
    if (sink == 12345) printf(" ");
  }
  return best;
}

int main(int argc, char** argv) {
  const size_t bytes = 512ul << 20;
  char* buf = aligned_alloc(2ul << 20, bytes);
  madvise(buf, bytes, MADV_HUGEPAGE);  // as PyTorch's allocator asks for the engine's KV pool
  memset(buf, 1, bytes);
  const size_t default_runs[] = {2048, 4096, 8192, 16384};
  const int count = argc > 1 ? argc - 1 : 4;
  printf("| run | 1 thread GB/s | 2 threads GB/s |\n|---|---|---|\n");
  for (int c = 0; c < count; ++c) {
    const size_t run = argc > 1 ? strtoul(argv[c + 1], NULL, 10) : default_runs[c];
    const size_t runs = bytes / run;
    size_t* order = malloc(runs * sizeof(size_t));
    for (size_t i = 0; i < runs; ++i) order[i] = i;
    srand(1);
    for (size_t i = runs - 1; i > 0; --i) {  // a shuffled order of the runs
      const size_t j = (size_t)rand() % (i + 1), t = order[i];
      order[i] = order[j], order[j] = t;
    }
    printf("| %zu B at random | %.1f | %.1f |\n", run, read_runs(buf, order, runs, run, 1, 4),
           read_runs(buf, order, runs, run, 2, 4));
    for (size_t i = 0; i < runs; ++i) order[i] = i;
    if (c == count - 1)
      printf("| in sequence | %.1f | %.1f |\n", read_runs(buf, order, runs, run, 1, 4), read_runs(buf, order, runs, run, 2, 4));
    free(order);
  }
  return 0;
}
