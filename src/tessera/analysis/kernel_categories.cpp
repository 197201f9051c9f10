#include "tessera/analysis/kernel_categories.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::analysis {

// Backtracking steps and nesting depth one match of a user pattern may take. Real kernel-name
// patterns need hundreds; (a+)+$ on 40 letters would need 2^40.
constexpr uint32_t kMatchLimit = 1000000;
constexpr uint32_t kDepthLimit = 10000;

struct CompiledPattern {
  explicit CompiledPattern(pcre2_code* c) : code(c) {}
  ~CompiledPattern() { pcre2_code_free(code); }
  CompiledPattern(const CompiledPattern&) = delete;
  CompiledPattern& operator=(const CompiledPattern&) = delete;

  // Whether the pattern occurs in `subject`; nullopt when it hit the match or depth limit.
  std::optional<bool> search(std::string_view subject) const {
    pcre2_match_context* context = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(context, kMatchLimit);
    pcre2_set_depth_limit(context, kDepthLimit);
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code, nullptr);
    const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(),
                               0, 0, data, context);
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT)
      return std::nullopt;
    return rc >= 0;
  }

  pcre2_code* code;
};

namespace {

using C = Category;
using F = RuleField;
using M = RuleMatch;

std::string pcre2_error_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// First match wins, so specific rules come before general ones: communication before
// anything that says "reduce", attention before GEMM (cuDNN/CUTLASS attention kernels mention
// gemm-like tiles), optimizer before elementwise (fused Adam runs in multi_tensor_apply),
// normalisation before reduction (Triton fuses norms into reductions).
constexpr CategoryRule kRules[] = {
    // --- communication: NCCL / RCCL kernels and custom all-reduce kernels
    {F::kKernel, M::kContains, "nccl", "", C::kCommunication,
     "NCCL (ncclDevKernel_*, ncclKernel_*)"},
    {F::kKernel, M::kContains, "rccl", "", C::kCommunication, "RCCL"},
    {F::kKernel, M::kContains, "cross_device_reduce", "", C::kCommunication, "custom all-reduce"},
    {F::kKernel, M::kContains, "allreduce", "", C::kCommunication, "all-reduce kernels"},
    {F::kKernel, M::kContains, "all_reduce", "", C::kCommunication, "all-reduce kernels"},
    {F::kKernel, M::kContains, "all_gather", "", C::kCommunication, "all-gather kernels"},
    {F::kKernel, M::kContains, "reduce_scatter", "", C::kCommunication, "reduce-scatter kernels"},
    // --- copies and fills recorded as kernels (traces without the gpu_memcpy category)
    {F::kKernel, M::kPrefix, "memcpy", "", C::kMemcpy, "CUPTI memcpy records"},
    {F::kKernel, M::kPrefix, "memset", "", C::kMemset, "CUPTI memset records"},
    {F::kKernel, M::kContains, "__amd_rocclr_copybuffer", "", C::kMemcpy, "ROCm runtime copy"},
    {F::kKernel, M::kContains, "__amd_rocclr_fillbuffer", "", C::kMemset, "ROCm runtime fill"},
    // --- attention backward (before forward: some backward kernels mention the forward)
    {F::kKernel, M::kContains, "flash_bwd", "", C::kAttentionBwd, "FlashAttention 2/3 backward"},
    {F::kKernel, M::kContains, "sdpa", "bprop", C::kAttentionBwd, "cuDNN SDPA backward"},
    {F::kKernel, M::kContains, "cudnn::fusion::compute_dot_do_o", "", C::kAttentionBwd,
     "cuDNN SDPA backward (dO.O)"},
    {F::kKernel, M::kContains, "cudnn::fusion::convert_dq", "", C::kAttentionBwd,
     "cuDNN SDPA backward (dQ)"},
    {F::kKernel, M::kContains, "cudnn::fusion::fmha_reduce_head", "", C::kAttentionBwd,
     "cuDNN SDPA backward (GQA dK/dV)"},
    {F::kKernel, M::kContains, "fmha_bwd", "", C::kAttentionBwd, "CK / aiter attention backward"},
    {F::kKernel, M::kContains, "fmhabwd", "", C::kAttentionBwd, "CK tile attention backward"},
    {F::kKernel, M::kContains, "fmha_cutlassb", "", C::kAttentionBwd,
     "xFormers / mem-efficient backward"},
    {F::kKernel, M::kContains, "efficient_attention_backward", "", C::kAttentionBwd,
     "mem-efficient backward"},
    {F::kKernel, M::kContains, "flex_attention_backward", "", C::kAttentionBwd,
     "torch flex attention backward"},
    {F::kKernel, M::kContains, "attention_backward", "", C::kAttentionBwd,
     "Tessera attention_backward_kernel"},
    {F::kKernel, M::kContains, "attn_bwd", "", C::kAttentionBwd, "Triton attention backward"},
    {F::kKernel, M::kContains, "mha_bwd", "", C::kAttentionBwd, "attention backward"},
    // --- attention forward
    {F::kKernel, M::kContains, "flash_fwd", "", C::kAttentionFwd, "FlashAttention 2/3 forward"},
    {F::kKernel, M::kContains, "sdpa", "fprop", C::kAttentionFwd, "cuDNN SDPA forward"},
    {F::kKernel, M::kContains, "fmha_fwd", "", C::kAttentionFwd, "CK / aiter attention forward"},
    {F::kKernel, M::kContains, "fmhafwd", "", C::kAttentionFwd, "CK tile attention forward"},
    {F::kKernel, M::kContains, "fmha_cutlassf", "", C::kAttentionFwd,
     "xFormers / mem-efficient forward"},
    {F::kKernel, M::kContains, "efficient_attention_forward", "", C::kAttentionFwd,
     "mem-efficient forward"},
    {F::kKernel, M::kContains, "flex_attention", "", C::kAttentionFwd,
     "torch flex attention forward"},
    {F::kKernel, M::kContains, "attention_forward", "", C::kAttentionFwd,
     "Tessera attention_forward_kernel"},
    {F::kKernel, M::kContains, "attn_fwd", "", C::kAttentionFwd, "Triton attention forward"},
    {F::kKernel, M::kContains, "mha_fwd", "", C::kAttentionFwd, "attention forward"},
    // --- GEMM: cuBLAS / cuBLASLt / CUTLASS / Tensile / Triton templates
    {F::kKernel, M::kPrefix, "nvjet", "", C::kGemm, "cuBLASLt (Hopper/Blackwell nvjet_*)"},
    {F::kKernel, M::kContains, "gemm", "", C::kGemm, "cuBLAS/CUTLASS (*gemm*, sm90_xmma_gemm_*)"},
    {F::kKernel, M::kContains, "gemv", "", C::kGemm, "cuBLAS gemv"},
    {F::kKernel, M::kContains, "xmma", "", C::kGemm, "cuBLAS xmma kernels"},
    {F::kKernel, M::kContains, "cutlass", "", C::kGemm, "CUTLASS"},
    {F::kKernel, M::kContains, "splitkreduce", "", C::kGemm, "cuBLAS split-K reduction"},
    {F::kKernel, M::kPrefix, "cijk_", "", C::kGemm, "rocBLAS / hipBLASLt (Tensile Cijk_*)"},
    {F::kKernel, M::kPrefix, "triton_tem_", "", C::kGemm, "torch.compile template (mm/bmm)"},
    {F::kKernel, M::kContains, "matmul", "", C::kGemm, "matmul kernels (Triton, Tessera)"},
    // --- optimizer
    {F::kKernel, M::kContains, "adam", "", C::kOptimizer,
     "fused Adam/AdamW (FusedAdamMathFunctor, adamw_kernel)"},
    {F::kKernel, M::kContains, "sgd", "", C::kOptimizer, "fused SGD"},
    {F::kKernel, M::kContains, "adagrad", "", C::kOptimizer, "Adagrad"},
    // --- normalisation
    {F::kKernel, M::kContains, "rms_norm", "", C::kNormalization,
     "RMSNorm (PyTorch, Triton fusions)"},
    {F::kKernel, M::kContains, "rmsnorm", "", C::kNormalization,
     "RMSNorm (Tessera rmsnorm_*, apex)"},
    {F::kKernel, M::kContains, "layer_norm", "", C::kNormalization, "LayerNorm (PyTorch)"},
    {F::kKernel, M::kContains, "layernorm", "", C::kNormalization, "LayerNorm (apex, MIOpen)"},
    {F::kKernel, M::kContains, "gammabeta", "", C::kNormalization, "LayerNorm weight gradient"},
    {F::kKernel, M::kContains, "batch_norm", "", C::kNormalization, "BatchNorm"},
    {F::kKernel, M::kContains, "batchnorm", "", C::kNormalization, "BatchNorm"},
    {F::kKernel, M::kContains, "group_norm", "", C::kNormalization, "GroupNorm"},
    // --- reductions (softmax and losses reduce along rows)
    {F::kKernel, M::kContains, "softmax", "", C::kReduction, "softmax / log-softmax"},
    {F::kKernel, M::kContains, "nll_loss", "", C::kReduction, "NLL loss"},
    {F::kKernel, M::kContains, "cross_entropy", "", C::kReduction,
     "cross-entropy (Tessera, Triton)"},
    {F::kKernel, M::kContains, "lpnorm", "", C::kReduction, "foreach norm (gradient clipping)"},
    {F::kKernel, M::kContains, "reduce_kernel", "", C::kReduction, "PyTorch reduce_kernel"},
    {F::kKernel, M::kContains, "devicereduce", "", C::kReduction, "CUB device reduce"},
    {F::kKernel, M::kContains, "devicesegmentedreduce", "", C::kReduction, "CUB segmented reduce"},
    {F::kKernel, M::kPrefix, "triton_red_", "", C::kReduction, "torch.compile reduction"},
    {F::kKernel, M::kPrefix, "triton_per_", "", C::kReduction,
     "torch.compile persistent reduction"},
    {F::kKernel, M::kContains, "reduce", "", C::kReduction, "other reductions"},
    {F::kKernel, M::kContains, "sum_partial_kernel", "", C::kReduction,
     "Tessera sum / sum_squares"},
    {F::kKernel, M::kContains, "sum_final_kernel", "", C::kReduction, "Tessera sum / sum_squares"},
    {F::kKernel, M::kContains, "bias_partial_kernel", "", C::kReduction, "Tessera bias gradient"},
    {F::kKernel, M::kContains, "column_sums_accumulate_kernel", "", C::kReduction,
     "Tessera bias gradient"},
    // --- elementwise
    {F::kKernel, M::kContains, "elementwise_kernel", "", C::kElementwise,
     "PyTorch vectorized/unrolled elementwise"},
    {F::kKernel, M::kContains, "multi_tensor_apply", "", C::kElementwise, "PyTorch foreach ops"},
    {F::kKernel, M::kPrefix, "triton_poi_", "", C::kElementwise, "torch.compile pointwise"},
    {F::kKernel, M::kContains, "catarraybatchedcopy", "", C::kElementwise, "torch.cat copies"},
    // CUPTI reports names with their namespaces, so Tessera's rules match anywhere in the name.
    {F::kKernel, M::kContains, "swiglu_", "", C::kElementwise, "Tessera swiglu_*"},
    {F::kKernel, M::kContains, "rope_", "", C::kElementwise, "Tessera rope_*"},
    {F::kKernel, M::kContains, "rotary", "", C::kElementwise, "rotary embedding kernels"},
    {F::kKernel, M::kContains, "silu", "", C::kElementwise, "activation kernels"},
    {F::kKernel, M::kContains, "gelu", "", C::kElementwise, "activation kernels"},
    {F::kKernel, M::kPrefix, "cast_", "", C::kElementwise, "Tessera cast_*"},
    {F::kKernel, M::kContains, "fp8_cast_transpose_kernel", "", C::kElementwise,
     "Tessera FP8 cast (+ transpose)"},
    {F::kKernel, M::kContains, "fp8_block_cast_kernel", "", C::kElementwise,
     "Tessera FP8 block-scaled cast"},
    {F::kKernel, M::kPrefix, "residual_", "", C::kElementwise, "Tessera residual_*"},
    {F::kKernel, M::kPrefix, "fill_", "", C::kElementwise, "Tessera fill_*"},
    {F::kKernel, M::kContains, "::fill_kernel", "", C::kElementwise, "Tessera fill_kernel"},
    {F::kKernel, M::kContains, "::convert_kernel", "", C::kElementwise, "Tessera convert_kernel"},
    {F::kKernel, M::kContains, "::copy_columns_kernel", "", C::kElementwise,
     "Tessera copy_columns_kernel (fused projections' slices, context parallelism's keys)"},
    // --- other known kernels
    {F::kKernel, M::kContains, "embedding", "", C::kOther, "embedding lookup / backward"},
    {F::kKernel, M::kContains, "gather", "", C::kOther, "gather"},
    {F::kKernel, M::kContains, "scatter", "", C::kOther, "scatter"},
    {F::kKernel, M::kContains, "index", "", C::kOther, "indexing (index_select, index_put)"},
    {F::kKernel, M::kContains, "distribution", "", C::kOther, "random number generation"},
    {F::kKernel, M::kContains, "init_normal_kernel", "", C::kOther, "Tessera initialisation"},
    {F::kKernel, M::kContains, "::iota_kernel", "", C::kOther, "Tessera embedding backward"},
    {F::kKernel, M::kContains, "emptykernel", "", C::kOther, "CUB EmptyKernel"},
    {F::kKernel, M::kContains, "sort", "", C::kOther, "sorting (radix sort, topk)"},
    {F::kKernel, M::kContains, "topk", "", C::kOther, "top-k"},
    // --- fallbacks on the launching CPU op when the kernel name is unknown
    {F::kOp, M::kContains, "attention", "backward", C::kAttentionBwd,
     "op aten::*attention*backward"},
    {F::kOp, M::kContains, "attention", "", C::kAttentionFwd, "op aten::*attention*"},
    {F::kOp, M::kPrefix, "aten::mm", "", C::kGemm, "op aten::mm"},
    {F::kOp, M::kContains, "addmm", "", C::kGemm, "op aten::addmm"},
    {F::kOp, M::kContains, "bmm", "", C::kGemm, "op aten::bmm / baddbmm"},
    {F::kOp, M::kContains, "matmul", "", C::kGemm, "op aten::matmul"},
    {F::kOp, M::kContains, "linear", "", C::kGemm, "op aten::linear"},
    {F::kOp, M::kContains, "_scaled_mm", "", C::kGemm, "op aten::_scaled_mm"},
    {F::kOp, M::kContains, "_norm", "", C::kNormalization, "op aten::*_norm"},
    {F::kOp, M::kContains, "adam", "", C::kOptimizer, "op *adam*"},
    {F::kOp, M::kContains, "c10d::", "", C::kCommunication, "op c10d::*"},
    {F::kOp, M::kContains, "record_param_comms", "", C::kCommunication, "op record_param_comms"},
};

constexpr std::string_view kCategoryNames[kNumCategories] = {
    "GEMM",      "attention_fwd", "attention_bwd", "normalization", "elementwise", "reduction",
    "optimizer", "communication", "memcpy",        "memset",        "other",       "unclassified",
};

bool matches(const CategoryRule& rule, std::string_view lower) {
  bool hit = rule.match == M::kPrefix ? lower.starts_with(rule.pattern)
                                      : lower.find(rule.pattern) != std::string_view::npos;
  return hit && (rule.also.empty() || lower.find(rule.also) != std::string_view::npos);
}

std::string to_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// Where a node of the categories file is, for messages: "FILE:LINE".
std::string where(const std::string& path, const YAML::Node& node) {
  const int line = node.Mark().line;
  return line >= 0 ? fmt::format("{}:{}", path, line + 1) : path;
}

std::string text_of(const YAML::Node& node) {
  return node.IsScalar() ? node.Scalar() : YAML::Dump(node);
}

std::string category_choices() {
  std::string out;
  for (int c = 0; c < kNumCategories; ++c) {
    if (static_cast<Category>(c) == C::kUnclassified) continue;
    if (!out.empty()) out += ", ";
    out += kCategoryNames[c];
  }
  return out;
}

// The keys of a mapping, each once (yaml-cpp keeps a repeated key twice and which one counts
// would depend on how the mapping is read), each one of `allowed`.
void check_keys(const std::string& path, const YAML::Node& map, const std::string& prefix,
                std::initializer_list<std::string_view> allowed) {
  std::set<std::string> seen;
  for (const auto& kv : map) {
    const std::string key = text_of(kv.first);
    const std::string full = prefix.empty() ? key : prefix + "." + key;
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      std::string names;
      for (std::string_view a : allowed)
        names += (names.empty() ? "'" : ", '") + std::string(a) + "'";
      throw ConfigError(where(path, kv.first), full, text_of(kv.second), "only the keys " + names);
    }
    if (!seen.insert(key).second) {
      throw ConfigError(where(path, kv.first), full, text_of(kv.second),
                        "each key once; remove the repeated '" + key + "'");
    }
  }
}

