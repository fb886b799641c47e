// What AMX tile instructions cost on this CPU, one thread: nanoseconds per tdpbf16ps in loop
// shapes that a bf16 GEMM can use (bench/amx_tile_rates.py compiles and runs this).
//
// The x rows (64 x 576 bf16, 72 KB) and the weight tiles (960 outputs x 576, 1.1 MB) stay in
// L1/L2 across passes, so memory is out of the picture: what is left is the tile unit's own
// rate and what loading operand tiles costs next to it.
//
//   tdp only           four tdpbf16ps per step on tiles already loaded
//   2x2, same tiles    + two row tiles and two weight tiles loaded per step, always from the
//                      same addresses (hot in L1)
//   2x2 (the kernel)   two row tiles of x by two weight tiles per K step over all of K, as
//                      amx_bf16_gemm.cpp runs them: one tile load per tdpbf16ps
//   2x2, loads first   the same, the four loads issued before the four products
//   1x2, double-buffered
//                      one row tile by two weight tiles, operands alternating between two
//                      sets of tiles so that a step's loads need not wait for the last
//                      step's products: 1.5 loads per product
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { M = 64, K = 576, N = 960, G = K / 32, PAIRS = N / 32, PASSES = 40 };

typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t *x, *w;
static float out[4 * 256] __attribute__((aligned(64)));

// One pass of a loop shape over all pairs of weight blocks and all rows; returns products.
static long pass(int shape) {
  const long stride = K * 2;
  long products = 0;
  for (int p = 0; p < PAIRS; ++p) {
    const uint16_t *b0 = w + (2 * p) * G * 512, *b1 = w + (2 * p + 1) * G * 512;
    for (int r = 0; r < M; r += 32) {
      const uint16_t *a0 = x + r * K, *a1 = x + (r + 16) * K;
      if (shape == 4) {  // 1x2 double-buffered: each row tile on its own
        for (int half = 0; half < 2; ++half) {
          const uint16_t* a = half ? a1 : a0;
          _tile_zero(0);
          _tile_zero(1);
          for (int g = 0; g + 1 < G; g += 2) {
            _tile_loadd(2, a + g * 32, stride);
            _tile_loadd(4, b0 + g * 512, 64);
            _tile_loadd(5, b1 + g * 512, 64);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
            _tile_loadd(3, a + (g + 1) * 32, stride);
            _tile_loadd(6, b0 + (g + 1) * 512, 64);
            _tile_loadd(7, b1 + (g + 1) * 512, 64);
            _tile_dpbf16ps(0, 3, 6);
            _tile_dpbf16ps(1, 3, 7);
            products += 4;
          }
          _tile_stored(0, out, 64);
          _tile_stored(1, out + 256, 64);
        }
        continue;
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int g = 0; g < G; ++g) {
        switch (shape) {
          case 0:
            break;
          case 1:
            _tile_loadd(4, a0, stride);
            _tile_loadd(5, a1, stride);
            _tile_loadd(6, b0, 64);
            _tile_loadd(7, b1, 64);
            break;
          case 2:
            _tile_loadd(4, a0 + g * 32, stride);
            _tile_loadd(6, b0 + g * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + g * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + g * 32, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            products += 4;
            continue;
          case 3:
            _tile_loadd(4, a0 + g * 32, stride);
            _tile_loadd(5, a1 + g * 32, stride);
            _tile_loadd(6, b0 + g * 512, 64);
            _tile_loadd(7, b1 + g * 512, 64);
            break;
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        products += 4;
      }
      _tile_stored(0, out, 64);
      _tile_stored(1, out + 256, 64);
      _tile_stored(2, out + 512, 64);
      _tile_stored(3, out + 768, 64);
    }
  }
  return products;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    fprintf(stderr, "the kernel did not grant AMX tile state\n");
    return 1;
  }
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  x = aligned_alloc(64, M * K * 2);
  w = aligned_alloc(64, (size_t)N * K * 2);
  for (int i = 0; i < M * K; ++i) x[i] = 0x3f80;  // 1.0
  for (long i = 0; i < (long)N * K; ++i) w[i] = 0x3c00;  // 2^-7
  const char* names[] = {"tdp only", "2x2, same tiles", "2x2 (the kernel)", "2x2, loads first", "1x2, double-buffered"};
  double best[5], worst[5];
  for (int s = 0; s < 5; ++s) best[s] = 1e9, worst[s] = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int s = 0; s < 5; ++s) {  // the shapes take turns, so that the machine's drift hits all
      pass(s);
      const double start = now();
      long products = 0;
      for (int i = 0; i < PASSES; ++i) products += pass(s);
      const double ns = (now() - start) / products * 1e9;
      best[s] = ns < best[s] ? ns : best[s];
      worst[s] = ns > worst[s] ? ns : worst[s];
    }
  }
  _tile_release();
  for (int s = 0; s < 5; ++s)
    printf("%s\t%.1f\t%.1f\t%.2f\n", names[s], best[s], worst[s], 16.0 * 16 * 32 * 2 / best[s] / 1e3);
  return 0;
}
