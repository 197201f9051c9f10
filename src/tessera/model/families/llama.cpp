#include "tessera/model/families/llama.h"

#include <fmt/format.h>

#include "tessera/model/families/decoder_spec.h"
#include "tessera/model/blocks/gqa_attention.h"
#include "tessera/model/blocks/swiglu_mlp.h"

namespace tessera {

ModelSpec LlamaFamily::make_spec(const Experiment& e) const {
  const ModelConfig& m = e.model_config;
  if (m.num_experts > 0)
    reject_model_key(e, "num_experts",
                     "0 with model_family llama (a dense model; docs/models.md lists the families "
                     "with experts)");
  if (m.multi_latent_attention)
    reject_model_key(e, "multi_latent_attention",
                     "false with model_family llama (grouped-query attention)");
  if (m.qk_layernorm)
    reject_model_key(e, "qk_layernorm",
                     "false with model_family llama (Llama, Qwen 2.5 and Mistral have no QK "
                     "norm)");
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
