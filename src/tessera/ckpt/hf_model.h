#pragma once
// Hugging Face model directories (Llama, Qwen2, Mistral): config.json <-> ModelSpec, and
// weights in model.safetensors or shards listed by model.safetensors.index.json <->
// Tessera's flat layout. Hugging Face keeps q/k/v and gate/up as separate tensors; Tessera
// fuses them along the output dimension (rows), so each fused tensor is its Hugging Face
// pieces stacked in order. Both use rotate-half RoPE, so no weight permutation is needed.
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

enum class HfArchitecture { Llama, Qwen2, Mistral };

// The model config.json in `dir` describes. Throws DataError naming config.json and the
// field for a missing field or an unsupported architecture or feature.
ModelSpec read_hf_config(const std::string& dir, HfArchitecture* arch = nullptr);

// The architecture an exported model is written as: qwen2 with QKV bias, mistral with a
// sliding window, else llama. Throws DataError when no supported architecture fits.
HfArchitecture hf_architecture_for(const ModelSpec& spec);
const char* hf_model_type(HfArchitecture arch);

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
  HfArchitecture architecture() const { return arch_; }
  const ParamLayout& layout() const { return layout_; }
  // fp32 values of a parameter of layout(), with q/k/v and gate/up fused.
  std::vector<float> weights(const ParamInfo& p) const;

 private:
  ModelSpec spec_;
  HfArchitecture arch_;
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
