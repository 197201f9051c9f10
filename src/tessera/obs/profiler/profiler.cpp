#include "tessera/obs/profiler/profiler.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/backend/platform.h"
#include "tessera/obs/profiler/trace_file.h"

namespace tessera::profiler {
namespace {

int32_t current_tid() {
  thread_local const auto tid = static_cast<int32_t>(::syscall(SYS_gettid));
  return tid;
}

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::string thread_name(int32_t pid, int32_t tid) {
  std::ifstream in(fmt::format("/proc/{}/task/{}/comm", pid, tid));
  std::string name;
  if (!std::getline(in, name) || name.empty()) name = "thread";
  return name;
}

// Builds the trace text in a buffer that is handed to the file every megabyte.
class EventSink {
 public:
  explicit EventSink(TraceFile& file) : file_(file) { buf_.reserve(kFlushBytes + 4096); }
  // Starts the next event; returns the buffer to append its JSON object to.
  std::string& next() {
    if (!first_) buf_ += ",\n";
    first_ = false;
    ++events_;
    return buf_;
  }
  std::string& raw() { return buf_; }
  void maybe_flush() {
    if (buf_.size() >= kFlushBytes) flush();
  }
  void flush() {
    file_.write(buf_);
    buf_.clear();
  }
  uint64_t events() const { return events_; }

