#pragma once
// The adapters of a LoRA run (model/lora_model.h) as a parameter layout, without a device:
// what the model allocates, checkpoints describe and the memory planner counts. One unit per
// unit of the base layout (empty where the base unit has no adapted projection), so a layer's
// adapters are reduced when its backward ends; each adapted piece of a projection (fused q, k,
// v and gate, up hold several) gets lora_A (rank, in) and lora_B (out, rank), named as peft
// names them ("model.layers.0.self_attn.q_proj.lora_A.weight"). Under tensor parallelism
// each rank holds its part of the factor that splits with the weight (B of a column-parallel
// weight, A of a row-parallel one) and the whole other factor.
#include <optional>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"

namespace tessera {

struct LoraOptions {
  int64_t rank = 16;
  double alpha = 32;
  // Hugging Face projection names (config/lora_targets.h) that get adapters.
  std::vector<std::string> targets;
  double scale() const { return alpha / static_cast<double>(rank); }
  bool operator==(const LoraOptions&) const = default;
};

// One adapted piece: the base weight (base layout index), the rows of it that are the piece,
// and its adapters (adapter layout indices).
struct LoraAdapted {
  int base_weight = -1;
  int64_t row0 = 0, rows = 0, cols = 0;
  int a = -1, b = -1;
};

struct LoraLayout {
  ParamLayout adapters;
  std::vector<LoraAdapted> adapted;
};

// The run's LoRA (lora_rank, lora_alpha, lora_target_modules), or none when lora_rank is 0.
std::optional<LoraOptions> lora_options(const TrainingConfig& t);

// Throws ConfigError when no projection of `spec`'s model is among the targets.
LoraLayout make_lora_layout(const ModelSpec& spec, const ParamLayout& base, const LoraOptions& options);

}  // namespace tessera
