#include "tessera/analysis/report.h"

#include <filesystem>

#include <fmt/format.h>

#include "tessera/analysis/bandwidth.h"
#include "tessera/analysis/collectives.h"
#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/progress.h"
#include "tessera/analysis/shapes.h"
#include "tessera/analysis/timeline.h"

namespace tessera::analysis {
namespace {

std::optional<GpuSpec> choose_gpu(const TraceData& data, const ReportOptions& options) {
  if (!options.gpu.empty()) return require_gpu_spec(options.gpu);
  for (const std::string& device : data.info.devices) {
    if (auto spec = find_gpu_spec(device)) return spec;
  }
  return std::nullopt;
}

}  // namespace

Report build_report(const TraceData& data, const ReportOptions& options) {
  const std::optional<GpuSpec> gpu = choose_gpu(data, options);
  const TraceInfo& info = data.info;
  Report r;
  r.title = "Trace report: " + std::filesystem::path(info.path).filename().string();
  r.info = {
      {"trace", info.path},
      {"read", read_summary(info.read.events, info.read.json_bytes, info.read.seconds,
                            info.read.file_bytes)},
      {"gpu activities", std::to_string(info.gpu_events)},
      {"cpu ops", std::to_string(info.cpu_ops)},
      {"runtime calls", std::to_string(info.runtime_calls)},
      {"devices in trace", info.devices.empty() ? "(none listed)" : info.devices.front()},
      {"peak figures",
       gpu ? fmt::format("{}: bf16 {} / fp8 {} / fp32 {} TFLOP/s, {} GB at {} TB/s ({})", gpu->name,
                         gpu->bf16_tflops, gpu->fp8_tflops, gpu->fp32_tflops, gpu->hbm_gb,
                         gpu->hbm_tbps, gpu->source)
           : std::string("none (pass --gpu NAME for % of peak and roofline)")},
  };
  if (info.rank) {
    r.info.push_back({"rank", fmt::format("{} of {}", *info.rank, info.world_size)});
  }
  if (info.missing_fields > 0) {
    r.warnings.push_back(
        fmt::format("{} complete events lack ts or dur and were skipped (first: {})",
                    info.missing_fields, info.first_missing));
  }
  if (data.gpu.empty()) {
    r.warnings.push_back(
        "no GPU activity (kernel, gpu_memcpy, gpu_memset events) in this trace: the GPU "
        "sheets are empty; the ops sheet still covers CPU ops");
  }
  r.tables.push_back(gpu_timeline_table(gpu_timeline(data)));
  r.tables.push_back(categories_table(data));
  Table kernels = kernels_table(data);
  r.tables.push_back(top_kernels_table(kernels, options.top_k));
  r.tables.push_back(gemm_table(data, gpu));
  r.tables.push_back(attention_table(data, gpu));
  r.tables.push_back(bandwidth_table(data, gpu));
  r.tables.push_back(collectives_table(data));
  r.tables.push_back(short_kernels_table(data));
  Table unclassified = unclassified_table(data);
  if (!unclassified.rows.empty()) {
    r.warnings.push_back(
        fmt::format("{} kernel names matched no category rule; see the unclassified sheet",
                    unclassified.rows.size()));
  }
  r.tables.push_back(std::move(unclassified));
  r.tables.push_back(std::move(kernels));
  r.tables.push_back(ops_table(data));
  r.tables.push_back(ops_unique_args_table(data));
  return r;
}

}  // namespace tessera::analysis
