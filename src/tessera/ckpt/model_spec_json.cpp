#include "tessera/ckpt/model_spec_json.h"

#include <algorithm>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "tessera/ckpt/json_fields.h"
#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera {

namespace {

// Bounds of the sizes a model description may give: far beyond any model, and small enough
// that a layout built from them cannot overflow its 64-bit offsets.
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // hidden sizes and ranks
constexpr int64_t kMaxCount = int64_t{1} << 16;  // layers, heads, experts, head sizes
constexpr int64_t kMaxRows = int64_t{1} << 24;   // vocabularies and MLP widths
constexpr int64_t kMaxPositions = int64_t{1} << 31;
constexpr double kMaxCoefficient = 1e12;              // factors, rates and coefficients
constexpr double kMaxParameters = 281474976710656.0;  // 2^48

const char* load_balancing_name(MoeLoadBalancing b) {
  switch (b) {
    case MoeLoadBalancing::AuxLoss:
      return "aux_loss";
    case MoeLoadBalancing::SeqAuxLoss:
      return "seq_aux_loss";
    case MoeLoadBalancing::None:
      return "none";
  }
  return "?";
}

MoeLoadBalancing load_balancing_of(const std::string& name, const std::string& file) {
  if (name == "aux_loss") return MoeLoadBalancing::AuxLoss;
  if (name == "seq_aux_loss") return MoeLoadBalancing::SeqAuxLoss;
  if (name == "none") return MoeLoadBalancing::None;
  throw DataError(
      fmt::format("{}: moe_router_load_balancing_type '{}' is not one this build has", file, name));
}

// The MoE part, written only for MoE models (dense checkpoints stay as they were).
nlohmann::json moe_to_json(const MoeSpec& m) {
  std::vector<int> layers;
  for (bool moe : m.layers) layers.push_back(moe ? 1 : 0);
  return {{"num_experts", m.experts},
          {"moe_router_topk", m.topk},
          {"moe_ffn_hidden_size", m.ffn},
          {"moe_shared_expert_intermediate_size", m.shared_ffn},
          {"moe_layers", layers},
          {"moe_router_load_balancing_type", load_balancing_name(m.load_balancing)},
          {"moe_aux_loss_coeff", m.aux_loss_coeff},
          {"moe_z_loss_coeff", m.z_loss_coeff},
          {"moe_router_score_function", m.sigmoid ? "sigmoid" : "softmax"},
          {"moe_router_pre_softmax", m.pre_softmax},
          {"moe_router_enable_expert_bias", m.expert_bias},
          {"moe_router_bias_update_rate", m.bias_update_rate},
          {"moe_router_num_groups", m.num_groups},
          {"moe_router_group_topk", m.group_topk},
          {"moe_router_topk_scaling_factor", m.topk_scaling},
          {"moe_expert_capacity_factor", m.capacity_factor},
          {"moe_token_drop_policy", m.drop_by_position ? "position" : "probs"}};
}

MoeSpec moe_from_json(const JsonFields& j, int64_t num_layers) {
  MoeSpec m;
  m.experts = j.integer("num_experts", 0, kMaxCount);
  m.topk = j.integer("moe_router_topk", 0, m.experts);
  m.ffn = j.integer("moe_ffn_hidden_size", 0, kMaxRows);
  m.shared_ffn = j.integer("moe_shared_expert_intermediate_size", 0, kMaxRows);
  const nlohmann::json& layers = j.array("moe_layers");
  if (static_cast<int64_t>(layers.size()) != num_layers)
    j.fail(j.field("moe_layers"), layers,
           fmt::format("one 0 or 1 per layer ({} entries)", num_layers));
  for (size_t l = 0; l < layers.size(); ++l)
    m.layers.push_back(
        j.integer_value(layers[l], fmt::format("{}[{}]", j.field("moe_layers"), l), 0, 1) != 0);
  m.load_balancing = load_balancing_of(j.string("moe_router_load_balancing_type"), j.file());
  m.aux_loss_coeff = j.number("moe_aux_loss_coeff", 0, kMaxCoefficient);
  m.z_loss_coeff = j.number("moe_z_loss_coeff", 0, kMaxCoefficient);
  m.sigmoid = j.string("moe_router_score_function") == "sigmoid";
  m.pre_softmax = j.boolean("moe_router_pre_softmax");
  m.expert_bias = j.boolean("moe_router_enable_expert_bias");
  m.bias_update_rate = j.number("moe_router_bias_update_rate", 0, kMaxCoefficient);
  m.num_groups = j.integer("moe_router_num_groups", 0, std::max<int64_t>(m.experts, 0));
  m.group_topk = j.integer("moe_router_group_topk", 0, std::max<int64_t>(m.num_groups, 0));
  m.topk_scaling = j.number("moe_router_topk_scaling_factor", 0, kMaxCoefficient);
  // Checkpoints from before token dropping are dropless.
  m.capacity_factor = j.number_or("moe_expert_capacity_factor", 0.0, 0, kMaxCoefficient);
  m.drop_by_position = j.string_or("moe_token_drop_policy", "probs") == "position";
  return m;
}

// Multi-latent attention and its YaRN RoPE, written only for MLA models.
nlohmann::json mla_to_json(const ModelSpec& s) {
  const MlaSpec& m = s.mla;
  const YarnRope& y = s.yarn;
  return {{"q_lora_rank", m.q_lora_rank},
          {"kv_lora_rank", m.kv_lora_rank},
          {"qk_head_dim", m.qk_head_dim},
          {"qk_pos_emb_head_dim", m.rope_dim},
          {"v_head_dim", m.v_head_dim},
          {"rope_type", y.enabled ? "yarn" : "rope"},
          {"rotary_scaling_factor", y.factor},
          {"original_max_position_embeddings", y.original_max_position_embeddings},
          {"beta_fast", y.beta_fast},
          {"beta_slow", y.beta_slow},
          {"mscale", y.mscale},
          {"mscale_all_dim", y.mscale_all_dim}};
}

void mla_from_json(const JsonFields& j, ModelSpec& s) {
  MlaSpec& m = s.mla;
  m.enabled = true;
  m.q_lora_rank = j.integer("q_lora_rank", 0, kMaxWidth);
  m.kv_lora_rank = j.integer("kv_lora_rank", 0, kMaxWidth);
  m.qk_head_dim = j.integer("qk_head_dim", 0, kMaxCount);
  m.rope_dim = j.integer("qk_pos_emb_head_dim", 0, kMaxCount);
  m.v_head_dim = j.integer("v_head_dim", 0, kMaxCount);
  YarnRope& y = s.yarn;
  y.enabled = j.string("rope_type") == "yarn";
  y.factor = j.number("rotary_scaling_factor", 0, kMaxCoefficient);
  y.original_max_position_embeddings =
      j.integer("original_max_position_embeddings", 0, kMaxPositions);
  y.beta_fast = j.number("beta_fast", 0, kMaxCoefficient);
  y.beta_slow = j.number("beta_slow", 0, kMaxCoefficient);
  y.mscale = j.number("mscale", 0, kMaxCoefficient);
  y.mscale_all_dim = j.number("mscale_all_dim", 0, kMaxCoefficient);
}

// What the model's blocks assume of a spec (and check as internal errors), for a description
// read from a file: grouped-query heads, multi-latent attention's dimensions, the routing.
void require_consistent_shapes(const ModelSpec& s, const std::string& file) {
  auto refuse = [&](const std::string& what) {
    throw DataError(fmt::format("{}: the model description is inconsistent: {}", file, what));
  };
  if (s.heads % s.kv_heads != 0)
    refuse(fmt::format("num_attention_heads {} is not a multiple of num_query_groups {}", s.heads,
                       s.kv_heads));
  if (const std::string problem = model_family(s.family).spec_problem(s); !problem.empty())
    refuse(problem);
  const MlaSpec& m = s.mla;
  if (m.enabled && (m.kv_lora_rank < 1 || m.rope_dim < 2 || m.rope_dim % 2 != 0 ||
                    m.qk_head_dim < 1 || m.v_head_dim < 1 || s.head_dim != m.rope_dim))
    refuse(
        fmt::format("multi-latent attention needs a positive kv_lora_rank ({}), qk_head_dim "
                    "({}) and v_head_dim ({}), and an even qk_pos_emb_head_dim ({}) equal to "
                    "kv_channels ({})",
                    m.kv_lora_rank, m.qk_head_dim, m.v_head_dim, m.rope_dim, s.head_dim));
  const MoeSpec& e = s.moe;
  if (e.enabled() && (e.topk < 1 || e.ffn < 1 ||
                      (e.num_groups > 0 && (e.experts % e.num_groups != 0 || e.group_topk < 1))))
    refuse(
        fmt::format("{} experts need moe_router_topk of at least 1 ({}), a positive "
                    "moe_ffn_hidden_size ({}) and groups that divide them ({} groups, {} "
                    "chosen)",
                    e.experts, e.topk, e.ffn, e.num_groups, e.group_topk));
}

}  // namespace

