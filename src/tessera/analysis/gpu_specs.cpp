#include "tessera/analysis/gpu_specs.h"

#include <algorithm>
#include <cctype>

#include <yaml-cpp/yaml.h>

#include "tessera/config/embedded_configs.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

}  // namespace

std::vector<GpuSpec> load_gpu_specs() {
  for (const EmbeddedConfig& c : embedded_configs()) {
    if (c.path != "gpus.yaml") continue;
    std::vector<GpuSpec> specs;
    YAML::Node root = YAML::Load(std::string(c.content));
    for (const auto& kv : root["gpus"]) {
      GpuSpec s;
      s.name = kv.first.as<std::string>();
      const YAML::Node& n = kv.second;
      for (const auto& m : n["match"]) s.match.push_back(m.as<std::string>());
      s.bf16_tflops = n["bf16_tflops"].as<double>();
      s.fp16_tflops = n["fp16_tflops"].as<double>();
      s.fp8_tflops = n["fp8_tflops"].as<double>();
      s.fp32_tflops = n["fp32_tflops"].as<double>();
      s.hbm_gb = n["hbm_gb"].as<double>();
      s.hbm_tbps = n["hbm_tbps"].as<double>();
      s.source = n["source"].as<std::string>("");
      specs.push_back(std::move(s));
    }
    return specs;
  }
  throw InternalError("configs/gpus.yaml is not embedded in this binary");
}

std::optional<GpuSpec> find_gpu_spec(std::string_view name_or_device) {
  const std::string want = lower(name_or_device);
  std::vector<GpuSpec> specs = load_gpu_specs();
  for (const GpuSpec& s : specs) {
    if (lower(s.name) == want) return s;
  }
  for (const GpuSpec& s : specs) {
    for (const std::string& m : s.match) {
      if (want.find(lower(m)) != std::string::npos) return s;
    }
  }
  return std::nullopt;
}

GpuSpec require_gpu_spec(std::string_view name) {
  if (auto spec = find_gpu_spec(name)) return *spec;
  std::string known;
  for (const GpuSpec& s : load_gpu_specs()) known += (known.empty() ? "" : ", ") + s.name;
  throw ConfigError("command line", "gpu", std::string(name),
                    "one of " + known + " (configs/gpus.yaml)");
}

double peak_tflops(const GpuSpec& spec, std::string_view dtype) {
  if (dtype == "bf16") return spec.bf16_tflops;
  if (dtype == "fp16") return spec.fp16_tflops;
  if (dtype.starts_with("fp8")) return spec.fp8_tflops;
  if (dtype == "fp32") return spec.fp32_tflops;
  return 0;
}

DtypeInfo dtype_info(std::string_view name) {
  std::string n = lower(name);
  if (n.starts_with("c10::")) n = n.substr(5);
  if (n.starts_with("torch.")) n = n.substr(6);
  static const std::pair<const char*, DtypeInfo> kNames[] = {
      {"float", {"fp32", 4}},
      {"float32", {"fp32", 4}},
      {"fp32", {"fp32", 4}},
      {"f32", {"fp32", 4}},
      {"bfloat16", {"bf16", 2}},
      {"bf16", {"bf16", 2}},
      {"half", {"fp16", 2}},
      {"float16", {"fp16", 2}},
      {"fp16", {"fp16", 2}},
      {"f16", {"fp16", 2}},
      {"double", {"fp64", 8}},
      {"float64", {"fp64", 8}},
      {"fp64", {"fp64", 8}},
      {"f64", {"fp64", 8}},
      {"long", {"i64", 8}},
      {"long int", {"i64", 8}},
      {"int64", {"i64", 8}},
      {"i64", {"i64", 8}},
      {"int", {"i32", 4}},
      {"int32", {"i32", 4}},
      {"i32", {"i32", 4}},
      {"byte", {"u8", 1}},
      {"unsigned char", {"u8", 1}},
      {"uint8", {"u8", 1}},
      {"u8", {"u8", 1}},
      {"char", {"i8", 1}},
      {"signed char", {"i8", 1}},
      {"int8", {"i8", 1}},
      {"i8", {"i8", 1}},
      {"bool", {"bool", 1}},
  };
  for (const auto& [spelling, info] : kNames) {
    if (n == spelling) return info;
  }
  // fp8 variants: Float8_e4m3fn, Float8_e4m3fnuz, fp8_e4m3, e4m3, f8e5m2, ...
  if (n.find("e4m3") != std::string::npos) return {"fp8_e4m3", 1};
  if (n.find("e5m2") != std::string::npos) return {"fp8_e5m2", 1};
  return {n, 0};
}

}  // namespace tessera::analysis
