#pragma once
// `tessera report --ranks DIR`: one trace per rank; collective skew and stragglers.
//
// The k-th occurrence of a collective (same kind and process group; the "seq" arg when every
// rank has one) is matched across the ranks of its group (the traced ranks that name it; every
// rank for an unnamed one). A collective finishes only when its last rank arrives, so for each
// occurrence:
//   start skew    = latest start - earliest start (how long the first rank waited)
//   wait of rank r = latest start - start of r
//   duration spread = longest - shortest kernel (waiting shows up as longer kernels)
// The straggler summary counts, per rank, how often it arrived last and how much waiting it
// caused the others, and the waits table who waited how long for whom. Timestamps are
// compared as written: ranks on one host share a clock; across hosts the clock offset adds to
// the skew.
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

// "rank-3", "rank_3", "rank3" anywhere in a file name (case-insensitive).
std::optional<int> rank_from_filename(std::string_view filename);
// Trace files (*.json, *.json.gz) of a directory, sorted by name. Throws DataError.
std::vector<std::string> trace_files_in(const std::string& dir);

// `on_loaded` is called after each rank's trace is read (the CLI prints a summary line).
Report ranks_report(const std::string& dir, bool progress,
                    const std::function<void(const TraceInfo&)>& on_loaded = {});

}  // namespace tessera::analysis
