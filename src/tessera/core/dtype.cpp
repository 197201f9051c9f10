#include "tessera/core/dtype.h"

namespace tessera {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::E4M3: return "fp8_e4m3";
    case DType::E5M2: return "fp8_e5m2";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
    case DType::U16: return "uint16";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  struct Alias {
    std::string_view name;
    DType type;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::F32},     {"float32", DType::F32},  {"f32", DType::F32},
      {"bf16", DType::BF16},    {"bfloat16", DType::BF16}, {"fp16", DType::F16},
      {"float16", DType::F16},  {"fp8_e4m3", DType::E4M3}, {"e4m3", DType::E4M3},
      {"fp8_e5m2", DType::E5M2}, {"e5m2", DType::E5M2},    {"int32", DType::I32},
      {"int64", DType::I64},    {"uint8", DType::U8},     {"uint16", DType::U16},
  };
  for (const auto& a : kAliases) {
    if (a.name == name) {
      *out = a.type;
      return true;
    }
  }
  return false;
}

}  // namespace tessera
