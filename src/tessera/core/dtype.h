#pragma once
// Element types of tensors, with host-side conversions used by references, tests and I/O.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace tessera {

enum class DType : uint8_t { F32, BF16, F16, E4M3, E5M2, I32, I64, U8, U16 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::E4M3: return 1;
    case DType::E5M2: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::U16: return 2;
  }
  return 0;
}

std::string_view dtype_name(DType t);
// Parses "fp32"/"float32", "bf16"/"bfloat16", ...; returns false on an unknown name.
bool parse_dtype(std::string_view name, DType* out);

inline bool is_floating(DType t) {
  return t != DType::I32 && t != DType::I64 && t != DType::U8 && t != DType::U16;
}

// bfloat16 <-> float on the host, round-to-nearest-even like the hardware conversion.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

}  // namespace tessera
