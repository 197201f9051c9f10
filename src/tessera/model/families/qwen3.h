#pragma once
// The Qwen3 family (dense): Qwen3-0.6B to 32B. A Llama-shaped decoder whose attention
// normalises each query and key head with RMSNorm before RoPE (q_norm and k_norm of head_dim,
// shared by the heads), without QKV bias; head_dim is its own size (128), not hidden / heads.
// Qwen3-4B and smaller tie the output head to the embedding. Hugging Face: Qwen3ForCausalLM.
#include "tessera/model/model_family.h"

namespace tessera {

class Qwen3Family final : public ModelFamily {
 public:
  std::string_view name() const override { return "qwen3"; }
  std::string_view covers() const override { return "Qwen3 dense (Qwen3-0.6B to 32B)"; }
  ModelSpec make_spec(const Experiment& e) const override;
  std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                   int64_t layer) const override;
  std::string features(const ModelSpec& s) const override;
  std::string spec_problem(const ModelSpec& s) const override;

  std::vector<std::string> hf_model_types() const override { return {"qwen3"}; }
  ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const override;
  std::string hf_model_type(const ModelSpec& s) const override;
  nlohmann::ordered_json hf_config(const ModelSpec& s) const override;
  std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const override;
};

const ModelFamily& qwen3_family();

}  // namespace tessera