nlohmann::json spec_to_json(const ModelSpec& s) {
  nlohmann::json j = {
      {"model_family", s.family},
      {"vocab_size", s.vocab_size},
      {"num_layers", s.num_layers},
      {"hidden_size", s.hidden},
      {"ffn_hidden_size", s.ffn},
      {"num_attention_heads", s.heads},
      {"num_query_groups", s.kv_heads},
      {"kv_channels", s.head_dim},
      {"max_position_embeddings", s.max_position_embeddings},
      {"rotary_base", s.rotary_base},
      {"use_rope_scaling", s.rope_scaling.enabled},
      {"rope_scaling_factor", s.rope_scaling.factor},
      {"rope_low_freq_factor", s.rope_scaling.low_freq_factor},
      {"rope_high_freq_factor", s.rope_scaling.high_freq_factor},
      {"rope_original_max_position_embeddings", s.rope_scaling.original_max_position_embeddings},
      // The shortest decimal that reads back as the same float: 1e-05, not 9.99999974e-06.
      {"norm_epsilon", std::stod(fmt::format("{}", s.norm_eps))},
      {"add_qkv_bias", s.qkv_bias},
      {"tied_embeddings", s.tied_embeddings},
      {"sliding_window", s.sliding_window},
      // The run's init_method_std, for the exported config's initializer_range.
      {"init_method_std", std::stod(fmt::format("{}", s.init_std))}};
  if (s.qk_norm) j["qk_layernorm"] = true;
  if (s.moe.enabled()) j["moe"] = moe_to_json(s.moe);
  if (s.mla.enabled) j["multi_latent_attention"] = mla_to_json(s);
  return j;
}

