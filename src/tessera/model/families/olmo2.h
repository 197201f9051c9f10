#pragma once
// The OLMo 2 family (AI2's OLMo-2-1124-7B and -13B): a decoder whose blocks norm the
// mixer's output instead of its input (out = x + norm(f(x)): post-norms, no pre-norms), and
// whose attention normalises all of q and all of k with one RMSNorm each (over every head's
// values together) before RoPE. SwiGLU MLP, untied head. Hugging Face: Olmo2ForCausalLM,
// whose post_attention_layernorm and post_feedforward_layernorm are the two post-norms.
#include "tessera/model/model_family.h"

namespace tessera {

class Olmo2Family final : public ModelFamily {
 public:
  std::string_view name() const override { return "olmo2"; }
  std::string_view covers() const override { return "OLMo 2 (OLMo-2-1124-7B and -13B)"; }
  ModelSpec make_spec(const Experiment& e) const override;
  std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                   int64_t layer) const override;
  std::string features(const ModelSpec& s) const override;
  std::string spec_problem(const ModelSpec& s) const override;

  std::vector<std::string> hf_model_types() const override { return {"olmo2"}; }
  ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const override;
  std::string hf_model_type(const ModelSpec& s) const override;
  nlohmann::ordered_json hf_config(const ModelSpec& s) const override;
  std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const override;
};

const ModelFamily& olmo2_family();

}  // namespace tessera
