// The MoE families' Hugging Face side: config.json of mixtral and qwen3_moe models <->
// ModelSpec, and the tensor names of each parameter, from each architecture's spelling
// (MoeHfSpelling, the families' table in moe.cpp). Tessera stacks each MoE layer's experts
// into one (E, 2F, C) gate/up tensor and one (E, C, F) down tensor; Hugging Face checkpoints
// hold one tensor per expert and projection, which are the stacked tensor's row blocks. The
// router is Mixtral's block_sparse_moe.gate and Qwen3-MoE's mlp.gate. Attention, norms,
// embeddings and dense MLP layers are named as in the Llama family.
#include <set>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/families/hf_decoder.h"
#include "tessera/model/families/moe.h"

namespace tessera {

ModelSpec MoeFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  const MoeHfSpelling& h = arch_.hf;
  const HfConfig c(j, file, std::string(h.model_type));
  ModelSpec s;
  try {
    HfRope rope;
    s = read_hf_decoder(c, h.defaults, &rope);
    if (j.value("attention_bias", false)) throw c.unsupported("attention_bias: true");
    if (rope.type != "default")
      throw c.unsupported(fmt::format("RoPE type '{}' (expected default)", rope.type));
    s.qk_norm = arch_.qk_norm;
    MoeSpec& m = s.moe;
    m.topk = c.required("num_experts_per_tok");
    const std::string own(h.experts_field), other(h.other_experts_field);
    m.experts = c.has(own.c_str()) || !c.has(other.c_str()) ? c.required(own.c_str())
                                                           : c.required(other.c_str());
    if (h.dense_layers) {
      s.ffn = c.count("intermediate_size", h.dense_ffn_default);
      m.ffn = c.required("moe_intermediate_size");
      // Layer l is sparse unless listed in mlp_only_layers, and when
      // (l + 1) % decoder_sparse_step == 0.
      const int64_t step = c.count("decoder_sparse_step", 1);
      std::set<int64_t> dense;
      if (c.has("mlp_only_layers"))
        for (const auto& l : j["mlp_only_layers"]) dense.insert(l.get<int64_t>());
      for (int64_t l = 0; l < s.num_layers; ++l)
        m.layers.push_back(!dense.count(l) && m.experts > 0 && step > 0 && (l + 1) % step == 0);
    } else {
      s.ffn = c.required("intermediate_size");
      m.ffn = s.ffn;
      m.layers.assign(static_cast<size_t>(s.num_layers), true);
    }
    // norm_topk_prob false keeps the softmax over all experts: Megatron's pre-softmax.
    if (h.norm_topk_prob) m.pre_softmax = !j.value("norm_topk_prob", false);
    if (h.sliding_window)
      s.sliding_window = c.count("sliding_window", 0);
    else if (j.value("use_sliding_window", false))
      throw c.unsupported("use_sliding_window: true");
  } catch (const nlohmann::json::exception& e) {
    throw c.invalid(e.what());
  }
  const MoeSpec& m = s.moe;
  check_hf_decoder_sizes(
      c, s, m.experts > 0 && m.topk > 0 && m.topk <= m.experts && m.ffn > 0,
      fmt::format("experts {}, experts per token {}, expert intermediate size {}", m.experts,
                  m.topk, m.ffn));
  return s;
}

