#pragma once
// Hugging Face model directories: config.json <-> ModelSpec, and weights in
// model.safetensors or shards listed by model.safetensors.index.json <-> Tessera's flat
// layout. The files are read and written here; what a config.json means and which Hugging
// Face tensors each parameter holds is the model family's (ModelFamily, found by the config's
// model_type: llama, qwen2, mistral for the Llama family).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"
#include "tessera/ops/backend.h"

namespace tessera {

// The model config.json in `dir` describes, and its model_type. Throws DataError naming
// config.json and the field for a missing field or an unsupported model type or feature.
ModelSpec read_hf_config(const std::string& dir, std::string* model_type = nullptr);

// config.json for `spec` with weights stored as `dtype`.
nlohmann::ordered_json hf_config_json(const ModelSpec& spec, DType dtype);

class HfWeightFiles;

// A Hugging Face model directory, checked when opened: config.json describes a supported
// model and every tensor it needs is present with the right shape and a dtype of F32, BF16
// or F16, and none is left over. Weights are read one parameter at a time, on demand.
// Every problem is a DataError naming the file and tensor.
class HfModelReader {
 public:
  explicit HfModelReader(const std::string& dir);
  ~HfModelReader();

  const ModelSpec& spec() const { return spec_; }
  const std::string& model_type() const { return model_type_; }
  const ParamLayout& layout() const { return layout_; }
  // fp32 values of a parameter of layout(), with q/k/v and gate/up fused.
  std::vector<float> weights(const ParamInfo& p) const;

 private:
  std::string model_type_;
  ModelSpec spec_;
  ParamLayout layout_;
  std::unique_ptr<HfWeightFiles> files_;
};

// Loads the Hugging Face model in `dir` into fp32 slices of the flat layout `layout` (an
// optimizer's master weights) after checking that it is the `configured` model (DataError
// naming config.json and each differing key otherwise). Returns the differences that only
// change behaviour (RoPE, epsilon, window), for warnings.
std::vector<std::string> load_hf_weights(const std::string& dir, const ModelSpec& configured,
                                         const ParamLayout& layout, Backend& backend,
                                         const std::vector<FlatSlice>& master);

struct HfExportOptions {
  DType dtype = DType::BF16;                // BF16 or F32
  uint64_t shard_bytes = 5'000'000'000ull;  // Hugging Face's default "5GB"
};

// Writes `out_dir` as a Hugging Face model directory: config.json and model.safetensors,
// or model-0000k-of-0000n.safetensors shards and model.safetensors.index.json when the
// weights exceed one shard. weights(param) gives each parameter's fp32 values. Written
// into out_dir + ".tmp" and renamed when complete.
void write_hf_model(const std::string& out_dir, const ModelSpec& spec,
                    const std::function<std::vector<float>(const ParamInfo&)>& weights,
                    const HfExportOptions& options);

}  // namespace tessera