ModelSpec spec_from_json(const nlohmann::json& json, const std::string& file) {
  const JsonFields j(json, file, "model.");
  ModelSpec s;
  // Checkpoints written before model families existed hold Llama-family models.
  s.family = j.string_or("model_family", "llama");
  s.vocab_size = j.integer("vocab_size", 1, kMaxRows);
  s.num_layers = j.integer("num_layers", 1, kMaxCount);
  s.hidden = j.integer("hidden_size", 1, kMaxWidth);
  s.ffn = j.integer("ffn_hidden_size", 0, kMaxRows);
  s.heads = j.integer("num_attention_heads", 1, kMaxCount);
  s.kv_heads = j.integer("num_query_groups", 1, s.heads);
  s.head_dim = j.integer("kv_channels", 1, kMaxCount);
  s.max_position_embeddings = j.integer("max_position_embeddings", 1, kMaxPositions);
  s.rotary_base = j.number("rotary_base", 0, std::numeric_limits<double>::max());
  s.rope_scaling.enabled = j.boolean("use_rope_scaling");
  s.rope_scaling.factor = j.number("rope_scaling_factor", 0, kMaxCoefficient);
  s.rope_scaling.low_freq_factor = j.number("rope_low_freq_factor", 0, kMaxCoefficient);
  s.rope_scaling.high_freq_factor = j.number("rope_high_freq_factor", 0, kMaxCoefficient);
  s.rope_scaling.original_max_position_embeddings =
      j.integer("rope_original_max_position_embeddings", 0, kMaxPositions);
  s.norm_eps = static_cast<float>(j.number("norm_epsilon", 0, 1));
  s.qkv_bias = j.boolean("add_qkv_bias");
  s.tied_embeddings = j.boolean("tied_embeddings");
  s.sliding_window = j.integer("sliding_window", 0, kMaxPositions);
  s.qk_norm = j.boolean_or("qk_layernorm", false);
  // Checkpoints from before it was recorded: Megatron's default.
  s.init_std = static_cast<float>(j.number_or("init_method_std", 0.02, 0, 1));
  if (j.has("moe")) s.moe = moe_from_json(j.object("moe"), s.num_layers);
  if (j.has("multi_latent_attention")) mla_from_json(j.object("multi_latent_attention"), s);
  if (find_model_family(s.family) == nullptr)
    throw DataError(fmt::format("{}: model_family '{}' is not one this build has ({})", file,
                                s.family, model_family_names()));
  require_model_size(s, file);
  require_consistent_shapes(s, file);
  s.tokenizer_vocab = s.vocab_size;
  return s;
}

