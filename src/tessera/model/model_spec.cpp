#include "tessera/model/model_spec.h"

#include <cmath>

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/model/model_family.h"

namespace tessera {

int64_t MoeSpec::moe_layers() const {
  int64_t n = 0;
  for (size_t l = 0; l < layers.size(); ++l) n += is_moe_layer(static_cast<int64_t>(l));
  return n;
}

int64_t MoeSpec::capacity(int64_t tokens) const {
  if (capacity_factor <= 0 || experts <= 0) return 0;
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens * topk) /
                                        static_cast<double>(experts) * capacity_factor));
}

int64_t ModelSpec::matmul_params() const {
  int64_t n = vocab_size * hidden;  // the output head
  for (int64_t l = 0; l < num_layers; ++l) n += make_decoder_layer(*this, l)->matmul_params();
  return n;
}

int64_t ModelSpec::total_params() const {
  int64_t n = 0;
  for (const ParamInfo& p : make_param_layout(*this).params) n += p.numel();
  return n;
}

double ModelSpec::flops_per_token(int64_t seq_length, AttentionCount count) const {
  int64_t matmul = vocab_size * hidden;  // the output head
  double attention = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto layer = make_decoder_layer(*this, l);
    matmul += layer->matmul_params();
    attention += layer->attention_flops_per_token(seq_length);
  }
  if (count == AttentionCount::CausalHalf) attention /= 2;
  return 6.0 * static_cast<double>(matmul) + attention;
}

int64_t ModelSpec::active_params() const {
  return total_params() - moe.moe_layers() * (moe.experts - moe.topk) * 3 * hidden * moe.ffn;
}

std::string ModelSpec::summary() const {
  // An MLA model's head_dim is its RoPE part; its family's features give the head sizes.
  return fmt::format(
      "{} layers, hidden {}, ffn {}, heads {} (kv {}), {} {}, vocab {}{}; "
      "{:.3f}B parameters{}",
      num_layers, hidden, ffn, heads, kv_heads, mla.enabled ? "rope dim" : "head_dim", head_dim,
      vocab_size, model_family(family).features(*this), total_params() / 1e9,
      moe.enabled() ? fmt::format(", {:.3f}B active per token", active_params() / 1e9) : "");
}

ModelSpec tensor_parallel_shard(const ModelSpec& spec, int parts) {
  TS_CHECK(parts >= 1 && spec.heads % parts == 0 && spec.kv_heads % parts == 0 &&
               spec.ffn % parts == 0 && spec.moe.shared_ffn % parts == 0 &&
               spec.vocab_size % parts == 0,
           "a model of {} heads, {} query groups, MLP width {}, shared expert width {} and "
           "vocabulary {} does not split over {} tensor-parallel ranks",
           spec.heads, spec.kv_heads, spec.ffn, spec.moe.shared_ffn, spec.vocab_size, parts);
  ModelSpec s = spec;
  s.heads /= parts;
  s.kv_heads /= parts;
  s.ffn /= parts;
  // The shared expert is split like a dense MLP; the routed experts stay whole.
  s.moe.shared_ffn /= parts;
  s.vocab_size /= parts;
  return s;
}

ModelSpec make_model_spec(const Experiment& e, int64_t tokenizer_vocab) {
  const ModelConfig& m = e.model_config;
  auto origin = [&](const char* key) {
    auto it = e.origin.find(key);
    return it == e.origin.end() ? std::string("default") : it->second;
  };
  const ModelFamily* family = find_model_family(m.model_family);
  if (family == nullptr)
    throw ConfigError(origin("model_family"), "model_family", m.model_family,
                      "one of: " + model_family_names());
  ModelSpec s = family->make_spec(e);
  s.family = family->name();
  s.tokenizer_vocab = tokenizer_vocab;
  // NullTokenizer's vocab_size counts its ids without the end-of-document id (Megatron's).
  const int64_t declared = m.vocab_size && e.data.tokenizer_type == TokenizerType::Null
                               ? m.vocab_size + 1
                               : m.vocab_size;
  const int64_t vocab = declared ? declared : tokenizer_vocab;
  if (vocab < tokenizer_vocab)
    throw ConfigError(
        origin("vocab_size"), "vocab_size", std::to_string(m.vocab_size),
        fmt::format("at least the tokenizer's vocabulary ({}) or 0", tokenizer_vocab));
  // Megatron's padding: every tensor-parallel rank holds an equal, aligned share of the rows.
  const int64_t multiple =
      m.make_vocab_size_divisible_by * std::max<int64_t>(1, e.training.tensor_model_parallel_size);
  s.vocab_size = (vocab + multiple - 1) / multiple * multiple;
  return s;
}

}  // namespace tessera
