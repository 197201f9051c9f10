#include "tessera/analysis/trace_data.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace tessera::analysis {

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

TraceData TraceData::load(const std::string& path, bool progress) {
  TraceData data;
  data.info.path = path;
  data.info.read = read_trace(
      path, [&](std::string_view key, std::string_view value) { data.add_member(key, value); },
      [&](const TraceEvent& e) { data.add_event(e); }, progress);
  data.finish();
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

bool TraceData::keeps_detail(uint32_t op_name) {
  auto it = keeps_detail_.find(op_name);
  if (it != keeps_detail_.end()) return it->second;
  std::string_view n = strings[op_name];
  // GEMM ops (mm, addmm, bmm, _scaled_mm, matmul, linear), attention ops and collectives.
  bool keep = n.find("mm") != n.npos || n.find("linear") != n.npos || n.find("matmul") != n.npos ||
              n.find("attention") != n.npos || n.find("record_param_comms") != n.npos;
  keeps_detail_.emplace(op_name, keep);
  return keep;
}

void TraceData::add_event(const TraceEvent& e) {
  if (e.ph == 's' || e.ph == 'f' || e.ph == 't') {
    ++info.flow_events;
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
    g.rule = -1;
    if (g.kind == GpuKind::kKernel) {
      if (!a.collective.empty() || a.in_nelems >= 0) g.collective = add_collective(a);
      if (a.m >= 0 || a.n >= 0 || a.k >= 0 || a.b >= 0 || a.h >= 0 || a.t >= 0) {
        ShapeArgs s;
        s.m = a.m, s.n = a.n, s.k = a.k, s.batch = a.batch;
        s.b = a.b, s.h = a.h, s.kv = a.kv, s.t = a.t, s.s = a.s, s.d = a.d;
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
    uint32_t name = strings.intern(e.name);
    OpTimes& t = op_times[name];
    ++t.count;
    t.total_ns += e.dur_ns;
    t.min_ns = std::min(t.min_ns, e.dur_ns);
    t.max_ns = std::max(t.max_ns, e.dur_ns);
    if (a.external_id < 0) return;
    int32_t detail = -1;
    if (keeps_detail(name)) {
      OpDetail d;
      d.input_dims = strings.intern(a.input_dims);
      d.input_types = strings.intern(a.input_types);
      d.concrete_inputs = strings.intern(a.concrete_inputs);
      if (!a.collective.empty()) d.collective = add_collective(a);
      op_details.push_back(d);
      detail = static_cast<int32_t>(op_details.size() - 1);
    }
    ops.push_back({a.external_id, name, detail});
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
      it = cache.emplace(key, classify_kernel(strings[g.name], strings[op_name])).first;
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

}  // namespace tessera::analysis
