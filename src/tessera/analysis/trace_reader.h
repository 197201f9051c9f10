#pragma once
// Decodes the events of a Chrome-trace JSON file (Tessera's own traces and PyTorch profiler
// traces, plain or .gz) one at a time, keeping only the fields the analyser uses.
//
// Each event is parsed with simdjson's on-demand API from the text TraceScanner hands out, so
// nothing of the whole file is ever materialised. Views in TraceEvent point into parser
// buffers and are valid only during the callback.
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "tessera/analysis/json_stream.h"

namespace tessera::analysis {

// The subset of "args" the analyser reads. Absent numbers are -1, absent strings empty.
// PyTorch names: "correlation", "External id", "Input Dims", "Input type", "Input Strides",
// "Concrete Inputs", "Collective name", "In msg nelems", "Out msg nelems", "Group size",
// "dtype", "Process Group Name", "bytes". Tessera's names (docs/report.md, "Tessera trace
// args"): "M", "N", "K", "batch", "B", "H", "KV", "T", "S", "D", "causal", "window", "dtype",
// "collective", "bytes", "group_size", "seq".
struct EventArgs {
  // An op's own arguments, for op events (cat "cpu_op" or none) only: every member whose key
  // has no space, as raw JSON in file order. The profiler's bookkeeping keys all have a space
  // ("External id", "Record function id", "Sequence number", ...), so what is left is
  // Tessera's op sizes (rows, cols, M, N, K, dtype, ...) and Triton's kernel metadata.
  static constexpr int kMaxOpArgs = 24;
  struct OpArg {
    std::string_view key, raw;
  };
  std::array<OpArg, kMaxOpArgs> op_args;
  int op_arg_count = 0;  // members beyond kMaxOpArgs are dropped
  int64_t correlation = -1;
  int64_t external_id = -1;
  std::string_view input_dims;       // raw JSON, e.g. [[1024, 256], [256, 256]]
  std::string_view input_types;      // raw JSON, e.g. ["c10::BFloat16", "c10::BFloat16"]
  std::string_view input_strides;    // raw JSON, e.g. [[256, 1], [256, 1]]
  std::string_view concrete_inputs;  // raw JSON
  std::string_view collective;       // "allreduce", "all_gather", ...
  int64_t in_nelems = -1, out_nelems = -1, group_size = -1;
  std::string_view dtype;
  std::string_view process_group;
  int64_t bytes = -1;
  int64_t seq = -1;
  // Tessera GEMM and attention shapes.
  int64_t m = -1, n = -1, k = -1, batch = -1;
  int64_t b = -1, h = -1, kv = -1, t = -1, s = -1, d = -1, window = -1;
  int causal = -1;             // -1 unknown, 0 false, 1 true
  std::string_view meta_name;  // args.name of "M" metadata events (process_name, ...)
  int64_t dv = -1;             // value head dim where it differs from d (multi-latent attention)
};

struct TraceEvent {
  char ph = 0;  // 'X', 'B', 'E', 'i', 's', 'f', 'M', ...; 0 when missing
  std::string_view name;
  std::string_view cat;
  bool has_ts = false, has_dur = false;
  int64_t ts_ns = 0;  // "ts" (microseconds in the file) as integer nanoseconds
  int64_t dur_ns = 0;
  // pid is a number in Kineto traces but may be a string ("CPU functions", "Traces").
  bool pid_is_string = false;
  int64_t pid = 0;
  std::string_view pid_string;
  int64_t tid = -1;  // a number in Kineto and Tessera traces; -1 when missing or a string
  EventArgs args;
  uint64_t offset = 0;  // byte offset of the event in the JSON text, for messages
};

struct ReadStats {
  uint64_t events = 0;
  uint64_t file_bytes = 0;  // on disk (compressed for .gz)
  uint64_t json_bytes = 0;  // JSON text parsed
  double seconds = 0;
};

// Reads `path`, calling on_member for top-level members (key, raw JSON value) and on_event
// for every event. Shows progress on a TTY when `progress` is set. Throws DataError.
// `chunk_bytes`: TraceScanner's read granularity.
ReadStats read_trace(const std::string& path,
                     const std::function<void(std::string_view, std::string_view)>& on_member,
                     const std::function<void(const TraceEvent&)>& on_event, bool progress,
                     size_t chunk_bytes = kTraceChunkBytes);

// "12.5" (µs) -> 12500 (ns), exactly for up to 3 decimals; nullopt when not a number.
std::optional<int64_t> parse_us_to_ns(std::string_view text);

}  // namespace tessera::analysis
