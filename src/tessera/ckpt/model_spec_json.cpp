#include "tessera/ckpt/model_spec_json.h"

#include <string>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera {

namespace {

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

MoeSpec moe_from_json(const nlohmann::json& j, const std::string& file) {
  MoeSpec m;
  m.experts = j.at("num_experts").get<int64_t>();
  m.topk = j.at("moe_router_topk").get<int64_t>();
  m.ffn = j.at("moe_ffn_hidden_size").get<int64_t>();
  m.shared_ffn = j.at("moe_shared_expert_intermediate_size").get<int64_t>();
  for (int v : j.at("moe_layers").get<std::vector<int>>()) m.layers.push_back(v != 0);
  m.load_balancing =
      load_balancing_of(j.at("moe_router_load_balancing_type").get<std::string>(), file);
  m.aux_loss_coeff = j.at("moe_aux_loss_coeff").get<double>();
  m.z_loss_coeff = j.at("moe_z_loss_coeff").get<double>();
  m.sigmoid = j.at("moe_router_score_function").get<std::string>() == "sigmoid";
  m.pre_softmax = j.at("moe_router_pre_softmax").get<bool>();
  m.expert_bias = j.at("moe_router_enable_expert_bias").get<bool>();
  m.bias_update_rate = j.at("moe_router_bias_update_rate").get<double>();
  m.num_groups = j.at("moe_router_num_groups").get<int64_t>();
  m.group_topk = j.at("moe_router_group_topk").get<int64_t>();
  m.topk_scaling = j.at("moe_router_topk_scaling_factor").get<double>();
  // Checkpoints from before token dropping are dropless.
  m.capacity_factor = j.value("moe_expert_capacity_factor", 0.0);
  m.drop_by_position = j.value("moe_token_drop_policy", std::string("probs")) == "position";
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

void mla_from_json(const nlohmann::json& j, ModelSpec& s) {
  MlaSpec& m = s.mla;
  m.enabled = true;
  m.q_lora_rank = j.at("q_lora_rank").get<int64_t>();
  m.kv_lora_rank = j.at("kv_lora_rank").get<int64_t>();
  m.qk_head_dim = j.at("qk_head_dim").get<int64_t>();
  m.rope_dim = j.at("qk_pos_emb_head_dim").get<int64_t>();
  m.v_head_dim = j.at("v_head_dim").get<int64_t>();
  YarnRope& y = s.yarn;
  y.enabled = j.at("rope_type").get<std::string>() == "yarn";
  y.factor = j.at("rotary_scaling_factor").get<double>();
  y.original_max_position_embeddings = j.at("original_max_position_embeddings").get<int64_t>();
  y.beta_fast = j.at("beta_fast").get<double>();
  y.beta_slow = j.at("beta_slow").get<double>();
  y.mscale = j.at("mscale").get<double>();
  y.mscale_all_dim = j.at("mscale_all_dim").get<double>();
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

ModelSpec spec_from_json(const nlohmann::json& j, const std::string& file) {
  ModelSpec s;
  try {
    // Checkpoints written before model families existed hold Llama-family models.
    s.family = j.value("model_family", std::string("llama"));
    s.vocab_size = j.at("vocab_size").get<int64_t>();
    s.num_layers = j.at("num_layers").get<int64_t>();
    s.hidden = j.at("hidden_size").get<int64_t>();
    s.ffn = j.at("ffn_hidden_size").get<int64_t>();
    s.heads = j.at("num_attention_heads").get<int64_t>();
    s.kv_heads = j.at("num_query_groups").get<int64_t>();
    s.head_dim = j.at("kv_channels").get<int64_t>();
    s.max_position_embeddings = j.at("max_position_embeddings").get<int64_t>();
    s.rotary_base = j.at("rotary_base").get<double>();
    s.rope_scaling.enabled = j.at("use_rope_scaling").get<bool>();
    s.rope_scaling.factor = j.at("rope_scaling_factor").get<double>();
    s.rope_scaling.low_freq_factor = j.at("rope_low_freq_factor").get<double>();
    s.rope_scaling.high_freq_factor = j.at("rope_high_freq_factor").get<double>();
    s.rope_scaling.original_max_position_embeddings =
        j.at("rope_original_max_position_embeddings").get<int64_t>();
    s.norm_eps = j.at("norm_epsilon").get<float>();
    s.qkv_bias = j.at("add_qkv_bias").get<bool>();
    s.tied_embeddings = j.at("tied_embeddings").get<bool>();
    s.sliding_window = j.at("sliding_window").get<int64_t>();
    s.qk_norm = j.value("qk_layernorm", false);
    // Checkpoints from before it was recorded: Megatron's default.
    s.init_std = j.value("init_method_std", 0.02f);
    if (j.contains("moe")) s.moe = moe_from_json(j.at("moe"), file);
    if (j.contains("multi_latent_attention")) mla_from_json(j.at("multi_latent_attention"), s);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: the model description is incomplete: {}", file, e.what()));
  }
  if (find_model_family(s.family) == nullptr)
    throw DataError(fmt::format("{}: model_family '{}' is not one this build has ({})", file,
                                s.family, model_family_names()));
  s.tokenizer_vocab = s.vocab_size;
  return s;
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
