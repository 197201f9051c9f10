#include "tessera/analysis/bandwidth.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/analysis/shapes.h"

namespace tessera::analysis {
namespace {

BytesEstimate not_derived(std::string why) {
  return {-1, "not derived: " + why, true};
}

// ---- PyTorch ops ----

struct TensorArg {
  std::vector<int64_t> dims;
  int elem_bytes;
  double numel() const {
    double n = 1;
    for (int64_t d : dims) n *= static_cast<double>(d);
    return n;
  }
  double bytes() const { return numel() * elem_bytes; }
};

// Arguments that are not tensors: Python scalars and lists of them, and None.
bool is_non_tensor(const std::string& type) {
  return type.empty() || type == "Scalar" || type == "ScalarList";
}

// The op's tensor arguments in order, or the reason they are not all known. `positions` gets
// each tensor's argument index.
std::optional<std::string> tensor_args(std::string_view input_dims, std::string_view input_types,
                                       std::vector<TensorArg>& out,
                                       std::vector<size_t>& positions) {
  const auto dims = parse_dims(input_dims);
  const auto types = parse_strings(input_types);
  for (size_t i = 0; i < types.size(); ++i) {
    if (is_non_tensor(types[i])) continue;
    const int bytes = dtype_info(types[i]).bytes;
    if (bytes == 0) {
      return fmt::format("argument {} is a {}, which the trace gives no element type for", i,
                         types[i]);
    }
    out.push_back({i < dims.size() ? dims[i] : std::vector<int64_t>{}, bytes});
    positions.push_back(i);
  }
  if (out.empty()) return std::string("the op has no tensor arguments");
  return std::nullopt;
}

// NumPy broadcasting of every shape; nullopt when two disagree.
std::optional<std::vector<int64_t>> broadcast(const std::vector<TensorArg>& tensors) {
  size_t rank = 0;
  for (const TensorArg& t : tensors) rank = std::max(rank, t.dims.size());
  std::vector<int64_t> out(rank, 1);
  for (const TensorArg& t : tensors) {
    for (size_t i = 0; i < t.dims.size(); ++i) {
      int64_t& o = out[rank - t.dims.size() + i];
      const int64_t d = t.dims[i];
      if (d == o || d == 1) continue;
      if (o != 1) return std::nullopt;
      o = d;
    }
  }
  return out;
}

// The first Concrete Inputs entry after self that is a list of integers ("[-1]", "[0, 2]").
std::optional<std::vector<int64_t>> reduced_dims(const std::vector<std::string>& concrete) {
  for (size_t i = 1; i < concrete.size(); ++i) {
    const std::string& c = concrete[i];
    if (c.size() < 2 || c.front() != '[' || c.back() != ']') continue;
    auto parsed = nlohmann::json::parse(c, nullptr, false);
    if (!parsed.is_array()) continue;
    std::vector<int64_t> out;
    for (const auto& d : parsed) {
      if (!d.is_number_integer()) return std::nullopt;
      out.push_back(d.get<int64_t>());
    }
    return out;
  }
  return std::nullopt;
}

constexpr std::string_view kFillOps[] = {
    "aten::fill_",   "aten::zero_",       "aten::normal_",      "aten::uniform_",
    "aten::random_", "aten::bernoulli_",  "aten::exponential_", "aten::geometric_",
    "aten::cauchy_", "aten::log_normal_",
};
constexpr std::string_view kReductionOps[] = {
    "aten::sum",           "aten::mean",   "aten::amax",      "aten::amin",
    "aten::max",           "aten::min",    "aten::prod",      "aten::norm",
    "aten::std",           "aten::var",    "aten::any",       "aten::all",
    "aten::argmax",        "aten::argmin", "aten::logsumexp", "aten::linalg_vector_norm",
    "aten::count_nonzero",
};

bool one_of(std::string_view op, std::span<const std::string_view> names) {
  return std::find(names.begin(), names.end(), op) != names.end();
}

double sum_bytes(const std::vector<TensorArg>& tensors) {
  double b = 0;
  for (const TensorArg& t : tensors) b += t.bytes();
  return b;
}

// ---- Tessera ops (src/tessera/ops/op_observer.h writes their args) ----

class OpArgsView {
 public:
  explicit OpArgsView(const nlohmann::json& j) : j_(j) {}
  double num(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && it->is_number() ? it->get<double>() : -1;
  }
  // Element size of a dtype arg; 0 when absent or unknown.
  double size(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && it->is_string() ? dtype_info(it->get<std::string>()).bytes : 0;
  }
  bool has(const char* key) const { return j_.find(key) != j_.end(); }
  bool flag(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && it->is_boolean() && it->get<bool>();
  }

