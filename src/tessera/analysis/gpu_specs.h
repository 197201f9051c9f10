#pragma once
// GPU peak figures (configs/gpus.yaml, embedded in the binary) and element types as traces
// spell them, for FLOP/s, % of peak and roofline columns.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::analysis {

struct GpuSpec {
  std::string name;  // "H100", "MI300X", ...
  std::vector<std::string> match;
  double bf16_tflops = 0, fp16_tflops = 0, fp8_tflops = 0, fp32_tflops = 0;
  double hbm_gb = 0, hbm_tbps = 0;
  std::string source;
};

std::vector<GpuSpec> load_gpu_specs();
// By name ("h200" works too) or, failing that, by the match substrings of a device name.
std::optional<GpuSpec> find_gpu_spec(std::string_view name_or_device);
// The spec a --gpu option names (as find_gpu_spec); throws ConfigError listing the known names.
GpuSpec require_gpu_spec(std::string_view name);
// Dense peak for an element type name from dtype_info() (fp8_e4m3 -> fp8 peak); 0 if none.
double peak_tflops(const GpuSpec& spec, std::string_view dtype);

struct DtypeInfo {
  std::string name;  // canonical: fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp64, i64, ...
  int bytes = 0;     // 0 when unknown
};
// Accepts PyTorch ("c10::BFloat16", "float", "BFloat16", "Float"), NCCL ("f32") and Tessera
// ("bf16") spellings.
DtypeInfo dtype_info(std::string_view name);

}  // namespace tessera::analysis
