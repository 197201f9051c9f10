#pragma once
// The weights of a model to read (generate, convert): a Tessera checkpoint, or a Hugging Face
// model directory. A LoRA run's checkpoint holds adapters only: it stands for its base (the
// pretrained_checkpoint or hf_init_path that run recorded) with W + (alpha / r) B A merged
// into every adapted projection, which is what weights() returns.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/hf_model.h"

namespace tessera {

class ModelSource {
 public:
  // A Hugging Face directory (holding config.json), or a checkpoint directory or save
  // directory (its latest checkpoint). Throws DataError when `path` is neither, and for a
  // LoRA checkpoint whose recorded base is missing.
  static ModelSource open(const std::string& path);
  static ModelSource open_hf(const std::string& dir);
  static ModelSource open_checkpoint(const std::string& path);
  ModelSource(ModelSource&&) noexcept;
  ~ModelSource();

  const std::string& name() const { return name_; }
  // The Tessera checkpoint read (the adapters' one for LoRA); null for a Hugging Face model.
  const Checkpoint* checkpoint() const { return checkpoint_.get(); }
  const ModelSpec& spec() const;
  // fp32 values of parameter p of the model's one-device layout.
  std::vector<float> weights(const ParamInfo& p) const;
  // Model state outside the parameters (the expert bias) by name; empty where the source
  // keeps none (its initial zeros).
  std::vector<float> state(const std::string& name) const;
  // Every state the model has that the source keeps.
  std::vector<std::pair<std::string, std::vector<float>>> all_state() const;

 private:
  ModelSource() = default;
  std::string name_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<HfModelReader> hf_;
  std::unique_ptr<ModelSource> lora_base_;  // a LoRA checkpoint's base
  ParamLayout base_layout_;                 // the model's, which lora_ adapts
  LoraLayout lora_;
};

}  // namespace tessera