 private:
  const nlohmann::json& j_;
};

struct TesseraModel {
  std::string_view op;
  std::string_view basis;
  // Arguments the formula needs; "dtype" and "src_dtype" must name a known type.
  std::initializer_list<const char*> needs;
  double (*bytes)(const OpArgsView& a);
};

// The tensors each op's contract (ops/backend.h) reads and writes, each once; e is the
// compute dtype's size, statistics and weight gradients are fp32.
const TesseraModel kTesseraModels[] = {
    {"fill",
     "dst written",
     {"numel", "dtype"},
     [](const OpArgsView& a) { return a.num("numel") * a.size("dtype"); }},
    {"init_normal",
     "dst written",
     {"numel", "dtype"},
     [](const OpArgsView& a) { return a.num("numel") * a.size("dtype"); }},
    {"convert",
     "src read, dst written",
     {"numel", "dtype", "src_dtype"},
     [](const OpArgsView& a) { return a.num("numel") * (a.size("src_dtype") + a.size("dtype")); }},
    {"copy",
     "src read, dst written",
     {"nbytes"},
     [](const OpArgsView& a) { return 2 * a.num("nbytes"); }},
    {"sum",
     "x read, the fp32 sum written (and read when accumulating)",
     {"numel", "dtype"},
     [](const OpArgsView& a) {
       return a.num("numel") * a.size("dtype") + 4.0 * (a.flag("accumulate") ? 2 : 1);
     }},
    {"sum_squares",
     "x read, the fp32 sum written (and read when accumulating)",
     {"numel", "dtype"},
     [](const OpArgsView& a) {
       return a.num("numel") * a.size("dtype") + 4.0 * (a.flag("accumulate") ? 2 : 1);
     }},
    {"rmsnorm_forward",
     "x, weight read; out, rstd (fp32) written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       const double r = a.num("rows"), c = a.num("cols");
       return (2 * r * c + c) * a.size("dtype") + 4 * r;
     }},
    {"rmsnorm_forward_cast",
     "x, weight read; out (unless out_unwritten), rstd (fp32) and out's FP8 codes written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       const double r = a.num("rows"), c = a.num("cols");
       return ((a.flag("out_unwritten") ? 1 : 2) * r * c + c) * a.size("dtype") + 4 * r + r * c;
     }},
    {"rmsnorm_transposed_codes",
     "x, weight, rstd (fp32) read; the output's transposed FP8 codes written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       const double r = a.num("rows"), c = a.num("cols");
       return (r * c + c) * a.size("dtype") + 4 * r + r * c;
     }},
    {"rmsnorm_backward",
     "dout, x, weight, rstd read; dx read and written (it accumulates); dweight (fp32) read and "
     "written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       const double r = a.num("rows"), c = a.num("cols");
       return (4 * r * c + c) * a.size("dtype") + 4 * r + 8 * c;
     }},
    {"rope_forward",
     "query and key heads read and written in place; freqs (fp32) read",
     {"tokens", "seq", "heads", "kv_heads", "head_dim", "dtype"},
     [](const OpArgsView& a) {
       return 2 * a.num("tokens") * (a.num("heads") + a.num("kv_heads")) * a.num("head_dim") *
                  a.size("dtype") +
              4 * a.num("seq") * a.num("head_dim");
     }},
    {"rope_backward",
     "query and key gradient heads read and written in place; freqs read",
     {"tokens", "seq", "heads", "kv_heads", "head_dim", "dtype"},
     [](const OpArgsView& a) {
       return 2 * a.num("tokens") * (a.num("heads") + a.num("kv_heads")) * a.num("head_dim") *
                  a.size("dtype") +
              4 * a.num("seq") * a.num("head_dim");
     }},
    {"swiglu_forward",
     "gate_up (rows x cols) read, out (rows x cols/2) written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) { return 1.5 * a.num("rows") * a.num("cols") * a.size("dtype"); }},
    {"swiglu_forward_cast",
     "gate_up (rows x cols) read, out (rows x cols/2, unless out_unwritten) and its FP8 codes "
     "(code_layouts of them: row-major, transposed) written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       const double layouts = a.num("code_layouts") > 0 ? a.num("code_layouts") : 1;
       return (a.flag("out_unwritten") ? 1.0 : 1.5) * a.num("rows") * a.num("cols") *
                  a.size("dtype") +
              0.5 * layouts * a.num("rows") * a.num("cols");
     }},
    {"swiglu_backward",
     "gate_up, dout read; dgate_up written",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) { return 2.5 * a.num("rows") * a.num("cols") * a.size("dtype"); }},
    {"cross_entropy",
     "logits, targets read; losses (and dlogits when with_grad) written",
     {"rows", "vocab", "dtype"},
     [](const OpArgsView& a) {
       const double r = a.num("rows");
       return r * a.num("vocab") * a.size("dtype") * (a.flag("with_grad") ? 2 : 1) + 8 * r;
     }},
    {"bias_backward",
     "dout read; dbias (fp32) read and written (it accumulates)",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) {
       return a.num("rows") * a.num("cols") * a.size("dtype") + 8 * a.num("cols");
     }},
    {"fp8_cast_transpose",
     "x read; its fp8 copy and fp8 transpose written (both counted)",
     {"rows", "cols", "dtype"},
     [](const OpArgsView& a) { return a.num("rows") * a.num("cols") * (a.size("dtype") + 2); }},
    {"fp8_block_cast",
     "x read; each written output's fp8 codes and its fp32 scales (one per 128 elements, or "
     "per 128x128 block)",
     {"rows", "cols", "dtype", "outputs"},
     [](const OpArgsView& a) {
       const double n = a.num("rows") * a.num("cols");
       return n * a.size("dtype") +
              a.num("outputs") * n * (1 + (a.flag("blocks") ? 4.0 / 16384 : 4.0 / 128));
     }},
    {"adamw_step",
     "grad, master, exp_avg, exp_avg_sq read and the last three written, each in its dtype "
     "(fp32 where the trace names none); params written when they are a compute-dtype copy, "
     "read and written when they are the master (master false)",
     {"numel", "dtype"},
     [](const OpArgsView& a) {
       const double n = a.num("numel"), e = a.size("dtype");
       auto state = [&](const char* key) { return a.size(key) > 0 ? a.size(key) : 4.0; };
       const double moments = 2 * (state("exp_avg_dtype") + state("exp_avg_sq_dtype"));
       const double grad = state("grad_dtype");
       if (a.has("master") && !a.flag("master")) return n * (grad + moments + 2 * e);
       return n * (grad + moments + 8) + (e != 4 ? n * e : 0);
     }},
};

