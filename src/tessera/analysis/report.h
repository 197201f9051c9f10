#pragma once
// Builds the single-trace report: every table of `tessera report TRACE`, in sheet order.
#include <string>

#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

struct ReportOptions {
  std::string gpu;  // GPU spec name (configs/gpus.yaml); empty: detect from deviceProperties
  int top_k = 20;
};

Report build_report(const TraceData& data, const ReportOptions& options);

}  // namespace tessera::analysis
