// The DeepSeek family's Hugging Face side: config.json of deepseek_v3 models (transformers'
// DeepseekV3Config: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
// n_routed_experts, n_shared_experts, num_experts_per_tok, n_group, topk_group,
// routed_scaling_factor, norm_topk_prob, first_k_dense_replace, rope_scaling / rope_parameters
// of type yarn) <-> ModelSpec, and each parameter's tensors (modeling_deepseek_v3's names).
//
// Tessera's q_kv_a_proj stacks q_a_proj (or q_proj without q_lora_rank) and kv_a_proj_with_mqa;
// the experts are stacked as in the other MoE families (moe_hf.cpp, Qwen3-MoE's names), and the
// shared experts' one SwiGLU of moe_intermediate_size x n_shared_experts is mlp.shared_experts.
// RoPE needs no permutation: Tessera's MLA rotates the interleaved pairs as
// apply_rotary_pos_emb_interleave does (rope_interleave true, transformers' default).
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

}  // namespace

ModelSpec DeepseekFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto unsupported = [&](const std::string& what) {
    return DataError(
        fmt::format("{}: {} is not supported by Tessera's deepseek_v3 model", file, what));
  };
  ModelSpec s;
  try {
    auto required = [&](const char* key) {
      if (!has(key)) throw DataError(fmt::format("{}: field '{}' is missing", file, key));
      return j[key].get<int64_t>();
    };
    // Defaults are those of transformers' DeepseekV3Config for a missing field.
    auto count = [&](const char* key, int64_t fallback) {
      return has(key) ? j[key].get<int64_t>() : fallback;
    };
    s.hidden = required("hidden_size");
    s.num_layers = required("num_hidden_layers");
    s.heads = required("num_attention_heads");
    s.vocab_size = required("vocab_size");
    if (count("num_key_value_heads", s.heads) != s.heads)
      throw unsupported(fmt::format("num_key_value_heads {} other than num_attention_heads {}",
                                    j["num_key_value_heads"].get<int64_t>(), s.heads));
    s.kv_heads = s.heads;
    MlaSpec& m = s.mla;
    m.enabled = true;
    m.q_lora_rank = j.contains("q_lora_rank")
                        ? (j["q_lora_rank"].is_null() ? 0 : j["q_lora_rank"].get<int64_t>())
                        : 1536;
    m.kv_lora_rank = count("kv_lora_rank", 512);
    m.qk_head_dim = count("qk_nope_head_dim", 128);
    m.rope_dim = count("qk_rope_head_dim", 64);
    m.v_head_dim = count("v_head_dim", 128);
    s.head_dim = m.rope_dim;
    s.ffn = count("intermediate_size", 18432);
    s.max_position_embeddings = count("max_position_embeddings", 4096);
    s.norm_eps = static_cast<float>(j.value("rms_norm_eps", 1e-6));
    s.tied_embeddings = j.value("tie_word_embeddings", false);
    s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw unsupported(
          fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
    if (j.value("attention_bias", false)) throw unsupported("attention_bias: true");
    if (!j.value("rope_interleave", true))
      throw unsupported("rope_interleave: false (Tessera's MLA rotates interleaved pairs)");
    const nlohmann::json none = nlohmann::json::object();
    const nlohmann::json& rope = has("rope_parameters") ? j["rope_parameters"]
                                 : has("rope_scaling")  ? j["rope_scaling"]
                                                        : none;
    s.rotary_base = rope.contains("rope_theta") ? rope["rope_theta"].get<double>()
                    : has("rope_theta")         ? j["rope_theta"].get<double>()
                                                : 10000.0;
    const std::string rope_type =
        rope.value("rope_type", rope.value("type", std::string("default")));
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
    const int64_t experts = count("n_routed_experts", 256);
    if (experts > 0) {
      moe.experts = experts;
      moe.topk = count("num_experts_per_tok", 8);
      moe.ffn = count("moe_intermediate_size", 2048);
      moe.shared_ffn = count("n_shared_experts", 1) * moe.ffn;
      const int64_t first_dense = count("first_k_dense_replace", 3);
      for (int64_t l = 0; l < s.num_layers; ++l) moe.layers.push_back(l >= first_dense);
      // DeepseekV3TopkRouter: sigmoid scores plus e_score_correction_bias for choosing, the
      // chosen sigmoids renormalised (norm_topk_prob) and scaled by routed_scaling_factor.
      moe.sigmoid = true;
      moe.expert_bias = true;
      moe.topk_scaling = j.value("routed_scaling_factor", 2.5);
      const bool norm = j.value("norm_topk_prob", true);
      if (norm != (moe.topk > 1))
        throw unsupported(fmt::format(
            "norm_topk_prob {} with {} experts per token (Tessera renormalises sigmoid weights "
            "exactly when there are several)",
            norm, moe.topk));
      const int64_t groups = count("n_group", 8), group_topk = count("topk_group", 4);
      if (groups > 1) {
        if (group_topk < 1 || moe.topk != kHfGroupScoreExperts * group_topk)
          throw unsupported(fmt::format(
              "group-limited routing with num_experts_per_tok {} and topk_group {} (Tessera "
              "scores a group by its top num_experts_per_tok / topk_group experts, "
              "transformers by its top {}: they agree when num_experts_per_tok = {} x "
              "topk_group)",
              moe.topk, group_topk, kHfGroupScoreExperts, kHfGroupScoreExperts));
        moe.num_groups = groups;
        moe.group_topk = group_topk;
      }
      moe.load_balancing = MoeLoadBalancing::SeqAuxLoss;
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

// What DeepseekV3ForCausalLM can hold: multi-latent attention, and in MoE models sigmoid routing
// (V3's router has no softmax), dense layers first, shared experts a multiple of the routed
// width, the group scores transformers computes, and a YaRN table transformers reproduces.
std::string DeepseekFamily::hf_model_type(const ModelSpec& s) const {
  auto refuse = [&](const std::string& what) {
    return DataError(fmt::format("DeepseekV3ForCausalLM (deepseek) cannot hold {}", what));
  };
  if (!s.mla.enabled) throw refuse("GQA attention");
  if (s.sliding_window > 0) throw refuse("a sliding window");
  if (s.yarn.enabled && std::abs(hf_yarn_table_scale(s.yarn) - yarn_table_scale(s.yarn)) > 1e-12)
    throw refuse(
        fmt::format("YaRN mscale {} with mscale_all_dim {} (transformers scales cos and "
                    "sin by the mscale ratio only when both are non-zero)",
                    s.yarn.mscale, s.yarn.mscale_all_dim));
  const MoeSpec& m = s.moe;
  if (!m.enabled()) return "deepseek_v3";
  if (!m.sigmoid) throw refuse("softmax routing (DeepSeek-V2's; V3 routes with sigmoid scores)");
  if (m.shared_ffn % m.ffn != 0)
    throw refuse(fmt::format("a shared expert of width {} (a multiple of the experts' {})",
                             m.shared_ffn, m.ffn));
  int64_t first_moe = 0;
  while (first_moe < s.num_layers && !m.is_moe_layer(first_moe)) ++first_moe;
  for (int64_t l = first_moe; l < s.num_layers; ++l)
    if (!m.is_moe_layer(l))
      throw refuse("a dense layer after an MoE layer (moe_layer_freq: dense layers come first)");
  if (m.num_groups > 0 && m.topk != kHfGroupScoreExperts * m.group_topk)
    throw refuse(
        fmt::format("group-limited routing with top-{} over {} groups (transformers "
                    "scores groups by their top {} experts)",
                    m.topk, m.group_topk, kHfGroupScoreExperts));
  return "deepseek_v3";
}

nlohmann::ordered_json DeepseekFamily::hf_config(const ModelSpec& s) const {
  hf_model_type(s);
  const MlaSpec& a = s.mla;
  const MoeSpec& m = s.moe;
  int64_t first_moe = 0;
  while (first_moe < s.num_layers && !m.is_moe_layer(first_moe)) ++first_moe;
  nlohmann::ordered_json j;
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = "deepseek_v3";
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
  j["n_group"] = m.num_groups > 0 ? m.num_groups : 1;
  j["topk_group"] = m.num_groups > 0 ? m.group_topk : 1;
  j["num_experts_per_tok"] = m.enabled() ? m.topk : 1;
  j["first_k_dense_replace"] = first_moe;
  j["norm_topk_prob"] = m.enabled() && m.topk > 1;
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
  j["rope_interleave"] = true;
  j["tie_word_embeddings"] = s.tied_embeddings;
  j["attention_bias"] = false;
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

std::vector<HfTensorPiece> DeepseekFamily::hf_zero_state(const ModelSpec& s) const {
  std::vector<HfTensorPiece> out;
  for (int64_t l = 0; l < s.num_layers; ++l)
    if (s.moe.is_moe_layer(l))
      out.push_back(
          {fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", l), 0, {s.moe.experts}});
  return out;
}

}  // namespace tessera