void require_model_size(const ModelSpec& s, const std::string& file) {
  // An upper bound of the parameters, in floating point so that no size can overflow it.
  const double hidden = static_cast<double>(s.hidden);
  const double head = static_cast<double>(std::max({s.head_dim, s.mla.qk_dim(), s.mla.v_head_dim}));
  const double attention =
      hidden * static_cast<double>(2 * s.heads + 2 * s.kv_heads) * head +
      hidden * static_cast<double>(s.mla.q_lora_rank + s.mla.kv_lora_rank + s.mla.rope_dim) +
      static_cast<double>(s.mla.q_lora_rank + s.mla.kv_lora_rank) * static_cast<double>(s.heads) *
          2 * head;
  const double mlp =
      3 * hidden * static_cast<double>(s.ffn + s.moe.shared_ffn) +
      static_cast<double>(s.moe.experts) * hidden * (3 * static_cast<double>(s.moe.ffn) + 1);
  const double params = static_cast<double>(s.num_layers) * (attention + mlp + 4 * hidden) +
                        2 * static_cast<double>(s.vocab_size) * hidden;
  if (params > kMaxParameters)
    throw DataError(fmt::format(
        "{}: describes a model of about {:.3g} parameters ({} layers, hidden {}, MLP {}, {} "
        "experts of {}, vocabulary {}); expected at most 2^48 (a damaged file?)",
        file, params, s.num_layers, s.hidden, s.ffn, s.moe.experts, s.moe.ffn, s.vocab_size));
}

