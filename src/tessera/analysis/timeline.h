#pragma once
// The GPU timeline breakdown with TraceLens's definitions (docs/report.md):
//   computation    = union of compute kernels (everything but communication and memcpy;
//                    memset counts as compute, as TraceLens does)
//   exposed_comm   = union of communication kernels minus computation
//   exposed_memcpy = union of memcpy minus computation minus communication
//   busy           = union of all GPU activity;  total = last end - first start
//   idle           = total - busy
// so computation + exposed_comm + exposed_memcpy + idle == total. Computed per GPU (the pid
// of the GPU track), since ranks or devices never overlap each other's time.
#include <cstdint>
#include <utility>
#include <vector>

#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

using Interval = std::pair<int64_t, int64_t>;  // [start, end) in ns

// Sorts and merges overlapping or touching intervals.
std::vector<Interval> merge_intervals(std::vector<Interval> v);
// Parts of `from` not covered by `remove`; both sorted and merged.
std::vector<Interval> subtract_intervals(const std::vector<Interval>& from,
                                         const std::vector<Interval>& remove);
int64_t total_length(const std::vector<Interval>& v);

struct TimelineBreakdown {
  int device = 0;
  int64_t computation = 0, exposed_comm = 0, exposed_memcpy = 0, busy = 0, idle = 0, total = 0;
  int64_t total_comm = 0, total_memcpy = 0;
};

std::vector<TimelineBreakdown> gpu_timeline(const TraceData& data);
Table gpu_timeline_table(const std::vector<TimelineBreakdown>& timeline);

}  // namespace tessera::analysis