UserCategoryRule parse_rule(const std::string& path, const YAML::Node& node, size_t index) {
  const std::string name = fmt::format("rules[{}]", index);
  if (!node.IsMap()) {
    throw ConfigError(where(path, node), name, text_of(node),
                      "a mapping with 'kernel' (a regular expression) and 'category'");
  }
  check_keys(path, node, name, {"kernel", "category"});
  UserCategoryRule rule;
  const YAML::Node kernel = node["kernel"];
  const YAML::Node category = node["category"];
  for (const auto& [key, value] : {std::pair{"kernel", kernel}, std::pair{"category", category}}) {
    if (!value) {
      throw ConfigError(where(path, node), name + "." + key, "(missing)",
                        std::string(key) == "kernel" ? "a regular expression for the kernel name"
                                                     : "a category: one of " + category_choices());
    }
    if (!value.IsScalar() || value.Scalar().empty()) {
      throw ConfigError(where(path, value), name + "." + key, text_of(value), "a non-empty string");
    }
  }
  rule.pattern = kernel.Scalar();
  rule.key = name + ".kernel";
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rule.pattern.data()),
                                   rule.pattern.size(), PCRE2_CASELESS, &error, &offset, nullptr);
  if (code == nullptr) {
    throw ConfigError(where(path, kernel), rule.key, rule.pattern,
                      fmt::format("a regular expression (PCRE2 syntax, as Perl's), but it is not "
                                  "one: {} at offset {}",
                                  pcre2_error_message(error), offset));
  }
  rule.regex = std::make_shared<const CompiledPattern>(code);
  const std::string wanted = to_lower(category.Scalar());
  int found = -1;
  for (int c = 0; c < kNumCategories; ++c) {
    if (static_cast<Category>(c) != C::kUnclassified && to_lower(kCategoryNames[c]) == wanted) {
      found = c;
    }
  }
  if (found < 0) {
    throw ConfigError(where(path, category), name + ".category", category.Scalar(),
                      "one of " + category_choices());
  }
  rule.category = static_cast<Category>(found);
  rule.origin = where(path, node);
  return rule;
}

}  // namespace

