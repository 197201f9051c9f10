#include "tessera/ckpt/peft_adapter.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/safetensors.h"

namespace tessera {

void write_peft_adapter(const std::string& dir, const LoraOptions& options, const ParamLayout& adapters,
                        DType dtype, const std::function<void(int index, void* dst)>& fill) {
  namespace fs = std::filesystem;
  std::vector<SafetensorsTensor> tensors;
  for (const ParamInfo& p : adapters.params) {
    std::vector<int64_t> shape;
    for (int d = 0; d < p.shape.rank(); ++d) shape.push_back(p.shape[d]);
    tensors.push_back({"base_model.model." + p.name, dtype, shape, nullptr});
  }
  write_safetensors((fs::path(dir) / kPeftWeightsFile).string(), tensors, {{"format", "pt"}},
                    [&](size_t index, void* dst) { fill(static_cast<int>(index), dst); });
  // What peft's LoraConfig reads; the rest of its fields keep peft's defaults. Tessera's A
  // starts normal with std 1 / r and B at zero: peft's init_lora_weights "gaussian".
  const nlohmann::ordered_json config = {{"peft_type", "LORA"},
                                         {"task_type", "CAUSAL_LM"},
                                         {"base_model_name_or_path", nullptr},
                                         {"r", options.rank},
                                         {"lora_alpha", options.alpha},
                                         {"lora_dropout", 0.0},
                                         {"target_modules", options.targets},
                                         {"bias", "none"},
                                         {"fan_in_fan_out", false},
                                         {"use_rslora", false},
                                         {"use_dora", false},
                                         {"init_lora_weights", "gaussian"},
                                         {"modules_to_save", nullptr},
                                         {"inference_mode", true}};
  write_file_atomically((fs::path(dir) / kPeftConfigFile).string(), config.dump(2) + "\n");
}

}  // namespace tessera
