#include "tessera/model/families/olmo2.h"

#include <fmt/format.h>

#include "tessera/model/blocks/gqa_attention.h"
#include "tessera/model/blocks/swiglu_mlp.h"
#include "tessera/model/families/decoder_spec.h"
#include "tessera/model/families/hf_decoder.h"

namespace tessera {

ModelSpec Olmo2Family::make_spec(const Experiment& e) const {
  require_qk_norm_decoder_keys(e, "olmo2",
                               {.dense = "the dense OLMo 2 models",
                                .qk_norm = "OLMo 2 normalises all of q and all of k",
                                .no_bias = "OLMo 2 has no biases",
                                .full_context = "OLMo 2 attends to the whole context"});
  // The QK norms' statistics span every head: with the heads split over tensor-parallel ranks
  // each rank would norm its own share only.
  if (e.training.tensor_model_parallel_size > 1)
    reject_model_key(e, "tensor_model_parallel_size",
                     "1 with model_family olmo2 (its QK norms span all heads, which tensor "
                     "parallelism splits; use data, pipeline or context parallelism)");
  return decoder_spec(e);
}

std::vector<std::unique_ptr<Block>> Olmo2Family::layer_blocks(const ModelSpec& s,
                                                              int64_t /*layer*/) const {
  AttentionOptions attention = default_attention(s);
  attention.qk_norm = QkNorm::Whole;
  const NormSlots post{.pre = false, .post = true};
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_block(s, std::make_unique<GqaAttention>(s, attention), post));
  blocks.push_back(make_block(s, std::make_unique<SwigluMlp>(s), post));
  return blocks;
}

std::string Olmo2Family::features(const ModelSpec& s) const {
  return fmt::format(", post-norms, qk norm over all heads{}",
                     s.tied_embeddings ? ", tied embeddings" : "");
}

// What make_spec refuses, for a description read from a checkpoint.
std::string Olmo2Family::spec_problem(const ModelSpec& s) const {
  return qk_norm_decoder_problem(s, "olmo2");
}

const ModelFamily& olmo2_family() {
  static const Olmo2Family family;
  return family;
}

// ---- Hugging Face: Olmo2Config <-> ModelSpec.

ModelSpec Olmo2Family::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  const HfConfig c(j, file, "olmo2");
  ModelSpec s;
  try {
    // Olmo2Config's defaults for a missing field.
    HfRope rope;
    s = read_hf_decoder(c, {2048, 1e-5, 10000.0}, &rope);
    s.ffn = c.required("intermediate_size");
    s.qk_norm = true;
    if (j.value("attention_bias", false)) throw c.unsupported("attention_bias: true");
    read_hf_default_or_llama3_rope(c, rope, s);
  } catch (const nlohmann::json::exception& e) {
    throw c.invalid(e.what());
  }
  check_hf_decoder_sizes(c, s, s.ffn > 0 && s.head_dim * s.heads == s.hidden,
                         fmt::format("intermediate_size {}; Olmo2Config's head_dim is "
                                     "hidden_size / num_attention_heads",
                                     s.ffn));
  return s;
}

std::string Olmo2Family::hf_model_type(const ModelSpec& s) const {
  auto refuse = [](const std::string& what) {
    return DataError(fmt::format("Olmo2ForCausalLM (olmo2) cannot hold {}", what));
  };
  if (s.qkv_bias) throw refuse("QKV bias");
  if (s.sliding_window > 0) throw refuse("a sliding window");
  if (s.head_dim * s.heads != s.hidden)
    throw refuse(fmt::format("head_dim {} other than hidden_size / num_attention_heads ({})",
                             s.head_dim, s.hidden / s.heads));
  return "olmo2";
}

nlohmann::ordered_json Olmo2Family::hf_config(const ModelSpec& s) const {
  nlohmann::ordered_json j =
      hf_decoder_config(s, "Olmo2ForCausalLM", hf_model_type(s), /*head_dim=*/false);
  j["intermediate_size"] = s.ffn;
  write_hf_rope(j, s.rotary_base, hf_llama3_rope(s));
  j["attention_bias"] = false;
  j["use_cache"] = true;
  return j;
}

std::vector<HfTensorPiece> Olmo2Family::hf_pieces(const ParamInfo& p, const ModelSpec& s) const {
  // The post-norms carry Hugging Face's layer-level names; the rest as every decoder.
  static const std::pair<std::string_view, std::string_view> kPostNorms[] = {
      {"self_attn.post_norm.weight", "post_attention_layernorm.weight"},
      {"mlp.post_norm.weight", "post_feedforward_layernorm.weight"}};
  for (const auto& [tessera, hf] : kPostNorms)
    if (ends_with(p.name, std::string(tessera)))
      return {{p.name.substr(0, p.name.size() - tessera.size()) + std::string(hf), 0,
               {s.hidden}}};
  return hf_decoder_pieces(p);
}

}  // namespace tessera
