#include "tessera/analysis/trace_data.h"

#include <algorithm>
#include <new>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

// 2^61 ns (73 years): beyond any trace's clock, and small enough that a start plus a duration
// cannot overflow.
constexpr int64_t kMaxTraceNs = int64_t{1} << 61;

// `key` as a JSON string (it was unescaped by the parser).
void append_json_key(std::string& out, std::string_view key) {
  out += '"';
  for (char c : key) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  out += "\": ";
}

}  // namespace

StringTable::StringTable() {
  intern("");
}

uint32_t StringTable::intern(std::string_view s) {
  auto it = ids_.find(s);
  if (it != ids_.end()) return it->second;
  uint32_t id = static_cast<uint32_t>(strings_.size());
  strings_.emplace_back(s);
  ids_.emplace(strings_.back(), id);
  return id;
}

TraceData TraceData::load(const std::string& path, bool progress,
                          std::vector<UserCategoryRule> user_rules, size_t chunk_bytes) {
  TraceData data;
  data.info.path = path;
  data.user_rules = std::move(user_rules);
  try {
    data.info.read = read_trace(
        path, [&](std::string_view key, std::string_view value) { data.add_member(key, value); },
        [&](const TraceEvent& e) { data.add_event(e); }, progress, chunk_bytes);
    data.finish();
  } catch (const std::bad_alloc&) {
    // What is kept grows with the trace's GPU activities and CPU ops (not its size on disk):
    // a trace of hundreds of millions of events outgrows the host.
    const uint64_t activities = data.info.gpu_events, ops = data.info.cpu_ops;
    data = TraceData();
    throw OutOfMemoryError(fmt::format(
        "{}: out of host memory after {} GPU activities and {} CPU ops: the report keeps about "
        "{} bytes per GPU activity and {} per CPU op, and this trace holds more than this host "
        "can keep; report a shorter trace (fewer profiled steps)",
        path, activities, ops, sizeof(GpuActivity), sizeof(OpRef)));
  }
  return data;
}

void TraceData::add_member(std::string_view key, std::string_view value) {
  // Header members are small; a DOM is fine here (the event stream never gets one).
  if (key != "distributedInfo" && key != "deviceProperties") return;
  auto j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return;
  if (key == "distributedInfo" && j.is_object()) {
    if (j.contains("rank") && j["rank"].is_number_integer()) info.rank = j["rank"].get<int>();
    if (j.contains("world_size") && j["world_size"].is_number_integer()) {
      info.world_size = j["world_size"].get<int>();
    }
  } else if (key == "deviceProperties" && j.is_array()) {
    for (const auto& d : j) {
      if (d.is_object() && d.contains("name") && d["name"].is_string()) {
        info.devices.push_back(d["name"].get<std::string>());
      }
    }
  }
}

int32_t TraceData::add_collective(const EventArgs& a) {
  CollectiveArgs c;
  c.name = strings.intern(a.collective);
  c.in_nelems = a.in_nelems;
  c.out_nelems = a.out_nelems;
  c.group_size = a.group_size;
  c.bytes = a.bytes;
  c.seq = a.seq;
  c.dtype = strings.intern(a.dtype);
  c.process_group = strings.intern(a.process_group);
  collectives.push_back(c);
  return static_cast<int32_t>(collectives.size() - 1);
}

size_t TraceData::DetailKeyHash::operator()(const DetailKey& k) const {
  size_t h = 0;
  for (uint32_t v : k) h = h * 1000003u ^ v;
  return h;
}

uint32_t TraceData::thread_of(const TraceEvent& e) {
  if (e.pid_is_string || e.tid < 0) return 0;
  const std::pair<int64_t, int64_t> key(e.pid, e.tid);
  auto [it, inserted] = thread_ids_.emplace(key, static_cast<uint32_t>(threads.size() + 1));
  if (inserted) threads.push_back(key);
  return it->second;
}

