#pragma once
// A model family (torchtitan's TrainSpec): everything that differs between Llama-like dense
// models, Mixtral, DeepSeek and Qwen3-MoE, behind one interface, so that the trainer, the
// memory planner, checkpoints and benchmarks never name a family:
//   spec builder       the experiment's model keys -> ModelSpec, with the family's checks;
//   layer blocks       which blocks (model/block.h) each decoder layer has, which fixes the
//                      parameter layout, the activations (hence the memory plan, computed
//                      from the same declarations the model allocates with) and the
//                      parallelize rules (each parameter's TensorParallelStyle);
//   Hugging Face       config.json <-> ModelSpec and the tensor names of each parameter.
// A new family is its own files under model/families/ plus one line in model_family.cpp.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/config/config.h"
#include "tessera/model/block.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"

namespace tessera {

// One Hugging Face tensor inside a Tessera parameter: rows starting at element `offset`.
struct HfTensorPiece {
  std::string name;
  int64_t offset = 0;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// One tensor of state kept outside the parameters, by Tessera's name and Hugging Face's.
struct HfStateTensor {
  std::string state;
  HfTensorPiece tensor;
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  // The value of the model_family key: "llama".
  virtual std::string_view name() const = 0;
  // What it covers, for help texts: "Llama 2/3/3.1/3.3, Qwen 2.5, Mistral".
  virtual std::string_view covers() const = 0;

  // The experiment's model with derived sizes filled in; the caller sets the vocabulary.
  // Throws ConfigError naming the key of a combination the family cannot build.
  virtual ModelSpec make_spec(const Experiment& e) const = 0;
  virtual std::vector<std::unique_ptr<Block>> layer_blocks(const ModelSpec& s,
                                                           int64_t layer) const = 0;
  // The features a one-line summary lists after the sizes (", qkv bias, sliding window 4096").
  virtual std::string features(const ModelSpec& s) const = 0;
  // Why the family cannot build `s`, a spec read from a file (a checkpoint's description)
  // rather than made by make_spec; empty when it can. Checked before its blocks are made.
  virtual std::string spec_problem(const ModelSpec& s) const {
    (void)s;
    return "";
  }

  // ---- Hugging Face ----
  // The config.json model_type values it reads ("llama", "qwen2", "mistral").
  virtual std::vector<std::string> hf_model_types() const = 0;
  // The model a config.json (`file`, for messages) describes; DataError naming the file and
  // field for a missing field or an unsupported feature.
  virtual ModelSpec read_hf_config(const nlohmann::json& config, const std::string& file) const = 0;
  // The model_type `s` is exported as; DataError when none fits.
  virtual std::string hf_model_type(const ModelSpec& s) const = 0;
  // config.json for `s`, without torch_dtype (the exporter adds it).
  virtual nlohmann::ordered_json hf_config(const ModelSpec& s) const = 0;
  // The Hugging Face tensors parameter `p` holds, in the order they are stacked.
  virtual std::vector<HfTensorPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) const = 0;
  // State Tessera keeps outside the parameters (Block::state_width: checkpoints and
  // Model::persistent_state hold it) that this family's Hugging Face models store as tensors:
  // DeepSeek-V3's expert bias. Each is Tessera's state name ("model.layers.3.mlp.router.
  // expert_bias") and the Hugging Face tensor (offset unused); stored as fp32.
  virtual std::vector<HfStateTensor> hf_state(const ModelSpec& s) const {
    (void)s;
    return {};
  }
};

// The registered family called `name`, or null.
const ModelFamily* find_model_family(std::string_view name);
// The family of a spec (spec.family was checked when the spec was made).
const ModelFamily& model_family(std::string_view name);
// "llama, mixtral, ..." for messages.
std::string model_family_names();
// Every model_type a registered family reads, for messages: "llama, qwen2 or mistral".
std::string hf_model_type_names();
// The family that reads config.json files of `model_type`, or null.
const ModelFamily* model_family_for_hf_type(std::string_view model_type);

}  // namespace tessera
