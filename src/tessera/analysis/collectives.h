#pragma once
// Collective communication: what each communication kernel moved, and bandwidths with the
// nccl-tests definitions (docs/report.md):
//   size  = bytes of the largest buffer: max(in, out) elements * element size, i.e. the whole
//           vector for all_reduce, the gathered output for all_gather, the input for
//           reduce_scatter (as nccl-tests reports "size")
//   algbw = size / time
//   busbw = algbw * factor(n): all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
//           (n-1)/n; broadcast, reduce, send/recv 1.
// Kernel time includes waiting for the slowest peer, so these are lower bounds on the
// link's speed; `tessera report --ranks` separates the waiting (skew).
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

struct CollectiveInfo {
  std::string kind;  // all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, ...
  std::string dtype;
  int64_t bytes = -1;
  int64_t group_size = -1;
  std::string process_group;
  int64_t seq = -1;
};

// "allreduce", "_allgather_base", "nccl:all_reduce", "ncclDevKernel_AllReduce_Sum_f32" ->
// "all_reduce", ...; unknown names are returned lower-cased.
std::string normalize_collective(std::string_view name);
double bus_bandwidth_factor(std::string_view kind, int64_t ranks);

// From the kernel's own args, else the launching record_param_comms op, else its name.
CollectiveInfo collective_info(const TraceData& data, const GpuActivity& g);
// From `args` (a host op's, say) where the kernel carries none; its name otherwise.
CollectiveInfo collective_info(const TraceData& data, const GpuActivity& g,
                               const CollectiveArgs* args);

Table collectives_table(const TraceData& data);

}  // namespace tessera::analysis
