#include "tessera/model/families/deepseek.h"

#include <fmt/format.h>

#include "tessera/model/blocks/mla_attention.h"
#include "tessera/model/blocks/moe_mlp.h"
#include "tessera/model/blocks/swiglu_mlp.h"
#include "tessera/model/families/llama.h"
#include "tessera/model/families/moe.h"

namespace tessera {

// Megatron's MLA: each head's sizes come from its own keys, one key/value head per query head;
// kv_channels is not used. rope_type null means yarn for MLA, as in Megatron.
ModelSpec DeepseekFamily::make_spec(const Experiment& e) const {
  const ModelConfig& m = e.model_config;
  if (!m.multi_latent_attention)
    reject_model_key(e, "multi_latent_attention",
                     "true with model_family deepseek (DeepSeek-V2/V3 attention is multi-latent)");
  ModelSpec s = decoder_spec(e);
  s.kv_heads = s.heads;
  s.head_dim = m.qk_pos_emb_head_dim;  // the rope table's width
  s.mla.enabled = true;
  s.mla.q_lora_rank = m.q_lora_rank;
  s.mla.kv_lora_rank = m.kv_lora_rank;
  s.mla.qk_head_dim = m.qk_head_dim;
  s.mla.rope_dim = m.qk_pos_emb_head_dim;
  s.mla.v_head_dim = m.v_head_dim;
  if (m.rope_type != RopeType::Rope) {
    YarnRope& y = s.yarn;
    y.enabled = true;
    y.factor = m.rotary_scaling_factor;
    y.original_max_position_embeddings = m.original_max_position_embeddings;
    y.beta_fast = m.beta_fast;
    y.beta_slow = m.beta_slow;
    y.mscale = m.mscale;
    y.mscale_all_dim = m.mscale_all_dim;
  }
  if (m.num_experts > 0) s.moe = moe_spec(e, s.ffn);
  return s;
}

std::vector<std::unique_ptr<Block>> DeepseekFamily::layer_blocks(const ModelSpec& s,
                                                                 int64_t layer) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_block(s, std::make_unique<MlaAttention>(s)));
  if (s.moe.is_moe_layer(layer)) {
    blocks.push_back(make_block(s, std::make_unique<MoeMlp>(s)));
  } else {
    blocks.push_back(make_block(s, std::make_unique<SwigluMlp>(s)));
  }
  return blocks;
}

std::string DeepseekFamily::features(const ModelSpec& s) const {
  const MlaSpec& m = s.mla;
  return fmt::format(
      ", multi-latent attention ({}, kv latent {}, q/k heads {} + rope {}, v heads {}){}{}{}",
      m.q_lora_rank ? fmt::format("q latent {}", m.q_lora_rank) : "queries projected directly",
      m.kv_lora_rank, m.qk_head_dim, m.rope_dim, m.v_head_dim,
      s.yarn.enabled ? fmt::format(", yarn rope x{}", s.yarn.factor) : "", moe_features(s),
      s.tied_embeddings ? ", tied embeddings" : "");
}

const ModelFamily& deepseek_family() {
  static const DeepseekFamily family;
  return family;
}

}  // namespace tessera