std::string json_text(const nlohmann::json& j, std::string_view key) {
  auto it = j.find(key);
  return it == j.end() ? std::string("(missing)") : it->dump();
}

}  // namespace

bool bandwidth_category(Category c) {
  return c == Category::kElementwise || c == Category::kReduction ||
         c == Category::kNormalization || c == Category::kOptimizer || c == Category::kMemcpy ||
         c == Category::kMemset;
}

BytesEstimate pytorch_op_bytes(std::string_view op, std::string_view input_dims,
                               std::string_view input_types, std::string_view concrete_inputs) {
  std::vector<TensorArg> tensors;
  std::vector<size_t> positions;
  if (auto why = tensor_args(input_dims, input_types, tensors, positions)) return not_derived(*why);
  if (op.starts_with("triton_")) {
    // Inductor passes every buffer the kernel touches, inputs and outputs alike.
    return {sum_bytes(tensors), "triton: every tensor argument once", true};
  }
  if (op == "aten::copy_") {
    if (tensors.size() < 2 || positions[0] != 0 || positions[1] != 1) {
      return not_derived("copy_ without a destination and a source tensor");
    }
    return {tensors[0].bytes() + tensors[1].bytes(), "copy: source read, destination written",
            true};
  }
  if (one_of(op, kFillOps)) {
    if (positions[0] != 0) return not_derived("self is not a tensor");
    return {tensors[0].bytes(), "fill: self written", true};
  }
  if (op.ends_with("_")) {
    if (positions[0] != 0) return not_derived("self is not a tensor");
    return {sum_bytes(tensors) + tensors[0].bytes(), "in place: every tensor read, self written",
            true};
  }
  if (one_of(op, kReductionOps)) {
    if (positions[0] != 0) return not_derived("self is not a tensor");
    const TensorArg& in = tensors[0];
    double out_numel = 1;
    if (auto dims = reduced_dims(parse_strings(concrete_inputs))) {
      const int64_t rank = static_cast<int64_t>(in.dims.size());
      std::vector<bool> reduced(in.dims.size(), dims->empty());
      for (int64_t d : *dims) {
        const int64_t axis = d < 0 ? d + rank : d;
        if (axis < 0 || axis >= rank) return not_derived(fmt::format("dim {} out of range", d));
        reduced[axis] = true;
      }
      for (size_t i = 0; i < in.dims.size(); ++i) {
        if (!reduced[i]) out_numel *= static_cast<double>(in.dims[i]);
      }
    }
    return {in.bytes() + out_numel * in.elem_bytes, "reduction: input read, reduced output written",
            true};
  }
  auto out = broadcast(tensors);
  if (!out) return not_derived("the tensor arguments do not broadcast, so the output is unknown");
  double out_numel = 1;
  for (int64_t d : *out) out_numel *= static_cast<double>(d);
  int out_bytes = 0;
  for (const TensorArg& t : tensors) out_bytes = std::max(out_bytes, t.elem_bytes);
  return {sum_bytes(tensors) + out_numel * out_bytes,
          "elementwise: every tensor read, one output of their broadcast shape written", true};
}

