// The DeepSeek family's Hugging Face side: config.json of deepseek_v3 models (transformers'
// DeepseekV3Config: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
// n_routed_experts, n_shared_experts, num_experts_per_tok, n_group, topk_group,
// routed_scaling_factor, norm_topk_prob, first_k_dense_replace, rope_scaling / rope_parameters
// of type yarn) and of deepseek_v2 models (DeepseekV2Config: the same keys with other
// defaults, softmax routing chosen by topk_method) <-> ModelSpec, and each parameter's tensors
// (modeling_deepseek_v3's and modeling_deepseek_v2's names, which are the same).
//
// Tessera's q_kv_a_proj stacks q_a_proj (or q_proj without q_lora_rank) and kv_a_proj_with_mqa;
// the experts are stacked as in the other MoE families (moe_hf.cpp, Qwen3-MoE's names), and the
// shared experts' one SwiGLU of moe_intermediate_size x n_shared_experts is mlp.shared_experts.
// RoPE needs no permutation: Tessera's MLA rotates the interleaved pairs as
// apply_rotary_pos_emb_interleave (V3, rope_interleave true) and V2's complex rotation do.
// V3's mlp.gate.e_score_correction_bias is the MoE block's expert bias (hf_state).
#include <cmath>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/families/deepseek.h"
#include "tessera/model/families/moe.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The cos/sin factor transformers' _compute_yarn_parameters applies: the mscale ratio when both
// mscale and mscale_all_dim are set (non-zero), else mscale(factor, 1).
double hf_yarn_table_scale(const YarnRope& y) {
  if (y.mscale != 0.0 && y.mscale_all_dim != 0.0)
    return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
  return yarn_mscale(y.factor, 1.0);
}

// DeepseekV3TopkRouter scores a group by the sum of its two best experts; Megatron's
// group-limited routing (Tessera's) by the sum of its best topk / group_topk.
constexpr int64_t kHfGroupScoreExperts = 2;

// DeepseekV3TopkRouter: sigmoid scores plus e_score_correction_bias for choosing, the chosen
// sigmoids renormalised (norm_topk_prob) and scaled by routed_scaling_factor.
void read_v3_routing(const nlohmann::json& j, const std::string& file, MoeSpec* moe) {
  auto unsupported = [&](const std::string& what) {
    return DataError(
        fmt::format("{}: {} is not supported by Tessera's deepseek_v3 model", file, what));
  };
  auto count = [&](const char* key, int64_t fallback) {
    return j.contains(key) && !j[key].is_null() ? j[key].get<int64_t>() : fallback;
  };
  moe->sigmoid = true;
  moe->expert_bias = true;
  moe->topk_scaling = j.value("routed_scaling_factor", 2.5);
  const bool norm = j.value("norm_topk_prob", true);
  if (norm != (moe->topk > 1))
    throw unsupported(fmt::format(
        "norm_topk_prob {} with {} experts per token (Tessera renormalises sigmoid weights "
        "exactly when there are several)",
        norm, moe->topk));
  const int64_t groups = count("n_group", 8), group_topk = count("topk_group", 4);
  if (groups > 1) {
    if (group_topk < 1 || moe->topk != kHfGroupScoreExperts * group_topk)
      throw unsupported(fmt::format(
          "group-limited routing with num_experts_per_tok {} and topk_group {} (Tessera "
          "scores a group by its top num_experts_per_tok / topk_group experts, "
          "transformers by its top {}: they agree when num_experts_per_tok = {} x "
          "topk_group)",
          moe->topk, group_topk, kHfGroupScoreExperts, kHfGroupScoreExperts));
    moe->num_groups = groups;
    moe->group_topk = group_topk;
  }
}

