#pragma once
// fp32 master weights kept as two 16-bit halves (docs/memory.md, split master weights): the
// high half is the bf16 parameter the model computes with, the low half the fp32 value's low
// 16 bits. Together they hold every fp32 value exactly, in 4 bytes a parameter where a master
// copy beside bf16 parameters takes 6.
//
// Why the high half rounds ties away from zero: the bf16 values that round to an even h under
// round-to-nearest-even span 65,537 fp32 bit patterns (both ties included), one more than 16
// low bits can tell apart. Adding half a bf16 step to the bits before truncating gives each h
// exactly the 65,536 patterns [h - 0x8000, h + 0x7fff] (in units of the low bits), so the
// low half alone says whether the rounding carried. The parameters then differ from a
// round-to-nearest-even copy only where the fp32 value lies exactly halfway between two bf16
// values, by one bf16 step.
#include <cstdint>
#include <cstring>

#include "tessera/core/host_device.h"

namespace tessera {

// The bf16 bits of fp32 bits, rounded to nearest with ties away from zero (magnitudes are the
// low 31 bits of both formats, so adding 0x8000 rounds the magnitude). NaN stays NaN.
TS_HOST_DEVICE uint16_t split_master_high(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x8000u) >> 16);
}

TS_HOST_DEVICE uint16_t split_master_low(uint32_t bits) {
  return static_cast<uint16_t>(bits & 0xffffu);
}

// The fp32 bits split_master_high / split_master_low came from: the high half less the carry
// that a low half of 0x8000 or more caused.
TS_HOST_DEVICE uint32_t split_master_join(uint16_t high, uint16_t low) {
  // A NaN's high half keeps its own top bits (quieted): the low half cannot restore a carry.
  if ((high & 0x7fffu) > 0x7f80u) return (static_cast<uint32_t>(high) << 16) | low;
  const uint32_t truncated = static_cast<uint32_t>(high) - (static_cast<uint32_t>(low) >> 15);
  return (truncated << 16) | low;
}

// n fp32 values split into their halves, and joined back: the host's loops (checkpoints, the
// CPU backends).
inline void split_master_values(const float* master, uint16_t* high, uint16_t* low, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, master + i, 4);
    high[i] = split_master_high(bits);
    low[i] = split_master_low(bits);
  }
}

inline void join_master_values(const uint16_t* high, const uint16_t* low, float* master, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = split_master_join(high[i], low[i]);
    std::memcpy(master + i, &bits, 4);
  }
}

}  // namespace tessera
