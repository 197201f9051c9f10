#pragma once
// The tables of `tessera memory`: the per-GPU breakdown of one configuration, whether it fits
// on a GPU of the spec table and the largest micro batch that does, and the same totals for
// each precision x recompute x sharding alternative.
#include <cstdint>
#include <string>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/table.h"
#include "tessera/config/config.h"
#include "tessera/plan/memory_plan.h"

namespace tessera::plan {

struct MemoryQuery {
  Experiment experiment;
  int64_t num_gpus = 1;
  StateSharding sharding = StateSharding::None;
  analysis::GpuSpec gpu;
};

struct MemoryReport {
  std::string summary;        // model, run and GPU lines
  analysis::Table breakdown;  // memory_breakdown: the configuration as given
  analysis::Table scenarios;  // memory_scenarios: precision x recompute x sharding
  std::string verdict;
  MemoryPlan plan;
  bool fits = false;
  int64_t largest_micro_batch = 0;
};

// Capacity the planner fits against: the datasheet's HBM "GB" read as GiB (HBM stacks are
// sized in GiB; docs/memory.md compares with what drivers report).
size_t gpu_capacity_bytes(const analysis::GpuSpec& gpu);

MemoryReport build_memory_report(const MemoryQuery& query);
std::string memory_report_markdown(const MemoryReport& report);

}  // namespace tessera::plan
