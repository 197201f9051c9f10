#pragma once
// The tables of `tessera memory`: the per-GPU breakdown of one configuration, whether it fits
// on a GPU of the spec table (or, with `device: cpu`, in this host's memory) and the largest
// micro batch that does, and the same totals for each precision x recompute x sharding
// alternative, each named by the training keys that select it.
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/table.h"
#include "tessera/config/config.h"
#include "tessera/core/dtype.h"
#include "tessera/plan/memory_plan.h"

namespace tessera::plan {

// This host as the CPU backend sees it: memory_stats() and default_compute_dtype().
struct HostMemory {
  size_t total_bytes = 0;
  size_t available_bytes = 0;
  DType compute_dtype = DType::F32;  // what precision auto trains in there
};

struct MemoryQuery {
  Experiment experiment;  // loaded for num_gpus data-parallel ranks
  int64_t num_gpus = 1;
  analysis::GpuSpec gpu;  // the GPU planned for, unless host is set
  // Set for a run with device cpu: the plan is for this host's memory, not a GPU.
  std::optional<HostMemory> host;
};

struct MemoryReport {
  std::string summary;        // model, run, fp8 and device lines
  analysis::Table breakdown;  // memory_breakdown: the configuration as given
  analysis::Table scenarios;  // memory_scenarios: precision x recompute x sharding
  std::string verdict;
  MemoryPlan plan;
  StateSharding sharding = StateSharding::None;  // what the training keys select
  bool fits = false;
  int64_t largest_micro_batch = 0;  // ignoring global_batch_size
  // The largest micro_batch_size the configuration accepts that fits; 0 if none does.
  int64_t largest_valid_micro_batch = 0;
};

// Capacity the planner fits against: the datasheet's HBM "GB" read as GiB (HBM stacks are
// sized in GiB; docs/memory.md compares with what drivers report).
size_t gpu_capacity_bytes(const analysis::GpuSpec& gpu);

MemoryReport build_memory_report(const MemoryQuery& query);
std::string memory_report_markdown(const MemoryReport& report);

}  // namespace tessera::plan
