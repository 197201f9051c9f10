#pragma once
// Hugging Face model directories: config.json <-> ModelSpec, and weights in
// model.safetensors or shards listed by model.safetensors.index.json <-> Tessera's flat
// layout. The files are read and written here; what a config.json means and which Hugging
// Face tensors each parameter holds is the model family's (ModelFamily, found by the config's
// model_type: llama, qwen2, mistral for the Llama family).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/config/config.h"
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
  // fp32 values of a parameter of layout(), with q/k/v and gate/up fused. Throws DataError
  // naming the tensor when it holds NaN or infinity.
  std::vector<float> weights(const ParamInfo& p) const;
  // fp32 values of the model state called `name` (Model::persistent_state's names) where the
  // Hugging Face model stores it (ModelFamily::hf_state: DeepSeek-V3's expert bias): the
  // file's values, or zeros where the file lacks the tensor; empty for state it does not store.
  std::vector<float> state(const std::string& name) const;

 private:
  std::string model_type_;
  ModelSpec spec_;
  ParamLayout layout_;
  std::unique_ptr<HfWeightFiles> files_;
};

// The safetensors files of the Hugging Face model in `dir`, in name order (DataError when it
// has none).
std::vector<std::string> hf_weight_files(const std::string& dir);

// What load_hf_weights checks before it reads a value: config.json describes the weights and
// the `configured` model, and every tensor is present with its shape. Throws DataError. Run
// before a training run writes anything.
void check_hf_weights(const std::string& dir, const ModelSpec& configured);

// Loads the Hugging Face model in `dir` into fp32 slices of the flat layout `layout` (an
// optimizer's master weights), and the state it stores into the model's `state` tensors
// (Model::persistent_state: this rank's), after checking that it is the `configured` model
// (DataError naming config.json and each differing key otherwise; DataError naming the tensor
// for a trained expert bias that a model configured without one would drop). Returns the
// differences that only change behaviour (RoPE, epsilon, window), for warnings.
std::vector<std::string> load_hf_weights(const std::string& dir, const ModelSpec& configured,
                                         const ParamLayout& layout, Backend& backend,
                                         const std::vector<FlatSlice>& master,
                                         const std::vector<std::pair<std::string, Tensor>>& state);

// The tokenizer an export carries: the special token ids that config.json and
// generation_config.json hold, and the files transformers' AutoTokenizer loads.
struct HfTokenizer {
  std::string name;   // for messages: "llama3", a path, "ByteLevel"
  int64_t vocab = 0;  // ids run from 0 to vocab - 1
  std::optional<int32_t> bos_id, eos_id, pad_id;
  // tokenizer.json, copied byte for byte; empty: no tokenizer files (see no_files_reason).
  std::string tokenizer_json;
  // Without model_max_length, which is the exported model's max_position_embeddings.
  nlohmann::ordered_json tokenizer_config, special_tokens_map;
  std::string no_files_reason;
};

// The tokenizer of a run configured with `data` (tokenizer_type, tokenizer_model):
//   - a Hugging Face tokenizer.json (a shipped name or a path): the file itself;
//     tokenizer_config.json based on the tokenizer_config.json beside it when there is one
//     (the shipped packages have one): eos_token the run's end-of-document token
//     (BpeTokenizer::eod_id, what training appended to every document), tokenizer_class
//     PreTrainedTokenizerFast (which runs tokenizer.json as it is), the rest (bos, pad and unk
//     tokens, chat template) as that file has it; without one, bos is the token the
//     tokenizer's post-processor prepends, if any. special_tokens_map.json holds the same
//     tokens.
//   - Tessera's byte tokenizer: ids only (eos 256, no bos), no files: no tokenizer.json
//     encodes exactly like it (docs/checkpoints.md says why).
// Throws DataError naming the file when the tokenizer does not load or its tokenizer_config.json
// names a token the tokenizer does not have, ConfigError when tokenizer_model is empty.
HfTokenizer read_hf_tokenizer(const DataConfig& data);

struct HfExportOptions {
  DType dtype = DType::BF16;                // BF16 or F32
  uint64_t shard_bytes = 5'000'000'000ull;  // Hugging Face's default "5GB"
  // nullopt: config.json and the weights only, config.json without token ids.
  std::optional<HfTokenizer> tokenizer;
};

// The fp32 values of model state by name (Model::persistent_state's names); empty: none kept
// (the state's initial zeros).
using HfStateValues = std::function<std::vector<float>(const std::string& name)>;

// Writes `out_dir` as a Hugging Face model directory: config.json and model.safetensors,
// or model-0000k-of-0000n.safetensors shards and model.safetensors.index.json when the
// weights exceed one shard. weights(param) gives each parameter's fp32 values, state(name)
// the state the family's Hugging Face model stores (ModelFamily::hf_state), written in fp32
// whatever options.dtype is (null: zeros). With a
// tokenizer, config.json holds its bos/eos(/pad) ids, and generation_config.json (the same
// ids, greedy decoding) and its files are written too; a tokenizer with more ids than the
// model's vocabulary is a DataError. Written into out_dir + ".tmp" and renamed when complete.
void write_hf_model(const std::string& out_dir, const ModelSpec& spec,
                    const std::function<std::vector<float>(const ParamInfo&)>& weights,
                    const HfExportOptions& options, const HfStateValues& state = nullptr);

}  // namespace tessera
