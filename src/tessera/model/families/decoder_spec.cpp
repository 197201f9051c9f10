#include "tessera/model/families/decoder_spec.h"

#include "tessera/config/keys.h"
#include "tessera/core/error.h"

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

void require_qk_norm_decoder_keys(const Experiment& e, const std::string& family,
                                  const QkNormDecoderFacts& why) {
  const ModelConfig& m = e.model_config;
  const std::string with = " with model_family " + family + " (";
  if (m.num_experts > 0) reject_model_key(e, "num_experts", "0" + with + why.dense + ")");
  if (m.multi_latent_attention)
    reject_model_key(e, "multi_latent_attention", "false" + with + "grouped-query attention)");
  if (!m.qk_layernorm) reject_model_key(e, "qk_layernorm", "true" + with + why.qk_norm + ")");
  if (m.add_qkv_bias) reject_model_key(e, "add_qkv_bias", "false" + with + why.no_bias + ")");
  if (m.sliding_window > 0)
    reject_model_key(e, "sliding_window", "0" + with + why.full_context + ")");
}

std::string qk_norm_decoder_problem(const ModelSpec& s, const std::string& family) {
  const std::string f = "model_family " + family;
  if (s.moe.enabled()) return f + " with experts";
  if (s.mla.enabled) return f + " with multi_latent_attention";
  if (!s.qk_norm) return f + " without qk_layernorm";
  if (s.qkv_bias) return f + " with add_qkv_bias";
  if (s.sliding_window > 0) return f + " with a sliding window";
  return "";
}

}  // namespace tessera
