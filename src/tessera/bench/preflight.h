#pragma once
// `tessera preflight`: is this machine ready to train? The GPU, driver, CUDA runtime, cuBLASLt,
// cuDNN and NCCL versions, GPU memory, and two quick measurements held against the datasheet
// (configs/gpus.yaml): a bf16 GEMM and device-to-device copy bandwidth. One line per check
// with a verdict: pass, warn (worth a look; nothing is blocked) or info (a fact).
#include <cstdint>
#include <string>

#include "tessera/analysis/table.h"

namespace tessera::bench {

// Thresholds against the datasheet: a healthy H100/H200 reaches ~78% of the dense bf16 peak
// in a large cuBLASLt GEMM and ~80-90% of the HBM bandwidth in a large copy.
inline constexpr double kGemmPassFraction = 0.70;
inline constexpr double kCopyPassFraction = 0.70;
inline constexpr double kFreeMemoryPassFraction = 0.90;  // less: other processes hold memory
inline constexpr double kCapacityPassFraction = 0.95;    // less: a MIG slice or another SKU

struct PreflightOptions {
  std::string gpu;  // spec table name; empty: match the device name
  int64_t gemm_size = 8192;
  int64_t copy_mib = 1024;
};

struct PreflightReport {
  analysis::Table checks;  // preflight: check, value, verdict, detail
  int warnings = 0;
  std::string markdown;
};

PreflightReport run_preflight(const PreflightOptions& options);

}  // namespace tessera::bench