// DeepseekV2Moe: a softmax over all experts, the top num_experts_per_tok (topk_method greedy,
// or group_limited_greedy: within the topk_group groups whose best expert scores highest),
// their softmax weights scaled by routed_scaling_factor and not renormalised: Tessera's
// pre-softmax routing. DeepSeek's own V2 code reads scoring_func, norm_topk_prob and
// moe_layer_freq, which transformers ignores: values on which the two disagree are refused.
void read_v2_routing(const nlohmann::json& j, const std::string& file, MoeSpec* moe) {
  auto value = [&](const char* key) {
    return !j.contains(key)     ? std::string("(absent)")
           : j[key].is_string() ? j[key].get<std::string>()
                                : j[key].dump();
  };
  auto refuse = [&](const char* key, const std::string& expected) {
    return ConfigError(file, key, value(key), expected + " for Tessera's deepseek_v2 model");
  };
  if (j.contains("scoring_func") && j["scoring_func"] != "softmax")
    throw refuse("scoring_func", "\"softmax\" (DeepseekV2Moe scores experts with a softmax)");
  if (j.contains("moe_layer_freq") && j["moe_layer_freq"] != 1)
    throw refuse("moe_layer_freq",
                 "1 (transformers makes every layer from first_k_dense_replace on an MoE layer)");
  if (moe->topk > 1 && j.value("norm_topk_prob", false))
    throw refuse("norm_topk_prob",
                 "false (transformers' DeepseekV2Moe does not renormalise the chosen weights, "
                 "DeepSeek's own code does: the two disagree)");
  moe->pre_softmax = true;
  const double scaling =
      j.contains("routed_scaling_factor") && !j["routed_scaling_factor"].is_null()
          ? j["routed_scaling_factor"].get<double>()
          : 1.0;
  moe->topk_scaling = scaling == 1.0 ? 0.0 : scaling;  // 0: unscaled
  // Absent: DeepseekV2Config's default; null or another method: no routing Tessera has.
  const std::string method = !j.contains("topk_method")     ? "greedy"
                             : j["topk_method"].is_string() ? j["topk_method"].get<std::string>()
                                                            : "";
  if (method == "greedy") return;
  if (method != "group_limited_greedy")
    throw refuse("topk_method", "\"greedy\" or \"group_limited_greedy\"");
  const int64_t groups =
      j.contains("n_group") && j["n_group"].is_number_integer() ? j["n_group"].get<int64_t>() : 0;
  if (groups < 1) throw refuse("n_group", "a number of expert groups with group_limited_greedy");
  const int64_t group_topk = j.contains("topk_group") && j["topk_group"].is_number_integer()
                                 ? j["topk_group"].get<int64_t>()
                                 : 0;
  // transformers scores a group by its best expert, Tessera by the sum of its best
  // topk / group_topk: the same when each kept group supplies one.
  if (group_topk != moe->topk)
    throw refuse("topk_group",
                 fmt::format("num_experts_per_tok ({}) with group_limited_greedy (DeepseekV2Moe "
                             "scores a group by its best expert, Tessera by the sum of its best "
                             "num_experts_per_tok / topk_group)",
                             moe->topk));
  if (groups == 1) return;  // one group holds every expert: greedy
  moe->num_groups = groups;
  moe->group_topk = group_topk;
}

}  // namespace

