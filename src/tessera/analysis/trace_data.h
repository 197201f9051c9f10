#pragma once
// What the analyser keeps of a trace: compact records of GPU activities (kernels, memcpy,
// memset), the CPU ops that can launch them (for op names, GEMM/attention shapes and
// collective sizes), runtime-call correlations, and per-op-name CPU time. Strings are
// interned; everything else of the trace is dropped while streaming. For a 1 GB PyTorch trace
// this is tens of MB.
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessera/analysis/kernel_categories.h"
#include "tessera/analysis/trace_reader.h"

namespace tessera::analysis {

// Stable ids for repeated strings (kernel names, op names, raw "Input Dims" text, ...).
class StringTable {
 public:
  StringTable();
  uint32_t intern(std::string_view s);
  const std::string& operator[](uint32_t id) const { return strings_[id]; }
  static constexpr uint32_t kEmpty = 0;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::deque<std::string> strings_;
  std::unordered_map<std::string, uint32_t, Hash, std::equal_to<>> ids_;
};

enum class GpuKind : uint8_t { kKernel, kMemcpy, kMemset };

// Collective arguments, from a NCCL kernel's args, a record_param_comms op, or Tessera args.
struct CollectiveArgs {
  uint32_t name = 0;  // interned as written ("allreduce", "all_gather", ...)
  int64_t in_nelems = -1, out_nelems = -1, group_size = -1, bytes = -1, seq = -1;
  uint32_t dtype = 0;
  uint32_t process_group = 0;
};

// Tessera's shape args on a kernel event (docs/report.md, "Tessera trace args").
struct ShapeArgs {
  int64_t m = -1, n = -1, k = -1, batch = -1;
  int64_t b = -1, h = -1, kv = -1, t = -1, s = -1, d = -1, window = -1;
  int causal = -1;
  uint32_t dtype = 0;
  int64_t dv = -1;  // value head dim where it differs from d (multi-latent attention)
};

struct GpuActivity {
  int64_t start_ns;
  int64_t dur_ns;
  int64_t correlation;
  int64_t external_id;
  uint32_t name;
  int32_t shape;       // index into TraceData::shapes, -1 if none
  int32_t collective;  // index into TraceData::collectives, -1 if none
  int32_t bytes;       // memcpy/memset: index into TraceData::transfer_bytes, -1 if none
  int32_t device;      // pid of the GPU track
  GpuKind kind;
  Category category;  // filled by TraceData::finish()
  int16_t rule;       // matching rule, -1 if unclassified
};

// A CPU op that kernels may link to through "External id".
struct OpRef {
  int64_t external_id;
  uint32_t name;
  int32_t detail;  // index into TraceData::op_details, -1 if the op has no arguments
};

// An op's arguments and thread, interned. Ops with equal arguments on one thread share one
// OpDetail (the same shapes repeat every layer and step), except collectives, whose sizes
// come with per-call ids.
struct OpDetail {
  uint32_t input_dims = 0, input_types = 0, input_strides = 0, concrete_inputs = 0;
  uint32_t other_args = 0;  // the op's own arguments as a JSON object (EventArgs::op_args)
  uint32_t thread = 0;      // 1 + index into TraceData::threads; 0 when unknown
  int32_t collective = -1;
};

struct OpTimes {
  uint64_t count = 0;
  int64_t total_ns = 0, min_ns = INT64_MAX, max_ns = 0;
};

struct TraceInfo {
  std::string path;
  ReadStats read;
  std::optional<int> rank;  // distributedInfo.rank
  int world_size = 0;
  std::vector<std::string> devices;  // deviceProperties[].name
  uint64_t missing_fields = 0;       // complete events without ts/dur, skipped
  std::vector<int64_t> step_ns;      // durations of the ProfilerStep#N ranges, in file order
  uint64_t gpu_events = 0, cpu_ops = 0, runtime_calls = 0, flow_events = 0;
  std::string first_missing;  // one example, for the warning
  // Complete events with a negative duration or a time beyond any clock (2^61 ns), skipped.
  uint64_t bad_times = 0;
  std::string first_bad_time;  // one example, for the warning
};

class TraceData {
 public:
  // Reads and collects `path` (streaming); kernels are classified with `user_rules` (from a
  // --categories file) before the built-in rules. Throws DataError. `chunk_bytes`: the read
  // granularity (small ones exercise the reader's refills).
  static TraceData load(const std::string& path, bool progress,
                        std::vector<UserCategoryRule> user_rules = {},
                        size_t chunk_bytes = kTraceChunkBytes);

  void add_member(std::string_view key, std::string_view value);
  void add_event(const TraceEvent& e);
  // Sorts the link tables and classifies every GPU activity.
  void finish();

  // The CPU op that launched `a` (through External id, else correlation), or nullptr.
  const OpRef* launching_op(const GpuActivity& a) const;
  // The arguments of `op`, or nullptr when it has none.
  const OpDetail* detail(const OpRef* op) const {
    return op && op->detail >= 0 ? &op_details[op->detail] : nullptr;
  }
  // "kernel contains 'nvjet'", "categories.yaml:4: kernel matches '^my_'" for a
  // GpuActivity::rule; "" for -1.
  std::string describe_rule(int rule) const;
  // The thread_name the trace gives OpDetail::thread, else "pid P tid T"; "" for 0.
  std::string thread_label(uint32_t thread) const;

  TraceInfo info;
  StringTable strings;
  std::vector<GpuActivity> gpu;
  std::vector<OpRef> ops;  // sorted by external_id after finish()
  std::vector<OpDetail> op_details;
  std::vector<CollectiveArgs> collectives;
  std::vector<ShapeArgs> shapes;
  std::vector<int64_t> transfer_bytes;               // the "bytes" of memcpy/memset events
  std::vector<std::pair<int64_t, int64_t>> threads;  // (pid, tid) of ops
  std::map<std::pair<int64_t, int64_t>, uint32_t> thread_names;  // from thread_name metadata
  std::vector<UserCategoryRule> user_rules;
  std::vector<std::pair<int64_t, int64_t>> runtime_links;  // correlation -> external id
  std::unordered_map<uint32_t, OpTimes> op_times;          // by op name id

 private:
  int32_t add_collective(const EventArgs& a);
  int32_t add_detail(const TraceEvent& e);
  uint32_t thread_of(const TraceEvent& e);
  using DetailKey = std::array<uint32_t, 6>;
  struct DetailKeyHash {
    size_t operator()(const DetailKey& k) const;
  };
  std::unordered_map<DetailKey, int32_t, DetailKeyHash> detail_ids_;
  std::map<std::pair<int64_t, int64_t>, uint32_t> thread_ids_;
  std::string scratch_;  // the op-args JSON being built, reused across events
};

}  // namespace tessera::analysis
