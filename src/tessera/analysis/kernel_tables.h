#pragma once
// Per-category, per-kernel and per-op tables of GPU time. "share_pct" is a share of the summed
// duration of all GPU activities (kernels, memcpy, memset), so shares add up to 100 even when
// streams overlap; the gpu_timeline sheet has wall-clock (overlap-aware) numbers.
#include <cstdint>

#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

// Short-kernel histogram bucket upper bounds in µs; the last bucket is open-ended.
inline constexpr double kShortKernelBucketsUs[] = {5, 10, 50, 100};

Table categories_table(const TraceData& data);
Table kernels_table(const TraceData& data);  // every unique kernel name, by total time
Table top_kernels_table(const Table& kernels, int k);
Table short_kernels_table(const TraceData& data);
Table unclassified_table(const TraceData& data);
Table ops_table(const TraceData& data);  // CPU ops: calls, CPU time, GPU time they launched
// TraceLens's ops_unique_args: the ops that launched GPU work (communication left out),
// grouped by name, thread and arguments (input shapes, dtypes, strides, concrete inputs, and
// the op's other args), with the GPU busy time of each call: count, total / mean / median /
// std / min / max, share of the sum over all rows.
Table ops_unique_args_table(const TraceData& data);

}  // namespace tessera::analysis
