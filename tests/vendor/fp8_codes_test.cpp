// The FP8 casts of GPUs without FP8 conversion instructions (backend/cuda/vendors/fp8_codes.h,
// which the HIP vendor header's kernels use) give core/fp8.h's codes: at every FP8 value, at
// every halfway point between two (where rounding to even decides), beyond the range, at the
// special values, and over a sweep of all fp32 bit patterns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tessera/backend/cuda/vendors/fp8_codes.h"
#include "tessera/core/fp8.h"

namespace tessera {
namespace {

float from_bits(uint32_t bits) {
  float x = 0.0f;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

template <DType kFormat>
void expect_reference_codes() {
  std::vector<float> inputs;
  // Every code's value, its neighbours, and the halfway points to the next larger code.
  for (int code = 0; code < 256; ++code) {
    const float v = fp8_bits_to_float(static_cast<uint8_t>(code), kFormat);
    if (!std::isfinite(v)) continue;
    const float up = std::copysign(std::numeric_limits<float>::infinity(), v);
    inputs.insert(inputs.end(), {v, std::nextafter(v, 0.0f), std::nextafter(v, up)});
    const float next = fp8_bits_to_float(static_cast<uint8_t>(code + 1), kFormat);
    if ((code & 0x7F) == 0x7F || !std::isfinite(next)) continue;
    const float half = (v + next) / 2;  // exact: FP8 values have few significant bits
    inputs.insert(inputs.end(), {half, std::nextafter(half, 0.0f), std::nextafter(half, up)});
  }
  // Beyond the range: saturation, the halfway point above max, infinities, NaN.
  const float max = fp8_max(kFormat);
  for (float sign : {1.0f, -1.0f})
    for (float x :
         {max * 1.0625f, max * 1.5f, max * 2.0f, std::numeric_limits<float>::max(),
          std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(), 0.0f})
      inputs.push_back(sign * x);
  inputs.push_back(std::numeric_limits<float>::quiet_NaN());
  inputs.push_back(-std::numeric_limits<float>::quiet_NaN());
  // A sweep of every fp32 exponent and sign with scattered mantissas.
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 4099) inputs.push_back(from_bits(bits));

  int mismatches = 0;
  std::string first;
  for (float x : inputs) {
    const uint8_t expected = float_to_fp8_bits(x, kFormat);
    const uint8_t got = cuda::fp8_encode_bits<kFormat>(x);
    if (got == expected) continue;
    if (++mismatches <= 5) {
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof(bits));
      first += "x=" + std::to_string(x) + " (bits " + std::to_string(bits) +
               "): " + std::to_string(got) + " vs " + std::to_string(expected) + "; ";
    }
  }
  EXPECT_EQ(mismatches, 0) << dtype_name(kFormat) << " of " << inputs.size()
                           << " inputs: " << first;
}

TEST(Vendor, SoftwareFp8CodesMatchTheReference) {
  expect_reference_codes<DType::E4M3>();
  expect_reference_codes<DType::E5M2>();
}

}  // namespace
}  // namespace tessera
