#include "tessera/model/families/moe.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"

#include "tessera/config/moe_layer_freq.h"
#include "tessera/model/blocks/gqa_attention.h"
#include "tessera/model/blocks/moe_mlp.h"
#include "tessera/model/blocks/swiglu_mlp.h"
#include "tessera/model/families/decoder_spec.h"

namespace tessera {

ModelSpec MoeFamily::make_spec(const Experiment& e) const {
  const ModelConfig& m = e.model_config;
  if (m.num_experts < 1)
    reject_model_key(e, "num_experts",
                     fmt::format("at least 1 with model_family {} (an MoE family)", arch_.name));
  if (m.qk_layernorm != arch_.qk_norm)
    reject_model_key(e, "qk_layernorm",
                     fmt::format("{} with model_family {} ({})", arch_.qk_norm ? "true" : "false",
                                 arch_.name,
                                 arch_.qk_norm ? "its attention normalises each query and key head"
                                               : "its attention has no QK norm"));
  if (m.multi_latent_attention)
    reject_model_key(
        e, "multi_latent_attention",
        fmt::format("false with model_family {} (grouped-query attention)", arch_.name));
  ModelSpec s = decoder_spec(e);
  s.moe = moe_spec(e, s.ffn);
  return s;
}

MoeSpec moe_spec(const Experiment& e, int64_t dense_ffn) {
  const ModelConfig& m = e.model_config;
  MoeSpec moe;
  moe.experts = m.num_experts;
  moe.topk = m.moe_router_topk;
  moe.ffn = m.moe_ffn_hidden_size ? m.moe_ffn_hidden_size : dense_ffn;
  moe.shared_ffn = m.moe_shared_expert_intermediate_size;
  std::string why;
  const auto layers = parse_moe_layer_freq(m.moe_layer_freq, m.num_layers, &why);
  if (!layers) reject_model_key(e, "moe_layer_freq", why);
  moe.layers = *layers;
  moe.load_balancing = m.moe_router_load_balancing_type;
  moe.aux_loss_coeff = m.moe_aux_loss_coeff;
  moe.z_loss_coeff = m.moe_z_loss_coeff;
  moe.sigmoid = m.moe_router_score_function == MoeScoreFunction::Sigmoid;
  moe.pre_softmax = m.moe_router_pre_softmax;
  moe.expert_bias = m.moe_router_enable_expert_bias;
  moe.bias_update_rate = m.moe_router_bias_update_rate;
  moe.num_groups = m.moe_router_num_groups;
  moe.group_topk = m.moe_router_group_topk;
  moe.topk_scaling = m.moe_router_topk_scaling_factor;
  moe.capacity_factor = std::max(m.moe_expert_capacity_factor, 0.0);
  moe.drop_by_position = m.moe_token_drop_policy == MoeDropPolicy::Position;
  return moe;
}

std::vector<std::unique_ptr<Block>> MoeFamily::layer_blocks(const ModelSpec& s,
                                                            int64_t layer) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_block(s, std::make_unique<GqaAttention>(s, default_attention(s))));
  if (s.moe.is_moe_layer(layer)) {
    blocks.push_back(make_block(s, std::make_unique<MoeMlp>(s)));
  } else {
    blocks.push_back(make_block(s, std::make_unique<SwigluMlp>(s)));
  }
  return blocks;
}

std::string moe_features(const ModelSpec& s) {
  const MoeSpec& m = s.moe;
  if (!m.enabled()) return "";
  return fmt::format(
      ", {} experts top-{} (ffn {}{}) in {} of {} layers{}{}", m.experts, m.topk, m.ffn,
      m.shared_ffn ? fmt::format(", shared expert {}", m.shared_ffn) : "", m.moe_layers(),
      s.num_layers, m.sigmoid ? ", sigmoid router" : "",
      m.num_groups ? fmt::format(", {} of {} groups", m.group_topk, m.num_groups) : "");
}

std::string MoeFamily::features(const ModelSpec& s) const {
  return fmt::format("{}{}{}", moe_features(s), s.qk_norm ? ", qk norm" : "",
                     s.tied_embeddings ? ", tied embeddings" : "");
}

const ModelFamily& mixtral_family() {
  static const MoeFamily family({"mixtral", "Mixtral 8x7B/8x22B", false,
                                 {.model_type = "mixtral",
                                  .hf_class = "MixtralForCausalLM",
                                  .defaults = {131072, 1e-5, 1e6},
                                  .experts_field = "num_local_experts",
                                  .other_experts_field = "num_experts",
                                  .sliding_window = true,
                                  .moe_module = "block_sparse_moe.",
                                  .gate_proj = "w1",
                                  .up_proj = "w3",
                                  .down_proj = "w2"}});
  return family;
}

const ModelFamily& qwen3_moe_family() {
  static const MoeFamily family({"qwen3_moe", "Qwen3-MoE (Qwen3-30B-A3B)", true,
                                 {.model_type = "qwen3_moe",
                                  .hf_class = "Qwen3MoeForCausalLM",
                                  .defaults = {32768, 1e-6, 1e4},
                                  .experts_field = "num_experts",
                                  .other_experts_field = "num_local_experts",
                                  .dense_layers = true,
                                  .dense_ffn_default = 6144,
                                  .norm_topk_prob = true,
                                  .moe_module = "mlp.",
                                  .gate_proj = "gate_proj",
                                  .up_proj = "up_proj",
                                  .down_proj = "down_proj"}});
  return family;
}

}  // namespace tessera
