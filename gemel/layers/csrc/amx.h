// AMX tile setup shared by the kernels that use tiles (amx_bf16_gemm.cpp, paged_attention.cpp).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define GEMEL_AMX 1
#endif

namespace gemel {

// Linux hands out AMX's tile state only to processes that ask for it (arch_prctl).
inline bool amx_usable() {
#if defined(GEMEL_AMX)
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

#if defined(GEMEL_AMX)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile used here is 16 rows of 64 bytes (16 float32, or 32 bf16 as 16 pairs).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

#endif  // GEMEL_AMX

}  // namespace gemel
