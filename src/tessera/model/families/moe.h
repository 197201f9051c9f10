#pragma once
// The MoE families (docs/moe.md): decoder layers of a GQA attention block and, where
// moe_layer_freq says so, an MoE MLP block (model/blocks/moe_mlp.h), else the dense SwiGLU.
//   mixtral    Mixtral 8x7B / 8x22B
//   qwen3_moe  Qwen3-MoE (Qwen3-30B-A3B): the same with RMSNorm on each query and key head
// Both are one class; what differs is a few facts about the architecture.
#include "tessera/model/families/hf_decoder.h"
#include "tessera/model/model_family.h"

namespace tessera {

// How an architecture's Hugging Face config.json and checkpoints spell its model.
struct MoeHfSpelling {
  std::string_view model_type;  // config.json's model_type
  std::string_view hf_class;    // its architectures entry
  HfDecoderDefaults defaults;   // transformers' values for a missing shared field
  // The expert count's field; transformers versions have written the other name too.
  std::string_view experts_field, other_experts_field;
  // false: every layer is MoE and intermediate_size is the experts' width (Mixtral). true:
  // intermediate_size is the dense layers' width (default dense_ffn_default), the experts' is
  // moe_intermediate_size, and decoder_sparse_step and mlp_only_layers pick the MoE layers
  // (Qwen3-MoE).
  bool dense_layers = false;
  int64_t dense_ffn_default = 0;
  // The config says whether the top-k weights are renormalised (norm_topk_prob; false is
  // Megatron's pre-softmax); without it they always are.
  bool norm_topk_prob = false;
  // The config carries sliding_window; without it, use_sliding_window: true is refused.
  bool sliding_window = false;
  // The MoE MLP's module ("block_sparse_moe.") and an expert's projections ("w1", "w3", "w2").
  std::string_view moe_module, gate_proj, up_proj, down_proj;
};

struct MoeArchitecture {
  std::string_view name;    // the model_family key's value
  std::string_view covers;  // for help texts
  bool qk_norm = false;     // the architecture has QK norm (required) or not (refused)
  MoeHfSpelling hf;
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
  std::vector<std::string> hf_model_types() const override {
    return {std::string(arch_.hf.model_type)};
  }
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
