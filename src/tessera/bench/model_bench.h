#pragma once
// `tessera bench model`: trains proxy models for a few steps on mock data and reports the
// seed reports' throughput table (tokens/s/GPU, TFLOP/s/GPU, MFU against a measured GEMM
// ceiling, peak memory) with a per-step time breakdown by op family.
#include <string>
#include <vector>

namespace tessera::bench {

int model_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
