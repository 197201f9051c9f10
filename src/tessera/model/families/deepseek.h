#pragma once
// The DeepSeek family (model_family deepseek): DeepSeek-V2 (V2-Lite) and DeepSeek-V3. Every
// layer is multi-head latent attention (model/blocks/mla_attention.h) then, where
// moe_layer_freq says so, an MoE MLP with routed and shared experts (model/blocks/moe_mlp.h),
// else the dense SwiGLU (the first_k_dense_replace layers). RoPE is DeepSeek's YaRN unless
// rope_type is rope. V2 routes with a softmax over all experts (pre-softmax top-k); V3 with
// sigmoid scores, group-limited top-k, an expert bias and scaled weights: one family, the
// presets differ in keys only.
#include "tessera/model/model_family.h"

namespace tessera {

class DeepseekFamily final : public ModelFamily {
 public:
  std::string_view name() const override { return "deepseek"; }
  std::string_view covers() const override { return "DeepSeek-V2 (V2-Lite), DeepSeek-V3"; }
  ModelSpec make_spec(const Experiment& e) const override;
  std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                   int64_t layer) const override;
  std::string features(const ModelSpec& s) const override;
  // Every layer is multi-latent attention: a spec without it is no DeepSeek model.
  std::string spec_problem(const ModelSpec& s) const override;

  // deepseek_hf.cpp: DeepseekV3ForCausalLM (sigmoid routing, and dense models) and
  // DeepseekV2ForCausalLM (softmax routing).
  std::vector<std::string> hf_model_types() const override {
    return {"deepseek_v3", "deepseek_v2"};
  }
  ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const override;
  std::string hf_model_type(const ModelSpec& s) const override;
  nlohmann::ordered_json hf_config(const ModelSpec& s) const override;
  std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const override;
  // DeepSeek-V3's mlp.gate.e_score_correction_bias of each MoE layer: the expert bias.
  std::vector<HfStateTensor> hf_state(const ModelSpec& s) const override;
};

const ModelFamily& deepseek_family();

}  // namespace tessera