std::vector<UserCategoryRule> load_category_rules(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("command line", "categories", path, "a readable file");
  std::stringstream text;
  text << in.rdbuf();
  YAML::Node root;
  try {
    root = YAML::Load(text.str());
  } catch (const YAML::ParserException& e) {
    throw ConfigError(fmt::format("{}:{}", path, e.mark.line + 1), "(syntax)", e.msg,
                      "valid YAML or JSON");
  }
  const std::string expected_root =
      "a mapping with a 'rules' list, e.g. rules: [{kernel: '^my_norm', category: "
      "normalization}]";
  if (!root.IsMap()) {
    throw ConfigError(where(path, root), "(document)", text_of(root).substr(0, 60), expected_root);
  }
  check_keys(path, root, "", {"rules"});
  const YAML::Node rules = root["rules"];
  if (!rules) throw ConfigError(path + ":1", "rules", "(missing)", expected_root);
  if (!rules.IsSequence()) {
    throw ConfigError(where(path, rules), "rules", text_of(rules),
                      "a list of rules (each a mapping with 'kernel' and 'category')");
  }
  // Rule numbers share GpuActivity::rule (int16) with the built-in rules.
  constexpr size_t kMaxRules = 10000;
  if (rules.size() > kMaxRules) {
    throw ConfigError(where(path, rules), "rules", fmt::format("{} rules", rules.size()),
                      fmt::format("at most {} rules", kMaxRules));
  }
  std::vector<UserCategoryRule> out;
  for (size_t i = 0; i < rules.size(); ++i) out.push_back(parse_rule(path, rules[i], i));
  return out;
}

