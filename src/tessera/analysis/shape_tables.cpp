// The gemm and attention tables: GPU activities grouped into op calls, shapes resolved
// (shapes.cpp), FLOPs, TFLOP/s and roofline columns.
#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "tessera/analysis/shapes.h"

namespace tessera::analysis {
namespace {

// Parsed op arguments, cached by interned raw text (the same shapes repeat every layer).
class ArgCache {
 public:
  explicit ArgCache(const TraceData& data) : data_(data) {}
  const std::vector<std::vector<int64_t>>& dims(uint32_t id) {
    auto it = dims_.find(id);
    if (it == dims_.end()) it = dims_.emplace(id, parse_dims(data_.strings[id])).first;
    return it->second;
  }
  const std::vector<std::string>& strings(uint32_t id) {
    auto it = strings_.find(id);
    if (it == strings_.end()) it = strings_.emplace(id, parse_strings(data_.strings[id])).first;
    return it->second;
  }

 private:
  const TraceData& data_;
  std::unordered_map<uint32_t, std::vector<std::vector<int64_t>>> dims_;
  std::unordered_map<uint32_t, std::vector<std::string>> strings_;
};

// One op instance: the GPU activities that share an External id (or a lone activity).
struct Call {
  size_t first;
  int64_t time_ns = 0;
  Category category;
};

template <typename Pred>
std::vector<Call> group_calls(const TraceData& data, Pred wanted) {
  std::vector<Call> calls;
  std::unordered_map<int64_t, size_t> by_external_id;
  for (size_t i = 0; i < data.gpu.size(); ++i) {
    const GpuActivity& g = data.gpu[i];
    if (!wanted(g.category)) continue;
    if (g.external_id >= 0) {
      auto [it, inserted] = by_external_id.emplace(g.external_id, calls.size());
      if (!inserted) {
        calls[it->second].time_ns += g.dur_ns;
        continue;
      }
    }
    calls.push_back({i, g.dur_ns, g.category});
  }
  return calls;
}

struct Agg {
  uint64_t count = 0;
  int64_t total_ns = 0;
  std::map<std::string, uint64_t> ops;
  std::string most_common_op() const {
    std::string best;
    uint64_t n = 0;
    for (const auto& [op, c] : ops) {
      if (c > n) best = op, n = c;
    }
    return best;
  }
};

std::string op_label(const TraceData& data, const GpuActivity& g) {
  if (g.shape >= 0) return "tessera args";
  const OpRef* op = data.launching_op(g);
  return op ? data.strings[op->name] : std::string("(no op)");
}

Cell positive(int64_t v) {
  return v > 0 ? Cell{v} : Cell{};
}

}  // namespace

Table gemm_table(const TraceData& data, const std::optional<GpuSpec>& gpu) {
  ArgCache cache(data);
  std::map<std::string, std::pair<GemmShape, Agg>> rows;
  for (const Call& call : group_calls(data, [](Category c) { return c == Category::kGemm; })) {
    const GpuActivity& g = data.gpu[call.first];
    GemmShape shape;
    if (g.shape >= 0) {
      const ShapeArgs& a = data.shapes[g.shape];
      shape.m = a.m, shape.n = a.n, shape.k = a.k, shape.batch = a.batch > 0 ? a.batch : 1;
      shape.dtype = dtype_info(data.strings[a.dtype]).name;
    } else if (const OpRef* op = data.launching_op(g); op && op->detail >= 0) {
      const OpDetail& d = data.op_details[op->detail];
      auto s = gemm_shape_from_op(data.strings[op->name], cache.dims(d.input_dims),
                                  cache.strings(d.input_types));
      if (s) shape = *s;
    }
    std::string key =
        fmt::format("{}|{}|{}|{}|{}", shape.m, shape.n, shape.k, shape.batch, shape.dtype);
    auto& [s, agg] = rows.try_emplace(key, shape, Agg{}).first->second;
    ++agg.count;
    agg.total_ns += call.time_ns;
    ++agg.ops[op_label(data, g)];
  }
  Table t;
  t.name = "gemm";
  t.title = "GEMMs by shape";
  t.note = fmt::format(
      "One row per unique (M, N, K, batch, dtype); a call is one op instance (its kernels "
      "summed). FLOPs = 2*M*N*K*batch; bytes = A + B + C once. Peak and roofline: {}.",
      gpu ? gpu->name + " datasheet (configs/gpus.yaml)" : "no GPU given (use --gpu)");
  t.columns = {{"op"},          {"M", true},     {"N", true},  {"K", true},
               {"batch", true}, {"dtype", true}, {"count"},    {"total_ms"},
               {"mean_us"},     {"gflop"},       {"mbytes"},   {"flops_per_byte"},
               {"tflops"},      {"peak_tflops"}, {"peak_pct"}, {"ridge_flops_per_byte"},
               {"bound"},       {"roofline_pct"}};
  std::vector<std::pair<GemmShape, Agg>> sorted;
  for (auto& [key, value] : rows) sorted.push_back(std::move(value));
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& x, const auto& y) { return x.second.total_ns > y.second.total_ns; });
  for (const auto& [s, agg] : sorted) {
    const bool known = s.m > 0 && s.n > 0 && s.k > 0;
    const double mean_s = static_cast<double>(agg.total_ns) / 1e9 / static_cast<double>(agg.count);
    std::vector<Cell> row = {agg.most_common_op(),
                             positive(s.m),
                             positive(s.n),
                             positive(s.k),
                             known ? Cell{s.batch} : Cell{},
                             s.dtype.empty() ? Cell{std::string("?")} : Cell{s.dtype},
                             static_cast<int64_t>(agg.count),
                             agg.total_ns / 1e6,
                             mean_s * 1e6};
    if (!known) {
      row.resize(t.columns.size());
      t.rows.push_back(std::move(row));
      continue;
    }
    const double flops = gemm_flops(s), bytes = gemm_bytes(s);
    const double tflops = mean_s > 0 ? flops / mean_s / 1e12 : 0;
    const double intensity = bytes > 0 ? flops / bytes : 0;
    row.push_back(flops / 1e9);
    row.push_back(bytes > 0 ? Cell{bytes / 1e6} : Cell{});
    row.push_back(bytes > 0 ? Cell{intensity} : Cell{});
    row.push_back(tflops);
    const double peak = gpu ? peak_tflops(*gpu, s.dtype) : 0;
    if (peak > 0 && bytes > 0) {
      const double ridge = peak / gpu->hbm_tbps;  // FLOP/byte where the roofs meet
      const double roof = std::min(peak, intensity * gpu->hbm_tbps);
      row.push_back(peak);
      row.push_back(100.0 * tflops / peak);
      row.push_back(ridge);
      row.push_back(std::string(intensity >= ridge ? "compute" : "memory"));
      row.push_back(100.0 * tflops / roof);
    }
    row.resize(t.columns.size());
    t.rows.push_back(std::move(row));
  }
  return t;
}

