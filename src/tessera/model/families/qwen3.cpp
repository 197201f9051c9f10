#include "tessera/model/families/qwen3.h"

#include <fmt/format.h>

#include "tessera/model/blocks/gqa_attention.h"
#include "tessera/model/blocks/swiglu_mlp.h"
#include "tessera/model/families/decoder_spec.h"
#include "tessera/model/families/hf_decoder.h"

namespace tessera {

ModelSpec Qwen3Family::make_spec(const Experiment& e) const {
  require_qk_norm_decoder_keys(e, "qwen3",
                               {.dense = "the dense Qwen3 models",
                                .qk_norm = "Qwen3 normalises each query and key head",
                                .no_bias = "Qwen3 has no QKV bias",
                                .full_context = "its released models attend to the whole context"});
  return decoder_spec(e);
}

std::vector<std::unique_ptr<Block>> Qwen3Family::layer_blocks(const ModelSpec& s,
                                                              int64_t /*layer*/) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_block(s, std::make_unique<GqaAttention>(s, default_attention(s))));
  blocks.push_back(make_block(s, std::make_unique<SwigluMlp>(s)));
  return blocks;
}

std::string Qwen3Family::features(const ModelSpec& s) const {
  return fmt::format(", qk norm per head{}{}", s.tied_embeddings ? ", tied embeddings" : "",
                     s.rope_scaling.enabled ? ", llama3 rope scaling" : "");
}

// What make_spec refuses, for a description read from a checkpoint.
std::string Qwen3Family::spec_problem(const ModelSpec& s) const {
  return qk_norm_decoder_problem(s, "qwen3");
}

const ModelFamily& qwen3_family() {
  static const Qwen3Family family;
  return family;
}

// ---- Hugging Face: Qwen3Config <-> ModelSpec; the tensors keep the decoder's shared names
// (q_norm and k_norm are Hugging Face's too).

ModelSpec Qwen3Family::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  const HfConfig c(j, file, "qwen3");
  ModelSpec s;
  try {
    // Qwen3Config's defaults for a missing field (head_dim 128 whatever the hidden size).
    HfRope rope;
    s = read_hf_decoder(c, {32768, 1e-6, 10000.0}, &rope);
    s.head_dim = c.count("head_dim", 128);
    s.ffn = c.required("intermediate_size");
    s.qk_norm = true;
    if (j.value("attention_bias", false)) throw c.unsupported("attention_bias: true");
    if (j.value("use_sliding_window", false)) throw c.unsupported("use_sliding_window: true");
    read_hf_default_or_llama3_rope(c, rope, s);
  } catch (const nlohmann::json::exception& e) {
    throw c.invalid(e.what());
  }
  check_hf_decoder_sizes(c, s, s.ffn > 0, fmt::format("intermediate_size {}", s.ffn));
  return s;
}

std::string Qwen3Family::hf_model_type(const ModelSpec& s) const {
  auto refuse = [](const char* what) {
    return DataError(fmt::format("Qwen3ForCausalLM (qwen3) cannot hold {}", what));
  };
  if (!s.qk_norm) throw refuse("attention without QK norm");
  if (s.qkv_bias) throw refuse("QKV bias");
  if (s.sliding_window > 0) throw refuse("a sliding window");
  return "qwen3";
}

nlohmann::ordered_json Qwen3Family::hf_config(const ModelSpec& s) const {
  nlohmann::ordered_json j = hf_decoder_config(s, "Qwen3ForCausalLM", hf_model_type(s));
  j["intermediate_size"] = s.ffn;
  write_hf_rope(j, s.rotary_base, hf_llama3_rope(s));
  j["attention_bias"] = false;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = s.num_layers;
  j["use_cache"] = true;
  return j;
}

std::vector<HfTensorPiece> Qwen3Family::hf_pieces(const ParamInfo& p,
                                                  const ModelSpec& /*s*/) const {
  return hf_decoder_pieces(p);
}

}  // namespace tessera
