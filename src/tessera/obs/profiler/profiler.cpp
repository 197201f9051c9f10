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

#include "tessera/backend/backend_factory.h"
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

// One write() of a recording. The joins come first: each API call and GPU activity is
// linked to the op that launched it (External id), then the file is written section by
// section in the order viewers and the analyser expect.
class TraceWriter {
 public:
  TraceWriter(const Profiler& profiler, const std::string& path)
      : p_(profiler), g_(profiler.gpu_trace_), path_(path), pid_(::getpid()) {
    join_ops();
    join_api_calls();
    for (const GpuActivityRecord& a : g_.activities) gpu_devices_.insert(a.device);
  }

  void header();
  void track_names();
  void host_spans();
  void api_calls();
  void gpu_activities();
  // Closes the event list and moves the file into place.
  TraceSummary commit();

 private:
  using Span = Profiler::Span;

  void join_ops();
  void join_api_calls();
  int64_t innermost_op(int32_t tid, int64_t t) const;
  int64_t external_id(uint32_t correlation) const;

  nlohmann::json device_properties() const;
  nlohmann::json recorder_metadata() const;
  void process_metadata(int64_t pid, const std::string& label, int64_t sort_index);
  void thread_metadata(int64_t pid, int64_t tid, const std::string& name, int64_t sort_index);
  void append_op_args(std::string& out, const Span& s, bool first) const;
  void gpu_activity(const GpuActivityRecord& a);
  void flow(const GpuActivityRecord& a, const ApiCallRecord& launch);

  const Profiler& p_;
  const GpuTrace& g_;
  const std::string path_;
  const int32_t pid_;
  // External id -> op span; per thread, op spans in begin order (for the time-based join).
  std::unordered_map<uint64_t, uint32_t> span_of_external_;
  std::unordered_map<int32_t, std::vector<uint32_t>> ops_by_thread_;
  // Correlations that launched GPU work, and the API call of each.
  std::unordered_set<uint32_t> gpu_correlations_;
  std::unordered_map<uint32_t, const ApiCallRecord*> launch_of_;
  std::unordered_map<uint32_t, uint64_t> external_of_;  // correlation -> External id
  std::set<uint32_t> gpu_devices_;
  TraceFile file_{path_};
  EventSink sink_{file_};
  TraceSummary sum_;
};

void TraceWriter::join_ops() {
  for (uint32_t i = 0; i < p_.spans_.size(); ++i) {
    const Span& s = p_.spans_[i];
    if (s.kind != Profiler::SpanKind::kOp) continue;
    span_of_external_.emplace(s.external_id, i);
    ops_by_thread_[s.tid].push_back(i);
  }
}

// CUPTI's external-correlation records first; else the op whose span holds the API call on
// its thread (same clock, so containment is exact).
void TraceWriter::join_api_calls() {
  for (const GpuActivityRecord& a : g_.activities) gpu_correlations_.insert(a.correlation);
  external_of_ = g_.external_ids;
  for (const ApiCallRecord& c : g_.api_calls) {
    if (gpu_correlations_.count(c.correlation)) launch_of_.emplace(c.correlation, &c);
    if (external_of_.count(c.correlation) || static_cast<int32_t>(c.process) != pid_) continue;
    const int64_t op = innermost_op(static_cast<int32_t>(c.thread), c.start_ns);
    if (op >= 0) external_of_.emplace(c.correlation, p_.spans_[op].external_id);
  }
}

// The innermost op of thread `tid` whose span contains `t`: the latest-begun op that contains
// it; walking back stops at a top-level op, since earlier ones ended before it.
int64_t TraceWriter::innermost_op(int32_t tid, int64_t t) const {
  auto it = ops_by_thread_.find(tid);
  if (it == ops_by_thread_.end()) return -1;
  const std::vector<uint32_t>& ops = it->second;
  auto pos = std::upper_bound(ops.begin(), ops.end(), t,
                              [&](int64_t v, uint32_t i) { return v < p_.spans_[i].begin_ns; });
  while (pos != ops.begin()) {
    --pos;
    const Span& s = p_.spans_[*pos];
    if (s.end_ns >= t) return *pos;
    if (s.op_depth == 0) break;
  }
  return -1;
}

int64_t TraceWriter::external_id(uint32_t correlation) const {
  auto it = external_of_.find(correlation);
  return it == external_of_.end() ? -1 : static_cast<int64_t>(it->second);
}

