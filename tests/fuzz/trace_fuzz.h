#pragma once
// A trace file as `tessera report` reads it, then the report built from it (the GPU timeline,
// kernel, GEMM, attention, bandwidth and collective tables all add its durations up).
#include "fuzz/fuzz_support.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::fuzz {

inline void report_trace(const fs::path& file) {
  refusal_or_success([&] {
    // Small reads: an input of a few kilobytes crosses refills, where values are carried over.
    const analysis::TraceData trace =
        analysis::TraceData::load(file.string(), /*progress=*/false, {}, /*chunk_bytes=*/512);
    analysis::build_report(trace, analysis::ReportOptions{"H100", 5});
  });
}

}  // namespace tessera::fuzz
