#include "tessera/model/families/llama.h"

#include <fmt/format.h>

#include "tessera/config/keys.h"
#include "tessera/core/error.h"

#include "tessera/model/blocks/gqa_attention.h"
#include "tessera/model/blocks/swiglu_mlp.h"

namespace tessera {

// Derived values as Megatron derives them: num_query_groups=0 -> heads, kv_channels=0 ->
// hidden/heads, ffn_hidden_size=0 -> int(8*hidden/3/64)*64.
ModelSpec decoder_spec(const Experiment& e) {
  const ModelConfig& m = e.model_config;
  ModelSpec s;
  s.num_layers = m.num_layers;
  s.hidden = m.hidden_size;
  s.heads = m.num_attention_heads;
  s.kv_heads = m.num_query_groups ? m.num_query_groups : m.num_attention_heads;
  s.head_dim = m.kv_channels ? m.kv_channels : m.hidden_size / m.num_attention_heads;
  s.ffn = m.ffn_hidden_size ? m.ffn_hidden_size : (8 * m.hidden_size / 3 / 64) * 64;
  if (s.ffn == 0) s.ffn = 64;
  s.max_position_embeddings = m.max_position_embeddings;
  s.rotary_base = m.rotary_base;
  s.rope_scaling = {m.use_rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor,
                    m.rope_high_freq_factor, m.rope_original_max_position_embeddings};
  s.norm_eps = static_cast<float>(m.norm_epsilon);
  s.qkv_bias = m.add_qkv_bias;
  s.tied_embeddings = !m.untie_embeddings_and_output_weights;
  s.sliding_window = m.sliding_window;
  s.init_std = static_cast<float>(m.init_method_std);
  s.qk_norm = m.qk_layernorm;
  return s;
}

void reject_model_key(const Experiment& e, const char* key, const std::string& expected) {
  const auto it = e.origin.find(key);
  const KeySpec* spec = find_key(key);
  throw ConfigError(it == e.origin.end() ? std::string("default") : it->second, key,
                    spec ? spec->get(e) : "?", expected);
}

ModelSpec LlamaFamily::make_spec(const Experiment& e) const {
  const ModelConfig& m = e.model_config;
  if (m.num_experts > 0)
    reject_model_key(e, "num_experts",
                     "0 with model_family llama (a dense model); MoE models are model_family "
                     "mixtral, qwen3_moe or deepseek");
  if (m.multi_latent_attention)
    reject_model_key(e, "multi_latent_attention",
                     "false with model_family llama (GQA attention); multi-latent attention is "
                     "model_family deepseek");
  if (m.qk_layernorm)
    reject_model_key(e, "qk_layernorm",
                     "false with model_family llama (Llama, Qwen 2.5 and Mistral have no QK "
                     "norm; qwen3_moe has it)");
  return decoder_spec(e);
}

std::vector<std::unique_ptr<Block>> LlamaFamily::layer_blocks(const ModelSpec& s,
                                                              int64_t /*layer*/) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_block(s, std::make_unique<GqaAttention>(s, default_attention(s))));
  blocks.push_back(make_block(s, std::make_unique<SwigluMlp>(s)));
  return blocks;
}

std::string LlamaFamily::features(const ModelSpec& s) const {
  return fmt::format("{}{}{}{}", s.qkv_bias ? ", qkv bias" : "",
                     s.tied_embeddings ? ", tied embeddings" : "",
                     s.sliding_window ? fmt::format(", sliding window {}", s.sliding_window) : "",
                     s.rope_scaling.enabled ? ", llama3 rope scaling" : "");
}

const ModelFamily& llama_family() {
  static const LlamaFamily family;
  return family;
}

}  // namespace tessera
