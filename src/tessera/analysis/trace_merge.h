#pragma once
// `tessera trace merge`: joins per-rank Chrome traces into one file that Perfetto opens, with
// every rank's processes kept apart. Streaming: events are copied through with only their
// "pid" (and flow "id") rewritten, so memory does not grow with the traces.
//
// - pid: each (rank, original pid) gets a new integer pid; a "process_name" metadata event
//   names it "rank N" (plus the original process name) and "process_sort_index" orders ranks.
//   The inputs' own process_name / process_sort_index events are replaced by these.
// - id / bind_id (flow and async events): numbers become id * ranks + rank, strings get a
//   "rN:" prefix, so arrows never join events of different ranks.
// - timestamps are kept: ranks of one host share a clock.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::analysis {

struct MergeInput {
  int rank;
  std::string path;
};

// Directories expand to their *.json / *.json.gz files. Rank: from the file name (rank-N,
// rank_N, rankN), else from distributedInfo.rank, else the input's position. Throws DataError
// on missing inputs or duplicate ranks.
std::vector<MergeInput> resolve_merge_inputs(const std::vector<std::string>& dirs_or_files);

struct MergeStats {
  uint64_t events = 0;
  uint64_t file_bytes = 0;  // inputs on disk
  uint64_t json_bytes = 0;  // inputs' JSON text
  double seconds = 0;
};

// Writes `output` (gzip-compressed when it ends in .gz). Throws DataError.
MergeStats merge_traces(const std::vector<MergeInput>& inputs, const std::string& output,
                        bool progress);

}  // namespace tessera::analysis