Table attention_table(const TraceData& data, const std::optional<GpuSpec>& gpu) {
  ArgCache cache(data);
  std::map<std::string, std::tuple<AttentionShape, bool, Agg>> rows;
  auto is_attention = [](Category c) {
    return c == Category::kAttentionFwd || c == Category::kAttentionBwd;
  };
  for (const Call& call : group_calls(data, is_attention)) {
    const GpuActivity& g = data.gpu[call.first];
    const bool backward = call.category == Category::kAttentionBwd;
    AttentionShape shape;
    if (g.shape >= 0) {
      const ShapeArgs& a = data.shapes[g.shape];
      shape.b = a.b, shape.h = a.h, shape.kv = a.kv > 0 ? a.kv : a.h, shape.t = a.t;
      shape.s = a.s > 0 ? a.s : a.t, shape.d = a.d, shape.dv = a.dv, shape.causal = a.causal;
      shape.window = a.window;
      shape.dtype = dtype_info(data.strings[a.dtype]).name;
    } else if (const OpRef* op = data.launching_op(g); op && op->detail >= 0) {
      const OpDetail& d = data.op_details[op->detail];
      auto s =
          attention_shape_from_op(data.strings[op->name], cache.dims(d.input_dims),
                                  cache.strings(d.input_types), cache.strings(d.concrete_inputs));
      if (s) shape = *s;
    }
    std::string key =
        fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", backward, shape.b, shape.h, shape.kv, shape.t,
                    shape.s, shape.d, shape.causal, shape.window, shape.dtype);
    auto& [s, bwd, agg] = rows.try_emplace(key, shape, backward, Agg{}).first->second;
    ++agg.count;
    agg.total_ns += call.time_ns;
    ++agg.ops[op_label(data, g)];
  }
  Table t;
  t.name = "attention";
  t.title = "Attention";
  t.note =
      "FLOPs per call: forward 4*B*H*T*S*D, halved when causal, T*W pairs with a sliding "
      "window W < S; backward 2.5x forward. A call sums the kernels of one op instance.";
  t.columns = {{"pass", true}, {"B", true},     {"H", true},      {"KV", true},     {"T", true},
               {"S", true},    {"D", true},     {"causal", true}, {"window", true}, {"dtype", true},
               {"op"},         {"count"},       {"total_ms"},     {"mean_us"},      {"gflop"},
               {"tflops"},     {"peak_tflops"}, {"peak_pct"}};
  std::vector<std::tuple<AttentionShape, bool, Agg>> sorted;
  for (auto& [key, value] : rows) sorted.push_back(std::move(value));
  std::sort(sorted.begin(), sorted.end(), [](const auto& x, const auto& y) {
    return std::get<2>(x).total_ns > std::get<2>(y).total_ns;
  });
  for (const auto& [s, backward, agg] : sorted) {
    const bool known = s.b > 0 && s.h > 0 && s.t > 0 && s.s > 0 && s.d > 0;
    const double mean_s = static_cast<double>(agg.total_ns) / 1e9 / static_cast<double>(agg.count);
    std::vector<Cell> row = {std::string(backward ? "bwd" : "fwd"),
                             positive(s.b),
                             positive(s.h),
                             positive(s.kv),
                             positive(s.t),
                             positive(s.s),
                             positive(s.d),
                             s.causal < 0 ? Cell{} : Cell{std::string(s.causal ? "true" : "false")},
                             positive(s.window),
                             s.dtype.empty() ? Cell{std::string("?")} : Cell{s.dtype},
                             agg.most_common_op(),
                             static_cast<int64_t>(agg.count),
                             agg.total_ns / 1e6,
                             mean_s * 1e6};
    if (known) {
      const double flops = attention_flops(s, backward);
      const double tflops = mean_s > 0 ? flops / mean_s / 1e12 : 0;
      row.push_back(flops / 1e9);
      row.push_back(tflops);
      const double peak = gpu ? peak_tflops(*gpu, s.dtype) : 0;
      if (peak > 0) {
        row.push_back(peak);
        row.push_back(100.0 * tflops / peak);
      }
    }
    row.resize(t.columns.size());
    t.rows.push_back(std::move(row));
  }
  return t;
}

}  // namespace tessera::analysis
