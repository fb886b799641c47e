// int8_act_gemm's packed weight layout (gemel.layers.linear.pack_group_codes), shared by every
// build's tiles: output rows in blocks of 16, the input in groups of 32, and per block and
// group 8 vectors of 64 bytes where bytes 4i..4i+3 of vector j are output row i's codes
// 4j..4j+3. Torch-free, so that tests/csrc/neon_tiles_check.cpp can include it for ARM.
#pragma once

#include <cstdint>

namespace gemel::int8_act {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kBlockBytes = kBlockRows * kGroup;                      // one group's 8-bit codes of one block
constexpr int64_t kNibbleBlockBytes = kBlockBytes / 2;                    // 4-bit: vector j < 4 low nibbles, j + 4 high
constexpr int64_t kFiveBlockBytes = kNibbleBlockBytes + kBlockBytes / 8;  // 5-bit: the nibbles, then a plane of fifth bits

// A block's codes for one group: 4-bit codes two to a byte (5-bit ones with their plane of
// fifth bits after), any others as bytes.
template <bool kNibbles, bool kFive = false>
constexpr int64_t kGroupCodeBytes = kFive ? kFiveBlockBytes : kNibbles ? kNibbleBlockBytes : kBlockBytes;

}  // namespace gemel::int8_act