SpecDifferences compare_specs(const ModelSpec& f, const ModelSpec& c, const std::string& label) {
  SpecDifferences d;
  auto check = [&](std::vector<std::string>& out, const char* key, const auto& found,
                   const auto& configured) {
    if (found != configured)
      out.push_back(fmt::format("{}: {} in {}, {} configured", key, found, label, configured));
  };
  check(d.shape, "model_family", f.family, c.family);
  check(d.shape, "vocab_size (padded)", f.vocab_size, c.vocab_size);
  check(d.shape, "num_layers", f.num_layers, c.num_layers);
  check(d.shape, "hidden_size", f.hidden, c.hidden);
  check(d.shape, "ffn_hidden_size", f.ffn, c.ffn);
  check(d.shape, "num_attention_heads", f.heads, c.heads);
  check(d.shape, "num_query_groups", f.kv_heads, c.kv_heads);
  check(d.shape, "kv_channels", f.head_dim, c.head_dim);
  check(d.shape, "add_qkv_bias", f.qkv_bias, c.qkv_bias);
  check(d.shape, "untie_embeddings_and_output_weights", !f.tied_embeddings, !c.tied_embeddings);
  check(d.shape, "qk_layernorm", f.qk_norm, c.qk_norm);
  check(d.shape, "num_experts", f.moe.experts, c.moe.experts);
  if (f.moe.enabled() && c.moe.enabled()) {
    check(d.shape, "moe_ffn_hidden_size", f.moe.ffn, c.moe.ffn);
    check(d.shape, "moe_shared_expert_intermediate_size", f.moe.shared_ffn, c.moe.shared_ffn);
    check(d.shape, "moe_layer_freq (MoE layers)", f.moe.moe_layers(), c.moe.moe_layers());
    if (f.moe.layers != c.moe.layers && f.moe.moe_layers() == c.moe.moe_layers())
      d.shape.push_back(
          fmt::format("moe_layer_freq: other MoE layers in {} than configured", label));
    check(d.behaviour, "moe_router_topk", f.moe.topk, c.moe.topk);
    check(d.behaviour, "moe_router_score_function (sigmoid)", f.moe.sigmoid, c.moe.sigmoid);
    check(d.behaviour, "moe_router_pre_softmax", f.moe.pre_softmax, c.moe.pre_softmax);
  }
  check(d.shape, "multi_latent_attention", f.mla.enabled, c.mla.enabled);
  if (f.mla.enabled && c.mla.enabled) {
    check(d.shape, "q_lora_rank", f.mla.q_lora_rank, c.mla.q_lora_rank);
    check(d.shape, "kv_lora_rank", f.mla.kv_lora_rank, c.mla.kv_lora_rank);
    check(d.shape, "qk_head_dim", f.mla.qk_head_dim, c.mla.qk_head_dim);
    check(d.shape, "qk_pos_emb_head_dim", f.mla.rope_dim, c.mla.rope_dim);
    check(d.shape, "v_head_dim", f.mla.v_head_dim, c.mla.v_head_dim);
  }
  check(d.behaviour, "rope_type (yarn)", f.yarn.enabled, c.yarn.enabled);
  if (f.yarn.enabled && c.yarn.enabled) {
    check(d.behaviour, "rotary_scaling_factor", f.yarn.factor, c.yarn.factor);
    check(d.behaviour, "original_max_position_embeddings", f.yarn.original_max_position_embeddings,
          c.yarn.original_max_position_embeddings);
    check(d.behaviour, "beta_fast", f.yarn.beta_fast, c.yarn.beta_fast);
    check(d.behaviour, "beta_slow", f.yarn.beta_slow, c.yarn.beta_slow);
    check(d.behaviour, "mscale", f.yarn.mscale, c.yarn.mscale);
    check(d.behaviour, "mscale_all_dim", f.yarn.mscale_all_dim, c.yarn.mscale_all_dim);
  }
  check(d.behaviour, "rotary_base", f.rotary_base, c.rotary_base);
  check(d.behaviour, "norm_epsilon", f.norm_eps, c.norm_eps);
  check(d.behaviour, "sliding_window", f.sliding_window, c.sliding_window);
  check(d.behaviour, "use_rope_scaling", f.rope_scaling.enabled, c.rope_scaling.enabled);
  if (f.rope_scaling.enabled && c.rope_scaling.enabled) {
    check(d.behaviour, "rope_scaling_factor", f.rope_scaling.factor, c.rope_scaling.factor);
    check(d.behaviour, "rope_low_freq_factor", f.rope_scaling.low_freq_factor,
          c.rope_scaling.low_freq_factor);
    check(d.behaviour, "rope_high_freq_factor", f.rope_scaling.high_freq_factor,
          c.rope_scaling.high_freq_factor);
    check(d.behaviour, "rope_original_max_position_embeddings",
          f.rope_scaling.original_max_position_embeddings,
          c.rope_scaling.original_max_position_embeddings);
  }
  return d;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += (out.empty() ? "" : "; ") + l;
  return out;
}

}  // namespace tessera
