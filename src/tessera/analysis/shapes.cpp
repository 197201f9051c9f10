#include "tessera/analysis/shapes.h"

#include <cstdlib>

#include <nlohmann/json.hpp>

namespace tessera::analysis {
namespace {

int64_t product(const std::vector<int64_t>& v, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= v[i];
  return p;
}

std::string type_at(const std::vector<std::string>& types, size_t i) {
  return i < types.size() ? dtype_info(types[i]).name : std::string();
}

// Which inputs of a GEMM op are A and B, and whether B is stored [N, K] (linear's weight).
struct GemmOp {
  std::string_view name;
  size_t a, b;
  bool b_is_nk;
};
constexpr GemmOp kGemmOps[] = {
    {"aten::mm", 0, 1, false},     {"aten::addmm", 1, 2, false},
    {"aten::bmm", 0, 1, false},    {"aten::baddbmm", 1, 2, false},
    {"aten::matmul", 0, 1, false}, {"aten::_scaled_mm", 0, 1, false},
    {"aten::linear", 0, 1, true},
};

// Where query/key and the causal/window flags sit in each attention op's inputs.
// bthd: tensors are (batch, seq, heads, dim) instead of (batch, heads, seq, dim).
struct AttentionOp {
  std::string_view name;
  size_t q, k;
  bool bthd;
  int causal, window;
};
constexpr AttentionOp kAttentionOps[] = {
    {"aten::scaled_dot_product_attention", 0, 1, false, 5, -1},
    {"aten::_scaled_dot_product_cudnn_attention", 0, 1, false, 6, -1},
    {"aten::_cudnn_attention_forward", 0, 1, false, 10, -1},
    {"aten::_scaled_dot_product_flash_attention", 0, 1, false, 4, -1},
    {"aten::_scaled_dot_product_efficient_attention", 0, 1, false, 6, -1},
    {"aten::_flash_attention_forward", 0, 1, true, 8, 11},
    {"aten::_efficient_attention_forward", 0, 1, true, -1, -1},
    {"aten::_scaled_dot_product_cudnn_attention_backward", 1, 2, false, 14, -1},
    {"aten::_cudnn_attention_backward", 1, 2, false, 14, -1},
    {"aten::_scaled_dot_product_flash_attention_backward", 1, 2, false, 11, -1},
    {"aten::_scaled_dot_product_efficient_attention_backward", 1, 2, false, 11, -1},
    {"aten::_flash_attention_backward", 1, 2, true, 11, 15},
    {"aten::_efficient_attention_backward", 1, 2, true, -1, -1},
};

}  // namespace

std::vector<std::vector<int64_t>> parse_dims(std::string_view raw_json) {
  std::vector<std::vector<int64_t>> out;
  auto j = nlohmann::json::parse(raw_json, nullptr, false);
  if (!j.is_array()) return out;
  for (const auto& entry : j) {
    std::vector<int64_t> dims;
    if (entry.is_array()) {
      for (const auto& d : entry) {
        if (!d.is_number_integer()) {
          dims.clear();
          break;
        }
        dims.push_back(d.get<int64_t>());
      }
    }
    out.push_back(std::move(dims));
  }
  return out;
}

std::vector<std::string> parse_strings(std::string_view raw_json) {
  std::vector<std::string> out;
  auto j = nlohmann::json::parse(raw_json, nullptr, false);
  if (!j.is_array()) return out;
  for (const auto& entry : j) out.push_back(entry.is_string() ? entry.get<std::string>() : "");
  return out;
}

std::optional<GemmShape> gemm_shape_from_op(std::string_view op,
                                            const std::vector<std::vector<int64_t>>& dims,
                                            const std::vector<std::string>& types) {
  for (const GemmOp& g : kGemmOps) {
    if (op != g.name) continue;
    if (g.b >= dims.size()) return std::nullopt;
    const auto& a = dims[g.a];
    const auto& b = dims[g.b];
    if (a.empty() || b.empty()) return std::nullopt;
    GemmShape s;
    s.dtype = type_at(types, g.a);
    if (g.b_is_nk) {  // linear: x (..., K) times w (N, K)^T
      if (b.size() != 2) return std::nullopt;
      s.m = product(a, 0, a.size() - 1), s.k = a.back(), s.n = b[0];
    } else if (b.size() <= 2) {  // leading dims of A fold into M
      s.m = a.size() >= 2 ? product(a, 0, a.size() - 1) : 1;
      s.k = a.back();
      s.n = b.size() == 2 ? b[1] : 1;
    } else {  // batched: (..., M, K) x (..., K, N)
      if (a.size() < 2) return std::nullopt;
      s.batch = product(b, 0, b.size() - 2);
      s.m = a[a.size() - 2], s.k = a.back(), s.n = b.back();
    }
    return s;
  }
  return std::nullopt;
}

std::optional<AttentionShape> attention_shape_from_op(std::string_view op,
                                                      const std::vector<std::vector<int64_t>>& dims,
                                                      const std::vector<std::string>& types,
                                                      const std::vector<std::string>& concrete) {
  for (const AttentionOp& a : kAttentionOps) {
    if (op != a.name) continue;
    if (a.k >= dims.size() || dims[a.q].size() != 4 || dims[a.k].size() != 4) {
      return std::nullopt;
    }
    const auto& q = dims[a.q];
    const auto& k = dims[a.k];
    AttentionShape s;
    s.b = q[0], s.d = q[3];
    if (a.bthd) {
      s.t = q[1], s.h = q[2], s.s = k[1], s.kv = k[2];
    } else {
      s.h = q[1], s.t = q[2], s.kv = k[1], s.s = k[2];
    }
    s.dtype = type_at(types, a.q);
    if (a.causal >= 0 && static_cast<size_t>(a.causal) < concrete.size()) {
      const std::string& c = concrete[a.causal];
      s.causal = c == "True" ? 1 : (c == "False" ? 0 : -1);
    }
    if (a.window >= 0 && static_cast<size_t>(a.window) < concrete.size()) {
      const std::string& w = concrete[a.window];
      s.window = w.empty() ? -1 : std::atoll(w.c_str());
    }
    return s;
  }
  return std::nullopt;
}

double gemm_flops(const GemmShape& s) {
  return 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k) *
         static_cast<double>(s.batch);
}

double gemm_bytes(const GemmShape& s) {
  const int in = dtype_info(s.dtype).bytes;
  if (in == 0) return 0;
  const int out = s.dtype.starts_with("fp8") ? 2 : in;
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n);
  const double k = static_cast<double>(s.k), b = static_cast<double>(s.batch);
  return b * ((m * k + k * n) * in + m * n * out);
}

double attention_flops(const AttentionShape& s, bool backward) {
  double pairs = static_cast<double>(s.t) * static_cast<double>(s.s);
  if (s.window > 0 && s.window < s.s) {
    pairs = static_cast<double>(s.t) * static_cast<double>(s.window);
  } else if (s.causal == 1) {
    pairs /= 2;
  }
  // The scores over D, the values over Dv (D unless multi-latent attention's narrower values).
  const double d_v = static_cast<double>(s.dv > 0 ? s.dv : s.d);
  double fwd = 2.0 * static_cast<double>(s.b) * static_cast<double>(s.h) * pairs *
               (static_cast<double>(s.d) + d_v);
  return backward ? 2.5 * fwd : fwd;
}

}  // namespace tessera::analysis