int32_t TraceData::add_detail(const TraceEvent& e) {
  const EventArgs& a = e.args;
  scratch_.clear();
  for (int i = 0; i < a.op_arg_count; ++i) {
    scratch_ += scratch_.empty() ? "{" : ", ";
    append_json_key(scratch_, a.op_args[i].key);
    scratch_ += a.op_args[i].raw;
  }
  if (!scratch_.empty()) scratch_ += "}";
  const DetailKey key = {strings.intern(a.input_dims),    strings.intern(a.input_types),
                         strings.intern(a.input_strides), strings.intern(a.concrete_inputs),
                         strings.intern(scratch_),        thread_of(e)};
  const bool collective = !a.collective.empty();
  if (!collective) {
    if (key == DetailKey{}) return -1;
    auto it = detail_ids_.find(key);
    if (it != detail_ids_.end()) return it->second;
  }
  OpDetail d;
  d.input_dims = key[0], d.input_types = key[1], d.input_strides = key[2];
  d.concrete_inputs = key[3], d.other_args = key[4], d.thread = key[5];
  if (collective) d.collective = add_collective(a);
  op_details.push_back(d);
  const auto id = static_cast<int32_t>(op_details.size() - 1);
  if (!collective) detail_ids_.emplace(key, id);
  return id;
}

void TraceData::add_event(const TraceEvent& e) {
  if (e.ph == 's' || e.ph == 'f' || e.ph == 't') {
    ++info.flow_events;
    return;
  }
  if (e.ph == 'M' && e.name == "thread_name" && !e.pid_is_string && e.tid >= 0) {
    thread_names[{e.pid, e.tid}] = strings.intern(e.args.meta_name);
    return;
  }
  if (e.ph != 'X') return;
  if (!e.has_ts || !e.has_dur) {
    if (info.missing_fields++ == 0) {
      info.first_missing =
          fmt::format("'{}' at byte {} has no {}", e.name, e.offset, e.has_ts ? "dur" : "ts");
    }
    return;
  }
  // A negative duration, or a time no clock reaches, is damage: kept, it would turn the
  // timeline's sums negative or past 100% (and overflow them near 2^63).
  if (e.dur_ns < 0 || e.dur_ns > kMaxTraceNs || e.ts_ns < -kMaxTraceNs || e.ts_ns > kMaxTraceNs) {
    if (info.bad_times++ == 0) {
      info.first_bad_time = fmt::format("'{}' at byte {} with ts {} µs and dur {} µs", e.name,
                                        e.offset, e.ts_ns / 1000, e.dur_ns / 1000);
    }
    return;
  }
  const std::string_view cat = e.cat;
  const EventArgs& a = e.args;
  if (cat == "kernel" || cat == "gpu_memcpy" || cat == "gpu_memset") {
    ++info.gpu_events;
    GpuActivity g{};
    g.start_ns = e.ts_ns;
    g.dur_ns = e.dur_ns;
    g.correlation = a.correlation;
    g.external_id = a.external_id;
    g.name = strings.intern(e.name);
    g.kind = cat == "kernel" ? GpuKind::kKernel
                             : (cat == "gpu_memcpy" ? GpuKind::kMemcpy : GpuKind::kMemset);
    g.device = e.pid_is_string ? -1 : static_cast<int32_t>(e.pid);
    g.shape = -1;
    g.collective = -1;
    g.bytes = -1;
    g.rule = -1;
    if (g.kind != GpuKind::kKernel && a.bytes >= 0) {
      transfer_bytes.push_back(a.bytes);
      g.bytes = static_cast<int32_t>(transfer_bytes.size() - 1);
    }
    if (g.kind == GpuKind::kKernel) {
      if (!a.collective.empty() || a.in_nelems >= 0) g.collective = add_collective(a);
      if (a.m >= 0 || a.n >= 0 || a.k >= 0 || a.b >= 0 || a.h >= 0 || a.t >= 0) {
        ShapeArgs s;
        s.m = a.m, s.n = a.n, s.k = a.k, s.batch = a.batch;
        s.b = a.b, s.h = a.h, s.kv = a.kv, s.t = a.t, s.s = a.s, s.d = a.d, s.dv = a.dv;
        s.window = a.window, s.causal = a.causal;
        s.dtype = strings.intern(a.dtype);
        shapes.push_back(s);
        g.shape = static_cast<int32_t>(shapes.size() - 1);
      }
    }
    gpu.push_back(g);
  } else if (cat == "cpu_op" || cat.empty()) {
    // Legacy (pre-Kineto) profiler traces have no "cat": their complete events are ops.
    ++info.cpu_ops;
    if (e.name.starts_with("ProfilerStep#")) info.step_ns.push_back(e.dur_ns);
    uint32_t name = strings.intern(e.name);
    OpTimes& t = op_times[name];
    ++t.count;
    t.total_ns += e.dur_ns;
    t.min_ns = std::min(t.min_ns, e.dur_ns);
    t.max_ns = std::max(t.max_ns, e.dur_ns);
    if (a.external_id < 0) return;
    ops.push_back({a.external_id, name, add_detail(e)});
  } else if (cat == "user_annotation" && e.name.starts_with("ProfilerStep#")) {
    info.step_ns.push_back(e.dur_ns);
  } else if (cat == "cuda_runtime" || cat == "cuda_driver") {
    ++info.runtime_calls;
    if (a.correlation >= 0 && a.external_id >= 0) {
      runtime_links.emplace_back(a.correlation, a.external_id);
    }
  }
}