BytesEstimate tessera_op_bytes(std::string_view op, std::string_view args_json) {
  const auto* model = std::find_if(std::begin(kTesseraModels), std::end(kTesseraModels),
                                   [&](const TesseraModel& m) { return m.op == op; });
  const auto j = nlohmann::json::parse(args_json, nullptr, false);
  if (model == std::end(kTesseraModels)) {
    // Ops this file has no model of still carry the op table's own count (ops/op_table.h).
    if (j.is_object() && OpArgsView(j).num("op_bytes") > 0)
      return {OpArgsView(j).num("op_bytes"), fmt::format("{}: the op's own count (op_bytes)", op), true};
    return not_derived(fmt::format("no byte model for op '{}'", op));
  }
  if (!j.is_object()) return not_derived("the op has no arguments");
  const OpArgsView a(j);
  for (const char* key : model->needs) {
    const bool type = std::string_view(key).ends_with("dtype");
    if (type ? a.size(key) == 0 : a.num(key) < 0) {
      return not_derived(fmt::format("op argument '{}' is {}", key, json_text(j, key)));
    }
  }
  return {model->bytes(a), fmt::format("{}: {}", op, model->basis), true};
}

BytesEstimate transfer_bytes(std::string_view activity_name, GpuKind kind, int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (kind == GpuKind::kMemset) return {b, "memset: bytes written", true};
  if (activity_name.find("DtoD") != std::string_view::npos) {
    return {2 * b, "memcpy DtoD: bytes read and written", true};
  }
  return {b, "host or peer transfer: bytes once, bound by the link, not HBM", false};
}