ModelSpec DeepseekFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  const bool v2 = j.value("model_type", std::string()) == "deepseek_v2";
  const char* model_type = v2 ? "deepseek_v2" : "deepseek_v3";
  auto unsupported = [&](const std::string& what) {
    return DataError(
        fmt::format("{}: {} is not supported by Tessera's {} model", file, what, model_type));
  };
  // A DeepseekV2Config key whose value Tessera cannot run as transformers does.
  auto refuse = [&](const char* key, const std::string& expected) {
    return ConfigError(file, key, j.contains(key) ? j[key].dump() : "(absent)",
                       expected + " for Tessera's deepseek_v2 model");
  };
  ModelSpec s;
  try {
    auto required = [&](const char* key) {
      if (!has(key)) throw DataError(fmt::format("{}: field '{}' is missing", file, key));
      return j[key].get<int64_t>();
    };
    // Defaults are those of transformers' DeepseekV3Config / DeepseekV2Config for a missing
    // field.
    auto count = [&](const char* key, int64_t v3_default, int64_t v2_default) {
      return has(key) ? j[key].get<int64_t>() : v2 ? v2_default : v3_default;
    };
    s.hidden = required("hidden_size");
    s.num_layers = required("num_hidden_layers");
    s.heads = required("num_attention_heads");
    s.vocab_size = required("vocab_size");
    if (count("num_key_value_heads", s.heads, s.heads) != s.heads)
      throw unsupported(fmt::format("num_key_value_heads {} other than num_attention_heads {}",
                                    j["num_key_value_heads"].get<int64_t>(), s.heads));
    s.kv_heads = s.heads;
    MlaSpec& m = s.mla;
    m.enabled = true;
    m.q_lora_rank = j.contains("q_lora_rank")
                        ? (j["q_lora_rank"].is_null() ? 0 : j["q_lora_rank"].get<int64_t>())
                        : 1536;
    m.kv_lora_rank = count("kv_lora_rank", 512, 512);
    m.qk_head_dim = count("qk_nope_head_dim", 128, 128);
    m.rope_dim = count("qk_rope_head_dim", 64, 64);
    m.v_head_dim = count("v_head_dim", 128, 128);
    s.head_dim = m.rope_dim;
    s.ffn = count("intermediate_size", 18432, 11008);
    s.max_position_embeddings = count("max_position_embeddings", 4096, 2048);
    s.norm_eps = static_cast<float>(j.value("rms_norm_eps", 1e-6));
    s.tied_embeddings = j.value("tie_word_embeddings", false);
    s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw unsupported(
          fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
    if (j.value("attention_bias", false)) throw unsupported("attention_bias: true");
    if (v2 && j.value("mlp_bias", false)) throw refuse("mlp_bias", "false (no MLP biases)");
    // DeepseekV2Attention always rotates interleaved pairs (view_as_complex); V3 says so.
    if (!v2 && !j.value("rope_interleave", true))
      throw unsupported("rope_interleave: false (Tessera's MLA rotates interleaved pairs)");
    const HfRope hf_rope = read_hf_rope(j, 10000.0);
    const nlohmann::json& rope = hf_rope.params;
    const std::string& rope_type = hf_rope.type;
    s.rotary_base = hf_rope.theta;
    if (rope_type == "yarn") {
      YarnRope& y = s.yarn;
      y.enabled = true;
      y.original_max_position_embeddings =
          rope.contains("original_max_position_embeddings") &&
                  !rope["original_max_position_embeddings"].is_null()
              ? rope["original_max_position_embeddings"].get<int64_t>()
              : s.max_position_embeddings;
      y.factor = rope.contains("factor") && !rope["factor"].is_null()
                     ? rope["factor"].get<double>()
                     : static_cast<double>(s.max_position_embeddings) /
                           static_cast<double>(y.original_max_position_embeddings);
      auto number = [&](const char* key, double fallback) {
        return rope.contains(key) && !rope[key].is_null() ? rope[key].get<double>() : fallback;
      };
      y.beta_fast = number("beta_fast", 32.0);
      y.beta_slow = number("beta_slow", 1.0);
      const double mscale = number("mscale", 0.0), all_dim = number("mscale_all_dim", 0.0);
      // transformers multiplies cos/sin by mscale(factor, mscale) / mscale(factor,
      // mscale_all_dim) only when both are set, else by mscale(factor, 1); the softmax takes
      // mscale_all_dim in either case. Tessera's table factor is always the ratio, which
      // mscale 1 and mscale_all_dim 0 make mscale(factor, 1).
      if (mscale == 0.0 && all_dim != 0.0)
        throw unsupported(fmt::format("YaRN mscale_all_dim {} without mscale", all_dim));
      y.mscale = all_dim != 0.0 ? mscale : 1.0;
      y.mscale_all_dim = all_dim;
      if (rope.contains("attention_factor") && !rope["attention_factor"].is_null() &&
          std::abs(rope["attention_factor"].get<double>() - yarn_table_scale(y)) > 1e-12)
        throw unsupported("a YaRN attention_factor other than DeepSeek's mscale ratio");
    } else if (rope_type != "default") {
      throw unsupported(fmt::format("RoPE type '{}' (expected default or yarn)", rope_type));
    }
    MoeSpec& moe = s.moe;
    const int64_t experts = count("n_routed_experts", 256, 64);
    if (experts > 0) {
      moe.experts = experts;
      // DeepseekV2Config has no default: None, which its MoE layers cannot run with.
      moe.topk = v2 ? required("num_experts_per_tok") : count("num_experts_per_tok", 8, 0);
      moe.ffn = count("moe_intermediate_size", 2048, 1407);
      const int64_t shared = count("n_shared_experts", 1, 2);
      if (v2 && shared < 1)
        throw refuse("n_shared_experts",
                     "at least 1 (DeepseekV2Moe always adds its shared experts' output)");
      moe.shared_ffn = shared * moe.ffn;
      const int64_t first_dense = count("first_k_dense_replace", 3, 0);
      for (int64_t l = 0; l < s.num_layers; ++l) moe.layers.push_back(l >= first_dense);
      moe.load_balancing = MoeLoadBalancing::SeqAuxLoss;
      if (v2)
        read_v2_routing(j, file, &moe);
      else
        read_v3_routing(j, file, &moe);
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: {}", file, e.what()));
  }
  const MlaSpec& m = s.mla;
  if (s.hidden <= 0 || s.heads <= 0 || s.num_layers <= 0 || s.vocab_size <= 0 ||
      m.kv_lora_rank <= 0 || m.q_lora_rank < 0 || m.qk_head_dim <= 0 || m.rope_dim <= 0 ||
      m.rope_dim % 2 != 0 || m.v_head_dim <= 0 || s.ffn <= 0 ||
      (s.moe.enabled() &&
       (s.moe.topk <= 0 || s.moe.topk > s.moe.experts || s.moe.ffn <= 0 || s.moe.shared_ffn < 0 ||
        (s.moe.num_groups > 0 &&
         (s.moe.experts % s.moe.num_groups != 0 || s.moe.group_topk > s.moe.num_groups ||
          s.moe.topk > s.moe.group_topk * (s.moe.experts / s.moe.num_groups))))))
    throw DataError(fmt::format(
        "{}: inconsistent sizes (hidden_size {}, num_attention_heads {}, num_hidden_layers {}, "
        "vocab_size {}, kv_lora_rank {}, q_lora_rank {}, qk_nope_head_dim {}, qk_rope_head_dim "
        "{} (even), v_head_dim {}, intermediate_size {}, experts {} top-{} of width {} in {} "
        "groups choosing {})",
        file, s.hidden, s.heads, s.num_layers, s.vocab_size, m.kv_lora_rank, m.q_lora_rank,
        m.qk_head_dim, m.rope_dim, m.v_head_dim, s.ffn, s.moe.experts, s.moe.topk, s.moe.ffn,
        s.moe.num_groups, s.moe.group_topk));
  s.tokenizer_vocab = s.vocab_size;
  return s;
}

// What DeepseekV3ForCausalLM (sigmoid routing: V3's router has no softmax) and
// DeepseekV2ForCausalLM (softmax routing) can hold: multi-latent attention, dense layers first,
// shared experts a multiple of the routed width, the group scores transformers computes, and a
// YaRN table transformers reproduces. A dense model is a DeepseekV3ForCausalLM.
std::string DeepseekFamily::hf_model_type(const ModelSpec& s) const {
  const MoeSpec& m = s.moe;
  const bool v2 = m.enabled() && !m.sigmoid;
  const char* architecture = v2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM";
  auto refuse = [&](const std::string& what) {
    return DataError(fmt::format("{} (deepseek) cannot hold {}", architecture, what));
  };
  if (!s.mla.enabled) throw refuse("GQA attention");
  if (s.sliding_window > 0) throw refuse("a sliding window");
  if (s.yarn.enabled && std::abs(hf_yarn_table_scale(s.yarn) - yarn_table_scale(s.yarn)) > 1e-12)
    throw refuse(
        fmt::format("YaRN mscale {} with mscale_all_dim {} (transformers scales cos and "
                    "sin by the mscale ratio only when both are non-zero)",
                    s.yarn.mscale, s.yarn.mscale_all_dim));
  if (!m.enabled()) return "deepseek_v3";
  if (m.shared_ffn % m.ffn != 0)
    throw refuse(fmt::format("a shared expert of width {} (a multiple of the experts' {})",
                             m.shared_ffn, m.ffn));
  int64_t first_moe = 0;
  while (first_moe < s.num_layers && !m.is_moe_layer(first_moe)) ++first_moe;
  for (int64_t l = first_moe; l < s.num_layers; ++l)
    if (!m.is_moe_layer(l))
      throw refuse("a dense layer after an MoE layer (moe_layer_freq: dense layers come first)");
  if (!v2) {
    if (m.num_groups > 0 && m.topk != kHfGroupScoreExperts * m.group_topk)
      throw refuse(
          fmt::format("group-limited routing with top-{} over {} groups (transformers "
                      "scores groups by their top {} experts)",
                      m.topk, m.group_topk, kHfGroupScoreExperts));
    return "deepseek_v3";
  }
  if (!m.pre_softmax)
    throw refuse(
        "softmax weights renormalised over the chosen experts (moe_router_pre_softmax false: "
        "DeepseekV2Moe weights each expert by its softmax over all experts)");
  if (m.shared_ffn == 0)
    throw refuse("MoE layers without a shared expert (DeepseekV2Moe always adds one)");
  if (m.num_groups > 0 && m.topk != m.group_topk)
    throw refuse(
        fmt::format("group-limited routing with top-{} in {} groups (transformers scores a "
                    "group by its best expert: moe_router_group_topk must equal "
                    "moe_router_topk)",
                    m.topk, m.group_topk));
  return "deepseek_v2";
}

nlohmann::ordered_json DeepseekFamily::hf_config(const ModelSpec& s) const {
  const bool v2 = hf_model_type(s) == "deepseek_v2";
  const MlaSpec& a = s.mla;
  const MoeSpec& m = s.moe;
  int64_t first_moe = 0;
  while (first_moe < s.num_layers && !m.is_moe_layer(first_moe)) ++first_moe;
  nlohmann::ordered_json j;
  j["architectures"] = {v2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM"};
  j["model_type"] = v2 ? "deepseek_v2" : "deepseek_v3";
  j["vocab_size"] = s.vocab_size;
  j["hidden_size"] = s.hidden;
  j["intermediate_size"] = s.ffn;
  j["moe_intermediate_size"] = m.enabled() ? m.ffn : s.ffn;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.heads;
  // A dense model: every layer before first_k_dense_replace, a router of one expert unused.
  j["n_shared_experts"] = m.enabled() ? m.shared_ffn / m.ffn : 0;
  j["n_routed_experts"] = m.enabled() ? m.experts : 1;
  j["routed_scaling_factor"] = m.enabled() && m.topk_scaling != 0.0 ? m.topk_scaling : 1.0;
  j["kv_lora_rank"] = a.kv_lora_rank;
  j["q_lora_rank"] =
      a.q_lora_rank > 0 ? nlohmann::ordered_json(a.q_lora_rank) : nlohmann::ordered_json(nullptr);
  j["qk_rope_head_dim"] = a.rope_dim;
  j["v_head_dim"] = a.v_head_dim;
  j["qk_nope_head_dim"] = a.qk_head_dim;
  if (v2) j["topk_method"] = m.num_groups > 0 ? "group_limited_greedy" : "greedy";
  j["n_group"] = m.num_groups > 0 ? m.num_groups : 1;
  j["topk_group"] = m.num_groups > 0 ? m.group_topk : 1;
  j["num_experts_per_tok"] = m.enabled() ? m.topk : 1;
  j["first_k_dense_replace"] = first_moe;
  // V2: what DeepSeek's own code reads too (transformers does not renormalise either way).
  j["norm_topk_prob"] = !v2 && m.enabled() && m.topk > 1;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = s.max_position_embeddings;
  j["initializer_range"] = std::stod(fmt::format("{}", s.init_std));
  j["rms_norm_eps"] = std::stod(fmt::format("{}", s.norm_eps));
  // Both spellings: rope_theta + rope_scaling for transformers 4, rope_parameters for 5.
  nlohmann::ordered_json scaling = nullptr, rope = {{"rope_type", "default"}};
  if (s.yarn.enabled) {
    const YarnRope& y = s.yarn;
    scaling = {{"type", "yarn"},
               {"rope_type", "yarn"},
               {"factor", y.factor},
               {"original_max_position_embeddings", y.original_max_position_embeddings},
               {"beta_fast", y.beta_fast},
               {"beta_slow", y.beta_slow},
               {"mscale", y.mscale},
               {"mscale_all_dim", y.mscale_all_dim}};
    rope = scaling;
    rope.erase("type");
  }
  rope["rope_theta"] = s.rotary_base;
  j["rope_theta"] = s.rotary_base;
  j["rope_scaling"] = scaling;
  j["rope_parameters"] = rope;
  if (!v2) j["rope_interleave"] = true;  // V2 always rotates interleaved pairs
  j["tie_word_embeddings"] = s.tied_embeddings;
  j["attention_bias"] = false;
  if (v2) j["mlp_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  return j;
}

std::vector<HfTensorPiece> DeepseekFamily::hf_pieces(const ParamInfo& p, const ModelSpec& s) const {
  auto base_of = [&](std::string_view tail) {
    return p.name.substr(0, p.name.size() - tail.size());
  };
  if (ends_with(p.name, "self_attn.q_kv_a_proj.weight")) {
    const std::string base = base_of("q_kv_a_proj.weight");
    const int64_t C = p.shape[1], q_rows = p.fused_rows.at(0), kv_rows = p.fused_rows.at(1);
    return {{base + (s.mla.q_lora_rank > 0 ? "q_a_proj.weight" : "q_proj.weight"), 0, {q_rows, C}},
            {base + "kv_a_proj_with_mqa.weight", q_rows * C, {kv_rows, C}}};
  }
  // Tessera's one shared expert is Hugging Face's n_shared_experts fused into one MLP.
  for (std::string_view part : {"gate_up_proj.weight", "down_proj.weight"}) {
    const std::string tail = "mlp.shared_expert." + std::string(part);
    if (!ends_with(p.name, tail)) continue;
    ParamInfo renamed = p;
    renamed.name = base_of(tail) + "mlp.shared_experts." + std::string(part);
    return qwen3_moe_family().hf_pieces(renamed, s);
  }
  // The router (mlp.gate), the experts and everything else as Qwen3-MoE names them.
  return qwen3_moe_family().hf_pieces(p, s);
}

std::vector<HfStateTensor> DeepseekFamily::hf_state(const ModelSpec& s) const {
  std::vector<HfStateTensor> out;
  if (!s.moe.enabled() || !s.moe.sigmoid) return out;  // DeepseekV2Moe has no bias
  // DecoderLayer names a block's state "model.layers.<l>." + MoeMlp::state_name().
  for (int64_t l = 0; l < s.num_layers; ++l)
    if (s.moe.is_moe_layer(l))
      out.push_back({fmt::format("model.layers.{}.mlp.router.expert_bias", l),
                     {fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", l),
                      0,
                      {s.moe.experts}}});
  return out;
}

}  // namespace tessera
