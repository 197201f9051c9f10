#include "tessera/model/model_spec.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

int64_t ModelSpec::matmul_params() const {
  const int64_t per_layer = hidden * qkv_width() + attn_width() * hidden + 3 * hidden * ffn;
  return num_layers * per_layer + vocab_size * hidden;
}

int64_t ModelSpec::total_params() const {
  const int64_t per_layer = hidden * qkv_width() + (qkv_bias ? qkv_width() : 0) +
                            attn_width() * hidden + 3 * hidden * ffn + 2 * hidden;
  return vocab_size * hidden * (tied_embeddings ? 1 : 2) + num_layers * per_layer + hidden;
}

double ModelSpec::flops_per_token(int64_t seq_length) const {
  const int64_t s_eff = sliding_window > 0 ? std::min(seq_length, sliding_window) : seq_length;
  return 6.0 * static_cast<double>(matmul_params()) +
         12.0 * static_cast<double>(num_layers) * static_cast<double>(s_eff) *
             static_cast<double>(attn_width());
}

std::string ModelSpec::summary() const {
  return fmt::format(
      "{} layers, hidden {}, ffn {}, heads {} (kv {}), head_dim {}, vocab {}{}{}{}{}; {:.3f}B "
      "parameters",
      num_layers, hidden, ffn, heads, kv_heads, head_dim, vocab_size, qkv_bias ? ", qkv bias" : "",
      tied_embeddings ? ", tied embeddings" : "",
      sliding_window ? fmt::format(", sliding window {}", sliding_window) : "",
      rope_scaling.enabled ? ", llama3 rope scaling" : "", total_params() / 1e9);
}

ModelSpec make_model_spec(const Experiment& e, int64_t tokenizer_vocab) {
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
  s.tokenizer_vocab = tokenizer_vocab;
  const int64_t vocab = m.vocab_size ? m.vocab_size : tokenizer_vocab;
  if (vocab < tokenizer_vocab) {
    auto it = e.origin.find("vocab_size");
    throw ConfigError(it == e.origin.end() ? "default" : it->second, "vocab_size",
                      std::to_string(m.vocab_size),
                      fmt::format("at least the tokenizer's vocabulary ({}) or 0", tokenizer_vocab));
  }
  const int64_t multiple = m.make_vocab_size_divisible_by;
  s.vocab_size = (vocab + multiple - 1) / multiple * multiple;
  return s;
}

}  // namespace tessera