Table bandwidth_table(const TraceData& data, const std::optional<GpuSpec>& gpu) {
  // One op call: the activities of these categories that share an External id.
  struct Call {
    size_t first;
    int64_t time_ns = 0;
    int64_t transfer_bytes = 0;
    bool all_transfers = true;  // every activity a memcpy/memset with its bytes
  };
  std::vector<Call> calls;
  std::unordered_map<int64_t, size_t> by_external_id;
  for (size_t i = 0; i < data.gpu.size(); ++i) {
    const GpuActivity& g = data.gpu[i];
    if (!bandwidth_category(g.category)) continue;
    Call* call = nullptr;
    if (g.external_id >= 0) {
      auto [it, inserted] = by_external_id.emplace(g.external_id, calls.size());
      if (!inserted) call = &calls[it->second];
    }
    if (!call) call = &calls.emplace_back(Call{i});
    call->time_ns += g.dur_ns;
    if (g.bytes >= 0) {
      call->transfer_bytes += data.transfer_bytes[g.bytes];
    } else {
      call->all_transfers = false;
    }
  }

  struct Row {
    std::string op, input_dims, input_types, concrete_inputs, args, kernel;
    Category category;
    BytesEstimate estimate;
    uint64_t count = 0;
    int64_t total_ns = 0;
  };
  // Rows by (op name, dims, types, concrete inputs, op args, kernel name, transfer bytes), as
  // interned ids: strings are built once per row, not per call.
  using RowKey = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, int64_t>;
  std::map<RowKey, Row> rows;
  std::unordered_map<uint64_t, BytesEstimate> estimates;  // by (op name, detail)
  for (const Call& call : calls) {
    const GpuActivity& g = data.gpu[call.first];
    const OpRef* op = data.launching_op(g);
    const OpDetail* detail = data.detail(op);
    const OpDetail none;
    const OpDetail& d = detail ? *detail : none;
    // The copy's own byte count is exact; it stands in for the op's args.
    const int64_t bytes = call.all_transfers ? call.transfer_bytes : -1;
    const RowKey key(op ? op->name : StringTable::kEmpty, d.input_dims, d.input_types,
                     d.concrete_inputs, call.all_transfers ? StringTable::kEmpty : d.other_args,
                     g.name, bytes);
    auto [it, inserted] = rows.try_emplace(key);
    Row& r = it->second;
    if (inserted) {
      r.op = op ? data.strings[op->name] : "(no op)";
      r.kernel = data.strings[g.name];
      r.category = g.category;
      r.input_dims = data.strings[d.input_dims];
      r.input_types = data.strings[d.input_types];
      r.concrete_inputs = data.strings[d.concrete_inputs];
      r.args = data.strings[d.other_args];
      if (call.all_transfers) {
        r.args = fmt::format("{{\"bytes\": {}}}", bytes);
        r.estimate = transfer_bytes(r.kernel, g.kind, bytes);
      } else if (!op) {
        r.estimate = not_derived("no launching op (the kernel has no External id or runtime link)");
      } else {
        const uint64_t op_key =
            (static_cast<uint64_t>(op->name) << 32) | static_cast<uint32_t>(op->detail);
        auto e = estimates.find(op_key);
        if (e == estimates.end()) {
          BytesEstimate estimate;
          if (!r.input_dims.empty()) {
            estimate = pytorch_op_bytes(r.op, r.input_dims, r.input_types, r.concrete_inputs);
          } else if (!r.args.empty()) {
            estimate = tessera_op_bytes(r.op, r.args);
          } else {
            estimate = not_derived("the launching op has no shapes (PyTorch: record_shapes=True)");
          }
          e = estimates.emplace(op_key, std::move(estimate)).first;
        }
        r.estimate = e->second;
      }
    }
    ++r.count;
    r.total_ns += call.time_ns;
  }

  const double peak_bps = gpu ? gpu->hbm_tbps * 1e12 : 0;
  Table t;
  t.name = "bandwidth";
  t.title = "Bandwidth of memory-bound kernels";
  t.note = fmt::format(
      "Elementwise, reduction, normalization, optimizer, memcpy and memset work, one row per op "
      "and arguments; a call sums the op instance's kernels. mbytes per call = the minimum "
      "traffic, each tensor read or written once (bytes_basis: how, or why not derived). gbps = "
      "bytes / mean call time; hbm_pct against {}; excess_ms = time above the bandwidth floor "
      "(negative: the data came from cache). memory: what bounds the transfer.",
      gpu ? fmt::format("{} HBM {} TB/s (configs/gpus.yaml)", gpu->name, gpu->hbm_tbps)
          : std::string("no GPU given (use --gpu)"));
  t.columns = {
      {"op", true},   {"input_dims", true}, {"input_type", true}, {"concrete_inputs", true},
      {"args", true}, {"kernel", true},     {"category"},         {"memory"},
      {"count"},      {"total_ms"},         {"mean_us"},          {"mbytes"},
      {"gbps"},       {"hbm_pct"},          {"excess_ms"},        {"bytes_basis"}};
  std::vector<Row*> sorted;
  for (auto& [key, row] : rows) sorted.push_back(&row);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Row* a, const Row* b) { return a->total_ns > b->total_ns; });
  for (const Row* r : sorted) {
    const double mean_s = static_cast<double>(r->total_ns) / 1e9 / static_cast<double>(r->count);
    std::vector<Cell> row = {r->op,
                             r->input_dims,
                             r->input_types,
                             r->concrete_inputs,
                             r->args,
                             r->kernel,
                             std::string(category_name(r->category)),
                             std::string(r->estimate.hbm ? "HBM" : "host/peer link"),
                             static_cast<int64_t>(r->count),
                             r->total_ns / 1e6,
                             mean_s * 1e6};
    const double bytes = r->estimate.bytes;
    if (bytes >= 0) {
      row.push_back(bytes / 1e6);
      row.push_back(mean_s > 0 ? Cell{bytes / mean_s / 1e9} : Cell{});
      if (peak_bps > 0 && r->estimate.hbm && mean_s > 0) {
        row.push_back(100.0 * bytes / mean_s / peak_bps);
        row.push_back(r->total_ns / 1e6 - static_cast<double>(r->count) * bytes / peak_bps * 1e3);
      } else {
        row.insert(row.end(), 2, Cell{});
      }
    } else {
      row.insert(row.end(), 4, Cell{});
    }
    row.push_back(r->estimate.basis);
    t.rows.push_back(std::move(row));
  }
  return t;
}

}  // namespace tessera::analysis