nlohmann::json TraceWriter::device_properties() const {
  nlohmann::json devices = nlohmann::json::array();
  if (p_.gpu_ == nullptr) return devices;
  for (const GpuDeviceInfo& d : p_.gpu_->devices()) {
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
  return devices;
}

// The header's "tessera" member: how the trace was recorded, and the run's own metadata.
nlohmann::json TraceWriter::recorder_metadata() const {
  std::vector<std::string> warnings = p_.warnings_;
  if (gpu_devices_.count(static_cast<uint32_t>(pid_)))
    warnings.push_back(fmt::format(
        "the process id {} equals a GPU index: their tracks share a pid in viewers", pid_));
  nlohmann::json meta = {
      {"recorder", "tessera " TESSERA_VERSION},
      {"gpu_tracing", p_.gpu_tracing()},
      {"clock", p_.gpu_active_ ? "CUPTI timestamps (cuptiGetTimestamp for host spans)"
                               : "CLOCK_REALTIME (host only)"},
      {"recording_start_ns", p_.start_ns_},
      {"recording_stop_ns", p_.stop_ns_},
      {"dropped_records", g_.dropped_records},
      {"warnings", warnings},
  };
  if (!p_.options_.metadata_json.empty()) {
    auto run = nlohmann::json::parse(p_.options_.metadata_json, nullptr, false);
    if (!run.is_discarded()) meta["run"] = run;
  }
  return meta;
}

void TraceWriter::header() {
  const nlohmann::json devices = device_properties();
  const nlohmann::json meta = recorder_metadata();
  const ProfilerOptions& o = p_.options_;
  std::string& h = sink_.raw();
  h += "{\n  \"schemaVersion\": 1,\n";
  if (!devices.empty()) h += "  \"deviceProperties\": " + devices.dump() + ",\n";
  h += fmt::format("  \"distributedInfo\": {{\"rank\": {}, \"world_size\": {}}},\n", o.rank,
                   o.world_size);
  h += "  \"displayTimeUnit\": \"ms\",\n";
  h += fmt::format("  \"baseTimeNanoseconds\": {},\n", kTraceBaseTimeNs);
  h += "  \"traceName\": " + json_string(path_) + ",\n";
  h += "  \"tessera\": " + meta.dump() + ",\n";
  h += "  \"traceEvents\": [\n";
}

void TraceWriter::process_metadata(int64_t pid, const std::string& label, int64_t sort_index) {
  const int64_t ts = p_.start_ns_;
  append_metadata(sink_.next(), "process_name", pid, 0, ts, "name",
                  json_string(p_.options_.process_name));
  append_metadata(sink_.next(), "process_labels", pid, 0, ts, "labels", json_string(label));
  append_metadata(sink_.next(), "process_sort_index", pid, 0, ts, "sort_index",
                  std::to_string(sort_index));
}

void TraceWriter::thread_metadata(int64_t pid, int64_t tid, const std::string& name,
                                  int64_t sort_index) {
  const int64_t ts = p_.start_ns_;
  append_metadata(sink_.next(), "thread_name", pid, tid, ts, "name", json_string(name));
  append_metadata(sink_.next(), "thread_sort_index", pid, tid, ts, "sort_index",
                  std::to_string(sort_index));
}

// Names and order of the tracks: the host process and its threads, then each GPU and its
// streams.
void TraceWriter::track_names() {
  const ProfilerOptions& o = p_.options_;
  std::set<int32_t> host_threads;
  for (const Span& s : p_.spans_) host_threads.insert(s.tid);
  for (const ApiCallRecord& c : g_.api_calls)
    if (static_cast<int32_t>(c.process) == pid_)
      host_threads.insert(static_cast<int32_t>(c.thread));
  process_metadata(pid_, o.world_size > 1 ? fmt::format("CPU (rank {})", o.rank) : "CPU", pid_);
  for (const int32_t tid : host_threads)
    thread_metadata(pid_, tid, fmt::format("thread {} ({})", tid, thread_name(pid_, tid)), tid);
  std::set<std::pair<uint32_t, uint32_t>> streams;
  for (const GpuActivityRecord& a : g_.activities) streams.insert({a.device, a.stream});
  for (const uint32_t d : gpu_devices_) process_metadata(d, fmt::format("GPU {}", d), 5000000 + d);
  for (const auto& [d, stream] : streams)
    thread_metadata(d, stream, fmt::format("stream {}", stream), stream);
}

// The op's shape args as `"key": value` members, each after ", " but for a first one.
void TraceWriter::append_op_args(std::string& out, const Span& s, bool first) const {
  for (uint32_t i = 0; i < s.args_count; ++i) {
    const OpArg& a = p_.args_[s.args_begin + i];
    if (!first) out += ", ";
    first = false;
    append_json_string(out, a.key);
    out += ": ";
    append_arg_value(out, a);
  }
}

void TraceWriter::host_spans() {
  for (const Span& s : p_.spans_) {
    if (s.end_ns < s.begin_ns) continue;  // never closed (cannot happen after stop())
    const bool op = s.kind == Profiler::SpanKind::kOp;
    std::string& out = sink_.next();
    append_complete(out, op ? "cpu_op" : "user_annotation", p_.names_[s.name], pid_, s.tid,
                    s.begin_ns, s.end_ns);
    if (op || s.args_count > 0) {
      out += ", \"args\": {";
      if (op) out += fmt::format("\"External id\": {}", s.external_id);
      append_op_args(out, s, /*first=*/!op);
      out += "}";
    }
    out += "}";
    ++(op ? sum_.ops : sum_.annotations);
    sink_.maybe_flush();
  }
}

// Driver calls only where they launched GPU work: the driver API is mostly the runtime's own
// bookkeeping.
void TraceWriter::api_calls() {
  for (const ApiCallRecord& c : g_.api_calls) {
    if (c.driver && !gpu_correlations_.count(c.correlation)) continue;
    std::string& out = sink_.next();
    append_complete(out, c.driver ? "cuda_driver" : "cuda_runtime", g_.names[c.name], c.process,
                    c.thread, c.start_ns, c.end_ns);
    out += ", \"args\": {";
    const int64_t ext = external_id(c.correlation);
    if (ext >= 0) out += fmt::format("\"External id\": {}, ", ext);
    out += fmt::format("\"cbid\": {}, \"correlation\": {}}}}}", c.cbid, c.correlation);
    ++sum_.api_calls;
    sink_.maybe_flush();
  }
}

void TraceWriter::gpu_activities() {
  for (const GpuActivityRecord& a : g_.activities) {
    gpu_activity(a);
    auto launch = launch_of_.find(a.correlation);
    if (launch != launch_of_.end()) flow(a, *launch->second);
    sink_.maybe_flush();
  }
}

// A kernel, copy or fill, with the launching op's shape args.
void TraceWriter::gpu_activity(const GpuActivityRecord& a) {
  const bool kernel = a.kind == GpuActivityKind::kKernel;
  const bool memcpy = a.kind == GpuActivityKind::kMemcpy;
  const char* cat = kernel ? "kernel" : memcpy ? "gpu_memcpy" : "gpu_memset";
  std::string& out = sink_.next();
  append_complete(out, cat, g_.names[a.name], a.device, a.stream, a.start_ns, a.end_ns);
  out += ", \"args\": {";
  const int64_t ext = external_id(a.correlation);
  if (ext >= 0) out += fmt::format("\"External id\": {}, ", ext);
  out += fmt::format("\"device\": {}, \"context\": {}, \"stream\": {}, \"correlation\": {}",
                     a.device, a.context, a.stream, a.correlation);
  if (kernel) {
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
    auto it = span_of_external_.find(static_cast<uint64_t>(ext));
    if (it != span_of_external_.end()) {
      append_op_args(out, p_.spans_[it->second], /*first=*/false);
      if (kernel) ++sum_.kernels_with_op;
    }
  }
  out += "}}";
  ++(kernel ? sum_.kernels : memcpy ? sum_.memcpys : sum_.memsets);
}

// The launch -> activity arrow: a flow start on the API call, its end on the activity.
void TraceWriter::flow(const GpuActivityRecord& a, const ApiCallRecord& launch) {
  std::string& s = sink_.next();
  s += fmt::format(R"({{"ph": "s", "id": {}, "pid": {}, "tid": {}, "ts": )", a.correlation,
                   launch.process, launch.thread);
  append_ts(s, launch.start_ns);
  s += R"(, "cat": "ac2g", "name": "ac2g"})";
  std::string& f = sink_.next();
  f += fmt::format(R"({{"ph": "f", "id": {}, "pid": {}, "tid": {}, "ts": )", a.correlation,
                   a.device, a.stream);
  append_ts(f, a.start_ns);
  f += R"(, "cat": "ac2g", "name": "ac2g", "bp": "e"})";
  ++sum_.flows;
}

TraceSummary TraceWriter::commit() {
  sink_.raw() += "\n  ]\n}\n";
  sink_.flush();
  sum_.path = path_;
  sum_.file_bytes = file_.commit();
  return sum_;
}

TraceSummary Profiler::write(const std::string& path) const {
  const auto t0 = std::chrono::steady_clock::now();
  TraceWriter w(*this, path);
  w.header();
  w.track_names();
  w.host_spans();
  w.api_calls();
  w.gpu_activities();
  TraceSummary sum = w.commit();
  sum.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

}  // namespace tessera::profiler