void TraceData::finish() {
  std::stable_sort(ops.begin(), ops.end(),
                   [](const OpRef& x, const OpRef& y) { return x.external_id < y.external_id; });
  std::sort(runtime_links.begin(), runtime_links.end());
  // Classification depends only on (kernel name, op name): cache it per pair.
  std::unordered_map<uint64_t, Classification> cache;
  for (GpuActivity& g : gpu) {
    if (g.kind == GpuKind::kMemcpy) {
      g.category = Category::kMemcpy;
      continue;
    }
    if (g.kind == GpuKind::kMemset) {
      g.category = Category::kMemset;
      continue;
    }
    const OpRef* op = launching_op(g);
    uint32_t op_name = op ? op->name : StringTable::kEmpty;
    uint64_t key = (static_cast<uint64_t>(g.name) << 32) | op_name;
    auto it = cache.find(key);
    if (it == cache.end()) {
      it = cache.emplace(key, classify_kernel(strings[g.name], strings[op_name], user_rules)).first;
    }
    g.category = it->second.category;
    g.rule = static_cast<int16_t>(it->second.rule);
  }
}

const OpRef* TraceData::launching_op(const GpuActivity& a) const {
  int64_t ext = a.external_id;
  if (ext < 0 && a.correlation >= 0) {
    auto it = std::lower_bound(runtime_links.begin(), runtime_links.end(),
                               std::make_pair(a.correlation, INT64_MIN));
    if (it != runtime_links.end() && it->first == a.correlation) ext = it->second;
  }
  if (ext < 0) return nullptr;
  auto it = std::lower_bound(ops.begin(), ops.end(), ext,
                             [](const OpRef& o, int64_t v) { return o.external_id < v; });
  if (it == ops.end() || it->external_id != ext) return nullptr;
  return &*it;
}

std::string TraceData::thread_label(uint32_t thread) const {
  if (thread == 0) return "";
  const auto& [pid, tid] = threads[thread - 1];
  auto it = thread_names.find({pid, tid});
  if (it != thread_names.end() && it->second != StringTable::kEmpty) return strings[it->second];
  return fmt::format("pid {} tid {}", pid, tid);
}

std::string TraceData::describe_rule(int rule) const {
  return analysis::describe_rule(rule, user_rules);
}

}  // namespace tessera::analysis
