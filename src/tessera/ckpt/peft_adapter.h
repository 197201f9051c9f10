#pragma once
// LoRA adapters in peft's format, which `PeftModel.from_pretrained(base_model, dir)` loads:
// dir/adapter_config.json (peft_type LORA, r, lora_alpha, target_modules) and
// dir/adapter_model.safetensors with each adapter as "base_model.model." + its name
// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (r, in); lora_B (out, r)).
#include <functional>
#include <string>

#include "tessera/core/dtype.h"
#include "tessera/model/lora_layout.h"

namespace tessera {

inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

// fill(index, dst) writes adapter `index` of `adapters` (dtype, its shape) to host memory.
// Each file is written to a temporary name and renamed.
void write_peft_adapter(const std::string& dir, const LoraOptions& options, const ParamLayout& adapters,
                        DType dtype, const std::function<void(int index, void* dst)>& fill);

}  // namespace tessera
