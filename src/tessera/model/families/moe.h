#pragma once
// The MoE families (docs/moe.md): decoder layers of a GQA attention block and, where
// moe_layer_freq says so, an MoE MLP block (model/blocks/moe_mlp.h), else the dense SwiGLU.
//   mixtral    Mixtral 8x7B / 8x22B
//   qwen3_moe  Qwen3-MoE (Qwen3-30B-A3B): the same with RMSNorm on each query and key head
// Both are one class; what differs is a few facts about the architecture.
#include "tessera/model/model_family.h"

namespace tessera {

struct MoeArchitecture {
  std::string_view name;    // the model_family key's value
  std::string_view covers;  // for help texts
  bool qk_norm = false;     // the architecture has QK norm (required) or not (refused)
  std::string_view hf_type;   // config.json's model_type
  std::string_view hf_class;  // its architectures entry
};

class MoeFamily final : public ModelFamily {
 public:
  explicit MoeFamily(MoeArchitecture arch) : arch_(arch) {}
  std::string_view name() const override { return arch_.name; }
  std::string_view covers() const override { return arch_.covers; }
  ModelSpec make_spec(const Experiment& e) const override;
  std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                   int64_t layer) const override;
  std::string features(const ModelSpec& s) const override;

  // Hugging Face (moe_hf.cpp): MixtralForCausalLM and Qwen3MoeForCausalLM, experts stored one
  // tensor per expert and projection as on the Hub (block_sparse_moe.experts.<e>.w1/w3/w2;
  // mlp.experts.<e>.gate_proj/up_proj/down_proj), the rest as the Llama family names it.
  std::vector<std::string> hf_model_types() const override { return {std::string(arch_.hf_type)}; }
  ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const override;
  std::string hf_model_type(const ModelSpec& s) const override;
  nlohmann::ordered_json hf_config(const ModelSpec& s) const override;
  std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const override;

 private:
  MoeArchitecture arch_;
};

const ModelFamily& mixtral_family();
const ModelFamily& qwen3_moe_family();

// The MoE keys of `e` (num_experts at least 1) as a MoeSpec: routing, losses, which layers are
// MoE; each routed expert's width defaults to the dense MLP's. ConfigError naming a bad
// moe_layer_freq.
MoeSpec moe_spec(const Experiment& e, int64_t dense_ffn);
// ", 8 experts top-2 (ffn 14336) in 32 of 32 layers, sigmoid router, ...": the MoE part of a
// model summary.
std::string moe_features(const ModelSpec& s);

}  // namespace tessera