 private:
  static constexpr size_t kFlushBytes = size_t{1} << 20;
  TraceFile& file_;
  std::string buf_;
  bool first_ = true;
  uint64_t events_ = 0;
};

void append_ts(std::string& out, int64_t ns) {
  append_us(out, ns - kTraceBaseTimeNs);
}

void append_arg_value(std::string& out, const OpArg& a) {
  switch (a.kind) {
    case OpArg::Kind::kInt:
      out += std::to_string(a.i);
      break;
    case OpArg::Kind::kBool:
      out += a.i ? "true" : "false";
      break;
    case OpArg::Kind::kDouble:
      if (std::isfinite(a.d))
        out += fmt::format("{}", a.d);
      else
        out += "null";
      break;
    case OpArg::Kind::kString:
      append_json_string(out, a.s);
      break;
  }
}

// {"ph": "X", "cat": ..., "name": ..., "pid": ..., "tid": ..., "ts": ..., "dur": ...  (open)
void append_complete(std::string& out, std::string_view cat, std::string_view name, int64_t pid,
                     int64_t tid, int64_t begin_ns, int64_t end_ns) {
  out += R"({"ph": "X", "cat": )";
  append_json_string(out, cat);
  out += ", \"name\": ";
  append_json_string(out, name);
  out += fmt::format(", \"pid\": {}, \"tid\": {}, \"ts\": ", pid, tid);
  append_ts(out, begin_ns);
  out += ", \"dur\": ";
  append_us(out, std::max<int64_t>(0, end_ns - begin_ns));
}

void append_metadata(std::string& out, std::string_view what, int64_t pid, int64_t tid,
                     int64_t ts_ns, std::string_view key, const std::string& value_json) {
  out += R"({"name": )";
  append_json_string(out, what);
  out += fmt::format(R"(, "ph": "M", "pid": {}, "tid": {}, "ts": )", pid, tid);
  append_ts(out, ts_ns);
  out += R"(, "args": {)";
  append_json_string(out, key);
  out += ": " + value_json + "}}";
}

std::unique_ptr<GpuTracer> make_gpu_tracer(const Device& device, std::string* why_not) {
  if (device.kind != DeviceKind::GPU || !gpu_platform()) {
    *why_not = "the device is the CPU";
    return nullptr;
  }
  return gpu_platform()->make_tracer(device.index, why_not);
}

}  // namespace

Profiler::Profiler(ProfilerOptions options, std::unique_ptr<GpuTracer> gpu)
    : options_(std::move(options)), gpu_(std::move(gpu)) {
  if (gpu_ == nullptr) {
    if (options_.trace_gpu)
      gpu_ = make_gpu_tracer(options_.device, &gpu_off_reason_);
    else
      gpu_off_reason_ = "GPU tracing disabled";
  }
}

Profiler::~Profiler() {
  try {
    if (recording_) stop();
  } catch (...) {
    // Teardown after a failure: nothing left to report to.
  }
}

std::string Profiler::gpu_tracing() const {
  if (gpu_active_ && gpu_ != nullptr) return gpu_->description();
  return "off: " + gpu_off_reason_;
}

int64_t Profiler::now_ns() {
  return gpu_active_ ? gpu_->timestamp_ns() : realtime_ns();
}

void Profiler::start() {
  if (recording_) stop();
  spans_.clear();
  args_.clear();
  open_.clear();
  open_ops_ = 0;
  unbalanced_ends_ = 0;
  closed_at_stop_ = 0;
  gpu_trace_ = GpuTrace{};
  warnings_.clear();
  gpu_active_ = false;
  if (gpu_ != nullptr) {
    std::string error;
    if (gpu_->start(&error)) {
      gpu_active_ = true;
    } else {
      gpu_off_reason_ = error;
      warnings_.push_back("GPU activity is not traced (" + error +
                          "); the trace holds host spans only");
    }
  }
  recording_ = true;
  start_ns_ = now_ns();
}

void Profiler::stop() {
  if (!recording_) return;
  stop_ns_ = now_ns();
  while (!open_.empty()) {  // spans a caller left open end with the recording
    Span& s = spans_[open_.back()];
    s.end_ns = stop_ns_;
    if (s.kind == SpanKind::kOp && gpu_active_) gpu_->pop_external_id();
    open_.pop_back();
    ++closed_at_stop_;
  }
  open_ops_ = 0;
  recording_ = false;
  if (gpu_active_) {
    gpu_trace_ = gpu_->stop();
    for (const std::string& w : gpu_trace_.warnings) warnings_.push_back(w);
  }
  if (closed_at_stop_ > 0)
    warnings_.push_back(fmt::format(
        "{} spans were still open when recording stopped; they end there", closed_at_stop_));
  if (unbalanced_ends_ > 0)
    warnings_.push_back(fmt::format("{} span ends had no matching begin", unbalanced_ends_));
}

uint32_t Profiler::intern_literal(const char* name) {
  auto it = literal_ids_.find(name);
  if (it != literal_ids_.end()) return it->second;
  const uint32_t id = intern(name);
  literal_ids_.emplace(name, id);
  return id;
}

uint32_t Profiler::intern(std::string_view name) {
  auto it = name_ids_.find(std::string(name));
  if (it != name_ids_.end()) return it->second;
  const auto id = static_cast<uint32_t>(names_.size());
  names_.emplace_back(name);
  name_ids_.emplace(names_.back(), id);
  return id;
}

void Profiler::begin(SpanKind kind, uint32_t name, const OpArgs& args) {
  Span s;
  s.begin_ns = now_ns();
  s.name = name;
  s.kind = kind;
  s.tid = current_tid();
  s.op_depth = open_ops_;
  if (!args.empty()) {
    s.args_begin = static_cast<uint32_t>(args_.size());
    s.args_count = static_cast<uint16_t>(args.items().size());
    args_.insert(args_.end(), args.items().begin(), args.items().end());
  }
  if (kind == SpanKind::kOp) {
    s.external_id = next_external_id_++;
    ++open_ops_;
    // After the begin timestamp: every API call the op makes is tagged with its id.
    if (gpu_active_) gpu_->push_external_id(s.external_id);
  }
  open_.push_back(static_cast<uint32_t>(spans_.size()));
  spans_.push_back(s);
}

void Profiler::end(SpanKind kind) {
  if (open_.empty()) {
    ++unbalanced_ends_;
    return;
  }
  Span& s = spans_[open_.back()];
  if (s.kind != kind) ++unbalanced_ends_;  // still close the innermost: spans must nest
  if (s.kind == SpanKind::kOp) {
    if (gpu_active_) gpu_->pop_external_id();
    --open_ops_;
  }
  s.end_ns = now_ns();
  open_.pop_back();
}

void Profiler::op_begin(const char* name, const OpArgs& args) {
  if (recording_) begin(SpanKind::kOp, intern_literal(name), args);
}

void Profiler::op_end() {
  if (recording_) end(SpanKind::kOp);
}

void Profiler::range_begin(const char* name) {
  if (recording_) begin(SpanKind::kAnnotation, intern_literal(name), OpArgs{});
}

void Profiler::range_end() {
  if (recording_) end(SpanKind::kAnnotation);
}

void Profiler::begin_annotation(std::string_view name, const OpArgs& args) {
  if (recording_) begin(SpanKind::kAnnotation, intern(name), args);
}

void Profiler::end_annotation() {
  if (recording_) end(SpanKind::kAnnotation);
}

TraceSummary Profiler::write(const std::string& path) const {
  const auto t0 = std::chrono::steady_clock::now();
  const auto pid = static_cast<int32_t>(::getpid());
  const GpuTrace& g = gpu_trace_;
  TraceSummary sum;
  sum.path = path;

  // ---- joins ----
  // External id -> op span; per thread, op spans in begin order (for the time-based join).
  std::unordered_map<uint64_t, uint32_t> span_of_external;
  std::unordered_map<int32_t, std::vector<uint32_t>> ops_by_thread;
  for (uint32_t i = 0; i < spans_.size(); ++i) {
    if (spans_[i].kind != SpanKind::kOp) continue;
    span_of_external.emplace(spans_[i].external_id, i);
    ops_by_thread[spans_[i].tid].push_back(i);
  }
  // The innermost op of thread `tid` whose span contains `t`: the latest-begun op that
  // contains it; walking back stops at a top-level op, since earlier ones ended before it.
  auto innermost_op = [&](int32_t tid, int64_t t) -> int64_t {
    auto it = ops_by_thread.find(tid);
    if (it == ops_by_thread.end()) return -1;
    const std::vector<uint32_t>& ops = it->second;
    auto pos = std::upper_bound(ops.begin(), ops.end(), t,
                                [&](int64_t v, uint32_t i) { return v < spans_[i].begin_ns; });
    while (pos != ops.begin()) {
      --pos;
      const Span& s = spans_[*pos];
      if (s.end_ns >= t) return *pos;
      if (s.op_depth == 0) break;
    }
    return -1;
  };
  std::unordered_set<uint32_t> gpu_correlations;
  for (const GpuActivityRecord& a : g.activities) gpu_correlations.insert(a.correlation);
  // correlation -> external id: CUPTI's external-correlation records first; else the op
  // whose span holds the API call on its thread (same clock, so containment is exact).
  std::unordered_map<uint32_t, uint64_t> external_of = g.external_ids;
  std::unordered_map<uint32_t, const ApiCallRecord*> launch_of;
  for (const ApiCallRecord& c : g.api_calls) {
    if (gpu_correlations.count(c.correlation)) launch_of.emplace(c.correlation, &c);
    if (external_of.count(c.correlation) || static_cast<int32_t>(c.process) != pid) continue;
    const int64_t op = innermost_op(static_cast<int32_t>(c.thread), c.start_ns);
    if (op >= 0) external_of.emplace(c.correlation, spans_[op].external_id);
  }
  auto external_id = [&](uint32_t correlation) -> int64_t {
    auto it = external_of.find(correlation);
    return it == external_of.end() ? -1 : static_cast<int64_t>(it->second);
  };

  TraceFile file(path);
  EventSink sink(file);

  // ---- header ----
  nlohmann::json devices = nlohmann::json::array();
  if (gpu_ != nullptr) {
    for (const GpuDeviceInfo& d : gpu_->devices()) {
      devices.push_back({{"id", d.id},
                         {"name", d.name},
                         {"totalGlobalMem", d.total_memory},
                         {"computeMajor", d.compute_major},
                         {"computeMinor", d.compute_minor},
                         {"maxThreadsPerBlock", d.max_threads_per_block},
                         {"maxThreadsPerMultiprocessor", d.max_threads_per_sm},
                         {"regsPerBlock", d.regs_per_block},
                         {"warpSize", d.warp_size},
                         {"sharedMemPerBlock", d.shared_memory_per_block},
                         {"numSms", d.sms},
                         {"regsPerMultiprocessor", d.regs_per_sm},
                         {"sharedMemPerBlockOptin", d.shared_memory_per_block_optin},
                         {"sharedMemPerMultiprocessor", d.shared_memory_per_sm}});
    }
  }
  std::set<uint32_t> gpu_devices;
  for (const GpuActivityRecord& a : g.activities) gpu_devices.insert(a.device);
  std::vector<std::string> warnings = warnings_;
  if (gpu_devices.count(static_cast<uint32_t>(pid)))
    warnings.push_back(fmt::format(
        "the process id {} equals a GPU index: their tracks share a pid in viewers", pid));
  nlohmann::json meta = {
      {"recorder", "tessera " TESSERA_VERSION},
      {"gpu_tracing", gpu_tracing()},
      {"clock", gpu_active_ ? "CUPTI timestamps (cuptiGetTimestamp for host spans)"
                            : "CLOCK_REALTIME (host only)"},
      {"recording_start_ns", start_ns_},
      {"recording_stop_ns", stop_ns_},
      {"dropped_records", g.dropped_records},
      {"warnings", warnings},
  };
  if (!options_.metadata_json.empty()) {
    auto run = nlohmann::json::parse(options_.metadata_json, nullptr, false);
    if (!run.is_discarded()) meta["run"] = run;
  }
  std::string& h = sink.raw();
  h += "{\n  \"schemaVersion\": 1,\n";
  if (!devices.empty()) h += "  \"deviceProperties\": " + devices.dump() + ",\n";
  h += fmt::format("  \"distributedInfo\": {{\"rank\": {}, \"world_size\": {}}},\n", options_.rank,
                   options_.world_size);
  h += "  \"displayTimeUnit\": \"ms\",\n";
  h += fmt::format("  \"baseTimeNanoseconds\": {},\n", kTraceBaseTimeNs);
  h += "  \"traceName\": " + json_string(path) + ",\n";
  h += "  \"tessera\": " + meta.dump() + ",\n";
  h += "  \"traceEvents\": [\n";

  // ---- metadata: processes and threads ----
  std::set<int32_t> host_threads;
  for (const Span& s : spans_) host_threads.insert(s.tid);
  for (const ApiCallRecord& c : g.api_calls)
    if (static_cast<int32_t>(c.process) == pid) host_threads.insert(static_cast<int32_t>(c.thread));
  append_metadata(sink.next(), "process_name", pid, 0, start_ns_, "name",
                  json_string(options_.process_name));
  append_metadata(sink.next(), "process_labels", pid, 0, start_ns_, "labels",
                  json_string(options_.world_size > 1 ? fmt::format("CPU (rank {})", options_.rank)
                                                      : std::string("CPU")));
  append_metadata(sink.next(), "process_sort_index", pid, 0, start_ns_, "sort_index",
                  std::to_string(pid));
  for (const int32_t tid : host_threads) {
    append_metadata(sink.next(), "thread_name", pid, tid, start_ns_, "name",
                    json_string(fmt::format("thread {} ({})", tid, thread_name(pid, tid))));
    append_metadata(sink.next(), "thread_sort_index", pid, tid, start_ns_, "sort_index",
                    std::to_string(tid));
  }
  std::set<std::pair<uint32_t, uint32_t>> streams;
  for (const GpuActivityRecord& a : g.activities) streams.insert({a.device, a.stream});
  for (const uint32_t d : gpu_devices) {
    append_metadata(sink.next(), "process_name", d, 0, start_ns_, "name",
                    json_string(options_.process_name));
    append_metadata(sink.next(), "process_labels", d, 0, start_ns_, "labels",
                    json_string(fmt::format("GPU {}", d)));
    append_metadata(sink.next(), "process_sort_index", d, 0, start_ns_, "sort_index",
                    std::to_string(5000000 + d));
  }
  for (const auto& [d, stream] : streams) {
    append_metadata(sink.next(), "thread_name", d, stream, start_ns_, "name",
                    json_string(fmt::format("stream {}", stream)));
    append_metadata(sink.next(), "thread_sort_index", d, stream, start_ns_, "sort_index",
                    std::to_string(stream));
  }

  // ---- host spans ----
  for (const Span& s : spans_) {
    if (s.end_ns < s.begin_ns) continue;  // never closed (cannot happen after stop())
    const bool op = s.kind == SpanKind::kOp;
    std::string& out = sink.next();
    append_complete(out, op ? "cpu_op" : "user_annotation", names_[s.name], pid, s.tid, s.begin_ns,
                    s.end_ns);
    if (op || s.args_count > 0) {
      out += ", \"args\": {";
      bool first = true;
      if (op) {
        out += fmt::format("\"External id\": {}", s.external_id);
        first = false;
      }
      for (uint32_t i = 0; i < s.args_count; ++i) {
        const OpArg& a = args_[s.args_begin + i];
        if (!first) out += ", ";
        first = false;
        append_json_string(out, a.key);
        out += ": ";
        append_arg_value(out, a);
      }
      out += "}";
    }
    out += "}";
    ++(op ? sum.ops : sum.annotations);
    sink.maybe_flush();
  }

  // ---- CUDA API calls (driver calls only where they launched GPU work) ----
  for (const ApiCallRecord& c : g.api_calls) {
    if (c.driver && !gpu_correlations.count(c.correlation)) continue;
    std::string& out = sink.next();
    append_complete(out, c.driver ? "cuda_driver" : "cuda_runtime", g.names[c.name], c.process,
                    c.thread, c.start_ns, c.end_ns);
    out += ", \"args\": {";
    const int64_t ext = external_id(c.correlation);
    if (ext >= 0) out += fmt::format("\"External id\": {}, ", ext);
    out += fmt::format("\"cbid\": {}, \"correlation\": {}}}}}", c.cbid, c.correlation);
    ++sum.api_calls;
    sink.maybe_flush();
  }

  // ---- GPU activities, with the launching op's args, and launch -> activity flows ----
  for (const GpuActivityRecord& a : g.activities) {
    const char* cat = a.kind == GpuActivityKind::kKernel   ? "kernel"
                      : a.kind == GpuActivityKind::kMemcpy ? "gpu_memcpy"
                                                           : "gpu_memset";
    std::string& out = sink.next();
    append_complete(out, cat, g.names[a.name], a.device, a.stream, a.start_ns, a.end_ns);
    out += ", \"args\": {";
    const int64_t ext = external_id(a.correlation);
    if (ext >= 0) out += fmt::format("\"External id\": {}, ", ext);
    out += fmt::format("\"device\": {}, \"context\": {}, \"stream\": {}, \"correlation\": {}",
                       a.device, a.context, a.stream, a.correlation);
    if (a.kind == GpuActivityKind::kKernel) {
      out += fmt::format(
          ", \"registers per thread\": {}, \"shared memory\": {}, \"grid\": [{}, {}, {}], "
          "\"block\": [{}, {}, {}]",
          a.registers_per_thread, a.shared_memory, a.grid[0], a.grid[1], a.grid[2], a.block[0],
          a.block[1], a.block[2]);
    } else {
      const double seconds = static_cast<double>(a.end_ns - a.start_ns) / 1e9;
      out += fmt::format(", \"bytes\": {}, \"memory bandwidth (GB/s)\": {:.3f}", a.bytes,
                         seconds > 0 ? static_cast<double>(a.bytes) / 1e9 / seconds : 0.0);
    }
    if (ext >= 0) {
      auto it = span_of_external.find(static_cast<uint64_t>(ext));
      if (it != span_of_external.end()) {
        const Span& s = spans_[it->second];
        for (uint32_t i = 0; i < s.args_count; ++i) {
          const OpArg& arg = args_[s.args_begin + i];
          out += ", ";
          append_json_string(out, arg.key);
          out += ": ";
          append_arg_value(out, arg);
        }
        if (a.kind == GpuActivityKind::kKernel) ++sum.kernels_with_op;
      }
    }
    out += "}}";
    ++(a.kind == GpuActivityKind::kKernel   ? sum.kernels
       : a.kind == GpuActivityKind::kMemcpy ? sum.memcpys
                                            : sum.memsets);
    auto launch = launch_of.find(a.correlation);
    if (launch != launch_of.end()) {
      const ApiCallRecord& c = *launch->second;
      std::string& s = sink.next();
      s += fmt::format(R"({{"ph": "s", "id": {}, "pid": {}, "tid": {}, "ts": )", a.correlation,
                       c.process, c.thread);
      append_ts(s, c.start_ns);
      s += R"(, "cat": "ac2g", "name": "ac2g"})";
      std::string& f = sink.next();
      f += fmt::format(R"({{"ph": "f", "id": {}, "pid": {}, "tid": {}, "ts": )", a.correlation,
                       a.device, a.stream);
      append_ts(f, a.start_ns);
      f += R"(, "cat": "ac2g", "name": "ac2g", "bp": "e"})";
      ++sum.flows;
    }
    sink.maybe_flush();
  }

  sink.raw() += "\n  ]\n}\n";
  sink.flush();
  sum.file_bytes = file.commit();
  sum.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

}  // namespace tessera::profiler