std::string_view category_name(Category c) {
  return kCategoryNames[static_cast<int>(c)];
}

std::span<const CategoryRule> category_rules() {
  return kRules;
}

Classification classify_kernel(std::string_view kernel_name, std::string_view op_name,
                               std::span<const UserCategoryRule> user_rules) {
  const int offset = static_cast<int>(user_rules.size());
  for (int i = 0; i < offset; ++i) {
    const UserCategoryRule& rule = user_rules[i];
    const std::optional<bool> found = rule.regex->search(kernel_name);
    if (!found) {
      const std::string shown = kernel_name.size() > 80
                                    ? std::string(kernel_name.substr(0, 77)) + "..."
                                    : std::string(kernel_name);
      throw ConfigError(rule.origin, rule.key, rule.pattern,
                        fmt::format("a pattern that matches within PCRE2's limits ({} "
                                    "backtracking steps, depth {}), but on kernel '{}' it "
                                    "exceeds them: nested repeats such as (a+)+ backtrack "
                                    "exponentially (write a+)",
                                    kMatchLimit, kDepthLimit, shown));
    }
    if (*found) return {rule.category, i};
  }
  // CUPTI reports demangled names that start with the return type ("void at::native::...").
  std::string name = to_lower(kernel_name);
  std::string_view view = name;
  if (view.starts_with("void ")) view.remove_prefix(5);
  std::string op = to_lower(op_name);
  for (int pass = 0; pass < 2; ++pass) {
    const F field = pass == 0 ? F::kKernel : F::kOp;
    std::string_view subject = pass == 0 ? view : std::string_view(op);
    if (subject.empty()) continue;
    for (size_t i = 0; i < std::size(kRules); ++i) {
      if (kRules[i].field == field && matches(kRules[i], subject)) {
        return {kRules[i].category, offset + static_cast<int>(i)};
      }
    }
  }
  return {};
}

std::string describe_rule(int rule, std::span<const UserCategoryRule> user_rules) {
  if (rule < 0) return "";
  if (rule < static_cast<int>(user_rules.size())) {
    const UserCategoryRule& u = user_rules[rule];
    return fmt::format("{}: kernel matches '{}'", u.origin, u.pattern);
  }
  const CategoryRule& r = kRules[rule - user_rules.size()];
  std::string s = fmt::format("{} {} '{}'", r.field == F::kKernel ? "kernel" : "op",
                              r.match == M::kPrefix ? "starts with" : "contains", r.pattern);
  if (!r.also.empty()) s += fmt::format(" and '{}'", r.also);
  return s;
}

}  // namespace tessera::analysis