// The model must be one the architecture describes; neither has a shared expert, sigmoid or
// group-limited routing, scaled weights or QKV bias.
std::string MoeFamily::hf_model_type(const ModelSpec& s) const {
  const MoeHfSpelling& h = arch_.hf;
  const MoeSpec& m = s.moe;
  auto refuse = [&](const std::string& what) {
    return DataError(fmt::format("{} ({}) cannot hold {}", h.hf_class, arch_.name, what));
  };
  if (m.shared_ffn > 0) throw refuse("a shared expert");
  if (m.sigmoid) throw refuse("sigmoid routing");
  if (m.num_groups > 0) throw refuse("group-limited routing");
  if (m.topk_scaling != 0.0 && m.topk_scaling != 1.0) throw refuse("scaled routing weights");
  if (s.qkv_bias) throw refuse("QKV bias");
  if (s.rope_scaling.enabled) throw refuse("Llama 3.1 RoPE scaling");
  if (!h.dense_layers && m.moe_layers() != s.num_layers)
    throw refuse(fmt::format(
        "dense layers (moe_layer_freq): every {} layer is MoE. The Hugging Face classes "
        "with dense layers are Qwen3-MoE's (Qwen3MoeForCausalLM, mlp_only_layers: Tessera's "
        "model_family qwen3_moe, whose attention also normalises each query and key head, "
        "qk_layernorm) and DeepSeek-V2/V3's (first_k_dense_replace, dense layers first only, "
        "with multi-latent attention: model_family deepseek); train the model as one of those "
        "to export it, or with moe_layer_freq 1",
        h.hf_class));
  if (!h.norm_topk_prob && m.pre_softmax) throw refuse("pre-softmax routing");
  if (!h.sliding_window && s.sliding_window > 0) throw refuse("a sliding window");
  return std::string(h.model_type);
}

nlohmann::ordered_json MoeFamily::hf_config(const ModelSpec& s) const {
  hf_model_type(s);
  const MoeHfSpelling& h = arch_.hf;
  const MoeSpec& m = s.moe;
  nlohmann::ordered_json j =
      hf_decoder_config(s, std::string(h.hf_class), std::string(h.model_type));
  j["intermediate_size"] = h.dense_layers ? s.ffn : m.ffn;
  write_hf_rope(j, s.rotary_base, nullptr);
  j["num_experts_per_tok"] = m.topk;
  j[std::string(h.experts_field)] = m.experts;
  if (h.dense_layers) {
    j["moe_intermediate_size"] = m.ffn;
    j["decoder_sparse_step"] = 1;
    std::vector<int64_t> dense;
    for (int64_t l = 0; l < s.num_layers; ++l)
      if (!m.is_moe_layer(l)) dense.push_back(l);
    j["mlp_only_layers"] = dense;
    j["attention_bias"] = false;
  }
  if (h.norm_topk_prob) j["norm_topk_prob"] = !m.pre_softmax;
  if (h.sliding_window) {
    j["sliding_window"] = s.sliding_window > 0 ? nlohmann::ordered_json(s.sliding_window)
                                               : nlohmann::ordered_json(nullptr);
    j["router_jitter_noise"] = 0.0;
  } else {
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
  const MoeHfSpelling& h = arch_.hf;
  const std::string moe(h.moe_module);
  auto replace_tail = [&](std::string_view tail) {
    return p.name.substr(0, p.name.size() - tail.size());
  };
  auto expert_tensor = [&](const std::string& base, int64_t e, std::string_view proj) {
    return fmt::format("{}{}.{}.weight", base, e, proj);
  };
  if (ends_with(p.name, "mlp.router.weight"))
    return {{replace_tail("mlp.router.weight") + moe + "gate.weight", 0, {p.shape[0], p.shape[1]}}};
  const int64_t E = s.moe.experts;
  if (ends_with(p.name, "mlp.experts.gate_up_proj.weight")) {
    const std::string base = replace_tail("mlp.experts.gate_up_proj.weight") + moe + "experts.";
    const int64_t F = p.shape[1] / 2, C = p.shape[2];
    std::vector<HfTensorPiece> out;
    for (int64_t e = 0; e < E; ++e) {
      out.push_back({expert_tensor(base, e, h.gate_proj), e * 2 * F * C, {F, C}});
      out.push_back({expert_tensor(base, e, h.up_proj), (e * 2 + 1) * F * C, {F, C}});
    }
    return out;
  }
  if (ends_with(p.name, "mlp.experts.down_proj.weight")) {
    const std::string base = replace_tail("mlp.experts.down_proj.weight") + moe + "experts.";
    const int64_t C = p.shape[1], F = p.shape[2];
    std::vector<HfTensorPiece> out;
    for (int64_t e = 0; e < E; ++e)
      out.push_back({expert_tensor(base, e, h.down_proj), e * C * F, {C, F}});
    return out;
  }
  return hf_decoder_pieces(p);
}

}  // namespace tessera
