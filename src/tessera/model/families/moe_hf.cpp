// The MoE families' Hugging Face side: config.json of mixtral and qwen3_moe models <->
// ModelSpec, and the tensor names of each parameter. Tessera stacks each MoE layer's experts
// into one (E, 2F, C) gate/up tensor and one (E, C, F) down tensor; Hugging Face checkpoints
// hold one tensor per expert and projection, which are the stacked tensor's row blocks. The
// router is Mixtral's block_sparse_moe.gate and Qwen3-MoE's mlp.gate. Attention, norms,
// embeddings and dense MLP layers are named as in the Llama family.
#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/families/llama.h"
#include "tessera/model/families/moe.h"

namespace tessera {
namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_mixtral(std::string_view hf_type) {
  return hf_type == "mixtral";
}

}  // namespace

ModelSpec MoeFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto unsupported = [&](const std::string& what) {
    return DataError(
        fmt::format("{}: {} is not supported by Tessera's {} model", file, what, arch_.hf_type));
  };
  const bool mixtral = is_mixtral(arch_.hf_type);
  ModelSpec s;
  try {
    auto required = [&](const char* key) {
      if (!has(key)) throw DataError(fmt::format("{}: field '{}' is missing", file, key));
      return j[key].get<int64_t>();
    };
    s.hidden = required("hidden_size");
    s.num_layers = required("num_hidden_layers");
    s.heads = required("num_attention_heads");
    s.vocab_size = required("vocab_size");
    s.kv_heads = has("num_key_value_heads") ? j["num_key_value_heads"].get<int64_t>() : s.heads;
    s.head_dim =
        has("head_dim") ? j["head_dim"].get<int64_t>() : s.hidden / std::max<int64_t>(s.heads, 1);
    // Defaults are those of transformers' config classes for a missing field.
    s.max_position_embeddings = j.value("max_position_embeddings", mixtral ? 131072 : 32768);
    s.norm_eps = static_cast<float>(j.value("rms_norm_eps", mixtral ? 1e-5 : 1e-6));
    s.tied_embeddings = j.value("tie_word_embeddings", false);
    s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw unsupported(
          fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
    if (j.value("attention_bias", false)) throw unsupported("attention_bias: true");
    const HfRope rope = read_hf_rope(j, mixtral ? 1e6 : 10000.0);
    s.rotary_base = rope.theta;
    if (rope.type != "default")
      throw unsupported(fmt::format("RoPE type '{}' (expected default)", rope.type));
    MoeSpec& m = s.moe;
    m.topk = required("num_experts_per_tok");
    // Each family's own name first; transformers versions have written the other one too.
    const auto experts = [&] {
      const char* own = mixtral ? "num_local_experts" : "num_experts";
      const char* other = mixtral ? "num_experts" : "num_local_experts";
      return has(own) || !has(other) ? required(own) : required(other);
    };
    if (mixtral) {
      s.ffn = required("intermediate_size");
      m.experts = experts();
      m.ffn = s.ffn;
      m.layers.assign(static_cast<size_t>(s.num_layers), true);
      s.sliding_window = has("sliding_window") ? j["sliding_window"].get<int64_t>() : 0;
    } else {
      s.qk_norm = true;
      s.ffn = j.value("intermediate_size", int64_t{6144});
      m.experts = experts();
      m.ffn = required("moe_intermediate_size");
      // Qwen3-MoE: layer l is sparse unless listed in mlp_only_layers, and when
      // (l + 1) % decoder_sparse_step == 0.
      const int64_t step = j.value("decoder_sparse_step", int64_t{1});
      std::set<int64_t> dense;
      if (has("mlp_only_layers"))
        for (const auto& l : j["mlp_only_layers"]) dense.insert(l.get<int64_t>());
      for (int64_t l = 0; l < s.num_layers; ++l)
        m.layers.push_back(!dense.count(l) && m.experts > 0 && step > 0 && (l + 1) % step == 0);
      // norm_topk_prob false keeps the softmax over all experts: Megatron's pre-softmax.
      m.pre_softmax = !j.value("norm_topk_prob", false);
      if (j.value("use_sliding_window", false)) throw unsupported("use_sliding_window: true");
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: {}", file, e.what()));
  }
  if (s.hidden <= 0 || s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0 ||
      s.head_dim <= 0 || s.num_layers <= 0 || s.moe.experts <= 0 || s.moe.topk <= 0 ||
      s.moe.topk > s.moe.experts || s.moe.ffn <= 0 || s.vocab_size <= 0)
    throw DataError(fmt::format(
        "{}: inconsistent sizes (hidden_size {}, num_attention_heads {}, num_key_value_heads "
        "{}, head_dim {}, num_hidden_layers {}, experts {}, experts per token {}, expert "
        "intermediate size {}, vocab_size {})",
        file, s.hidden, s.heads, s.kv_heads, s.head_dim, s.num_layers, s.moe.experts, s.moe.topk,
        s.moe.ffn, s.vocab_size));
  s.tokenizer_vocab = s.vocab_size;
  return s;
}

// The model must be one the architecture describes: Mixtral has MoE in every layer; neither
// has a shared expert, sigmoid or group-limited routing, scaled weights or QKV bias.
std::string MoeFamily::hf_model_type(const ModelSpec& s) const {
  const MoeSpec& m = s.moe;
  const bool mixtral = is_mixtral(arch_.hf_type);
  auto refuse = [&](const std::string& what) {
    return DataError(fmt::format("{} ({}) cannot hold {}", arch_.hf_class, arch_.name, what));
  };
  if (m.shared_ffn > 0) throw refuse("a shared expert");
  if (m.sigmoid) throw refuse("sigmoid routing");
  if (m.num_groups > 0) throw refuse("group-limited routing");
  if (m.topk_scaling != 0.0 && m.topk_scaling != 1.0) throw refuse("scaled routing weights");
  if (s.qkv_bias) throw refuse("QKV bias");
  if (s.rope_scaling.enabled) throw refuse("Llama 3.1 RoPE scaling");
  if (mixtral && m.moe_layers() != s.num_layers)
    throw refuse(
        "dense layers (moe_layer_freq): every Mixtral layer is MoE. The Hugging Face classes "
        "with dense layers are Qwen3-MoE's (Qwen3MoeForCausalLM, mlp_only_layers: Tessera's "
        "model_family qwen3_moe, whose attention also normalises each query and key head, "
        "qk_layernorm) and DeepSeek-V2/V3's (first_k_dense_replace, dense layers first only, "
        "with multi-latent attention: model_family deepseek); train the model as one of those "
        "to export it, or with moe_layer_freq 1");
  if (mixtral && m.pre_softmax) throw refuse("pre-softmax routing");
  if (!mixtral && s.sliding_window > 0) throw refuse("a sliding window");
  return std::string(arch_.hf_type);
}

nlohmann::ordered_json MoeFamily::hf_config(const ModelSpec& s) const {
  hf_model_type(s);
  const bool mixtral = is_mixtral(arch_.hf_type);
  const MoeSpec& m = s.moe;
  nlohmann::ordered_json j;
  j["architectures"] = {std::string(arch_.hf_class)};
  j["model_type"] = std::string(arch_.hf_type);
  j["vocab_size"] = s.vocab_size;
  j["hidden_size"] = s.hidden;
  j["intermediate_size"] = mixtral ? m.ffn : s.ffn;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.kv_heads;
  j["head_dim"] = s.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = s.max_position_embeddings;
  j["rms_norm_eps"] = std::stod(fmt::format("{}", s.norm_eps));
  j["rope_theta"] = s.rotary_base;
  j["rope_scaling"] = nullptr;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", s.rotary_base}};
  j["tie_word_embeddings"] = s.tied_embeddings;
  j["initializer_range"] = std::stod(fmt::format("{}", s.init_std));
  j["attention_dropout"] = 0.0;
  j["num_experts_per_tok"] = m.topk;
  if (mixtral) {
    j["num_local_experts"] = m.experts;
    j["sliding_window"] = s.sliding_window > 0 ? nlohmann::ordered_json(s.sliding_window)
                                               : nlohmann::ordered_json(nullptr);
    j["router_jitter_noise"] = 0.0;
  } else {
    j["num_experts"] = m.experts;
    j["moe_intermediate_size"] = m.ffn;
    j["norm_topk_prob"] = !m.pre_softmax;
    j["decoder_sparse_step"] = 1;
    std::vector<int64_t> dense;
    for (int64_t l = 0; l < s.num_layers; ++l)
      if (!m.is_moe_layer(l)) dense.push_back(l);
    j["mlp_only_layers"] = dense;
    j["attention_bias"] = false;
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
  }
  j["output_router_logits"] = false;
  // The run's weight of the balance loss (transformers' loss when output_router_logits is on).
  j["router_aux_loss_coef"] = m.aux_loss_coeff;
  j["use_cache"] = true;
  return j;
}

std::vector<HfTensorPiece> MoeFamily::hf_pieces(const ParamInfo& p, const ModelSpec& s) const {
  const bool mixtral = is_mixtral(arch_.hf_type);
  const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
  auto replace_tail = [&](std::string_view tail) {
    return p.name.substr(0, p.name.size() - tail.size());
  };
  if (ends_with(p.name, "mlp.router.weight"))
    return {{replace_tail("mlp.router.weight") + moe + "gate.weight", 0, {p.shape[0], p.shape[1]}}};
  const int64_t E = s.moe.experts;
  if (ends_with(p.name, "mlp.experts.gate_up_proj.weight")) {
    const std::string base = replace_tail("mlp.experts.gate_up_proj.weight") + moe + "experts.";
    const int64_t F = p.shape[1] / 2, C = p.shape[2];
    std::vector<HfTensorPiece> out;
    for (int64_t e = 0; e < E; ++e) {
      const std::string expert = base + std::to_string(e) + ".";
      out.push_back({expert + (mixtral ? "w1" : "gate_proj") + ".weight", e * 2 * F * C, {F, C}});
      out.push_back(
          {expert + (mixtral ? "w3" : "up_proj") + ".weight", (e * 2 + 1) * F * C, {F, C}});
    }
    return out;
  }
  if (ends_with(p.name, "mlp.experts.down_proj.weight")) {
    const std::string base = replace_tail("mlp.experts.down_proj.weight") + moe + "experts.";
    const int64_t C = p.shape[1], F = p.shape[2];
    std::vector<HfTensorPiece> out;
    for (int64_t e = 0; e < E; ++e)
      out.push_back({base + std::to_string(e) + (mixtral ? ".w2" : ".down_proj") + ".weight",
                     e * C * F,
                     {C, F}});
    return out;
  }
  return llama_family().hf_pieces(p, s);
}

}  // namespace tessera
