#include "tessera/analysis/collectives.h"

#include <algorithm>
#include <cctype>
#include <map>

#include <fmt/format.h>

#include "tessera/analysis/gpu_specs.h"

namespace tessera::analysis {
namespace {

std::string lower_alnum(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    }
  }
  return out;
}

// NCCL kernel names carry the element type: ncclDevKernel_AllReduce_Sum_bf16_RING_LL.
std::string dtype_from_kernel_name(std::string_view name) {
  for (std::string_view t : {"_bf16", "_f16", "_f32", "_f64", "_i8", "_u8", "_i32", "_u32", "_i64",
                             "_u64", "_f8e4m3", "_f8e5m2"}) {
    size_t pos = name.find(t);
    if (pos != std::string_view::npos) return dtype_info(t.substr(1)).name;
  }
  return "";
}

}  // namespace

std::string normalize_collective(std::string_view name) {
  const std::string n = lower_alnum(name);
  if (n.find("allreduce") != std::string::npos) return "all_reduce";
  if (n.find("allgather") != std::string::npos) return "all_gather";
  if (n.find("reducescatter") != std::string::npos) return "reduce_scatter";
  if (n.find("alltoall") != std::string::npos) return "all_to_all";
  if (n.find("broadcast") != std::string::npos) return "broadcast";
  if (n.find("sendrecv") != std::string::npos || n.find("send") != std::string::npos ||
      n.find("recv") != std::string::npos) {
    return "send_recv";
  }
  if (n.find("barrier") != std::string::npos) return "barrier";
  if (n.find("reduce") != std::string::npos) return "reduce";
  if (n.find("gather") != std::string::npos) return "gather";
  if (n.find("scatter") != std::string::npos) return "scatter";
  return n;
}

double bus_bandwidth_factor(std::string_view kind, int64_t ranks) {
  if (ranks <= 0) return 1.0;
  const double n = static_cast<double>(ranks);
  if (kind == "all_reduce") return 2.0 * (n - 1) / n;
  if (kind == "all_gather" || kind == "reduce_scatter" || kind == "all_to_all") {
    return (n - 1) / n;
  }
  return 1.0;
}

CollectiveInfo collective_info(const TraceData& data, const GpuActivity& g) {
  const CollectiveArgs* args = g.collective >= 0 ? &data.collectives[g.collective] : nullptr;
  if (!args) {
    const OpRef* op = data.launching_op(g);
    if (op && op->detail >= 0 && data.op_details[op->detail].collective >= 0) {
      args = &data.collectives[data.op_details[op->detail].collective];
    }
  }
  return collective_info(data, g, args);
}

CollectiveInfo collective_info(const TraceData& data, const GpuActivity& g,
                               const CollectiveArgs* args) {
  CollectiveInfo info;
  const std::string& kernel = data.strings[g.name];
  info.kind = normalize_collective(args && args->name ? data.strings[args->name] : kernel);
  if (info.kind.empty()) info.kind = normalize_collective(kernel);
  info.dtype = args && args->dtype ? dtype_info(data.strings[args->dtype]).name
                                   : dtype_from_kernel_name(kernel);
  if (args) {
    info.group_size = args->group_size;
    info.process_group = data.strings[args->process_group];
    info.seq = args->seq;
    if (args->bytes >= 0) {
      info.bytes = args->bytes;
    } else {
      const int64_t elems = std::max(args->in_nelems, args->out_nelems);
      const int size = dtype_info(info.dtype).bytes;
      if (elems >= 0 && size > 0) info.bytes = elems * size;
    }
  }
  return info;
}

Table collectives_table(const TraceData& data) {
  struct Agg {
    uint64_t count = 0;
    int64_t total_ns = 0, min_ns = INT64_MAX, max_ns = 0;
  };
  std::map<std::tuple<std::string, std::string, int64_t, int64_t>, Agg> rows;
  for (const GpuActivity& g : data.gpu) {
    if (g.category != Category::kCommunication) continue;
    CollectiveInfo c = collective_info(data, g);
    Agg& a = rows[{c.kind, c.dtype, c.bytes, c.group_size}];
    ++a.count;
    a.total_ns += g.dur_ns;
    a.min_ns = std::min(a.min_ns, g.dur_ns);
    a.max_ns = std::max(a.max_ns, g.dur_ns);
  }
  Table t;
  t.name = "collectives";
  t.title = "Collectives";
  t.note =
      "size = max(in, out) elements * element size; algbw = size / time; busbw = algbw * "
      "2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), 1 otherwise "
      "(nccl-tests). mean uses the mean time, best the fastest call; waiting for peers counts "
      "as time.";
  t.columns = {{"collective", true}, {"dtype", true}, {"bytes", true},
               {"group_size", true}, {"count"},       {"total_ms"},
               {"mean_us"},          {"min_us"},      {"max_us"},
               {"algbw_gbps"},       {"busbw_gbps"},  {"busbw_best_gbps"}};
  std::vector<std::pair<decltype(rows)::key_type, Agg>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& x, const auto& y) { return x.second.total_ns > y.second.total_ns; });
  for (const auto& [key, a] : sorted) {
    const auto& [kind, dtype, bytes, group] = key;
    const double mean_ns = static_cast<double>(a.total_ns) / static_cast<double>(a.count);
    std::vector<Cell> row = {kind,
                             dtype.empty() ? Cell{} : Cell{dtype},
                             cell_or_empty(bytes),
                             cell_or_empty(group),
                             static_cast<int64_t>(a.count),
                             a.total_ns / 1e6,
                             mean_ns / 1e3,
                             a.min_ns / 1e3,
                             a.max_ns / 1e3};
    if (bytes > 0 && mean_ns > 0) {
      const double factor = bus_bandwidth_factor(kind, group);
      const double algbw = static_cast<double>(bytes) / mean_ns;  // bytes/ns == GB/s
      row.push_back(algbw);
      row.push_back(algbw * factor);
      row.push_back(a.min_ns > 0 ? static_cast<double>(bytes) / a.min_ns * factor : 0.0);
    }
    row.resize(t.columns.size());
    t.rows.push_back(std::move(row));
  }
  return t;
}

}  // namespace tessera::analysis
