#pragma once
// The Llama family: Llama 2/3/3.1/3.3, Qwen 2.5 (QKV bias) and Mistral (sliding window).
// Every layer is a GQA attention block then a dense SwiGLU MLP block; Hugging Face stores
// them as llama, qwen2 or mistral models.
#include "tessera/model/model_family.h"

namespace tessera {

class LlamaFamily final : public ModelFamily {
 public:
  std::string_view name() const override { return "llama"; }
  std::string_view covers() const override { return "Llama 2/3/3.1/3.3, Qwen 2.5, Mistral"; }
  ModelSpec make_spec(const Experiment& e) const override;
  std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                   int64_t layer) const override;
  std::string features(const ModelSpec& s) const override;

  // llama_hf.cpp
  std::vector<std::string> hf_model_types() const override { return {"llama", "qwen2", "mistral"}; }
  ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const override;
  std::string hf_model_type(const ModelSpec& s) const override;
  nlohmann::ordered_json hf_config(const ModelSpec& s) const override;
  std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const override;
};

const ModelFamily& llama_family();

}  // namespace tessera
