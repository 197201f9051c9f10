#pragma once
// FP8 codes computed with integer operations, for vendors whose GPUs have no FP8 conversion
// instruction (vendors/hip.h: gfx90a has none). The same codes as core/fp8.h's
// float_to_fp8_bits: round to nearest even, finite values beyond the range and +-Inf saturate
// to +-max, NaN -> 0x7F, the sign of zero kept (tests/vendor checks them against it).
#include <cstdint>
#include <cstring>

#include "tessera/core/dtype.h"
#include "tessera/core/host_device.h"

namespace tessera::cuda {

template <DType kFormat>
TS_HOST_DEVICE uint8_t fp8_encode_bits(float x) {
  static_assert(kFormat == DType::E4M3 || kFormat == DType::E5M2, "an FP8 format");
  constexpr bool kE4M3 = kFormat == DType::E4M3;
  constexpr int kMantissaBits = kE4M3 ? 3 : 2;
  constexpr int kBias = kE4M3 ? 7 : 15;
  constexpr uint32_t kMaxBits = kE4M3 ? 0x43E00000u : 0x47600000u;  // 448, 57344 as fp32
  constexpr uint8_t kMaxCode = kE4M3 ? 0x7E : 0x7B;
  constexpr int kShift = 23 - kMantissaBits;  // fp32 mantissa bits below the FP8 ones
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;

  uint32_t bits = 0;
  memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7F;           // NaN
  if (magnitude >= kMaxBits) return sign | kMaxCode;  // saturate, Inf included
  if (magnitude >= kMinNormalBits) {
    // Normal in FP8: drop kShift mantissa bits rounding to nearest even (a carry out of the
    // mantissa moves into the exponent, as it should), then rebias the exponent.
    const uint32_t rounded = magnitude + ((1u << (kShift - 1)) - 1) + ((magnitude >> kShift) & 1u);
    return sign | static_cast<uint8_t>((rounded >> kShift) -
                                       (static_cast<uint32_t>(127 - kBias) << kMantissaBits));
  }
  // Subnormal in FP8 (or zero): the code is the magnitude in units of the subnormal spacing
  // 2^(1 - bias - mantissa_bits), rounded to nearest even; rounding up from the largest
  // subnormal gives the smallest normal's code, 1 << mantissa_bits, as it should.
  const int exponent = static_cast<int>(magnitude >> 23);
  if (exponent == 0) return sign;  // fp32 subnormals are far below half the FP8 spacing
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  const int shift = (150 - kBias - kMantissaBits + 1) - exponent;  // >= 24 - kMantissaBits
  if (shift > 24) return sign;  // below half the smallest subnormal
  const uint32_t code = significand >> shift, rest = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return sign | static_cast<uint8_t>(code + (rest > half || (rest == half && (code & 1u))));
}

}  // namespace tessera::cuda
