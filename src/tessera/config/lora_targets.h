#pragma once
// The projections a lora_target_modules value names (model/lora_model.h adapts them).
#include <string>
#include <vector>

namespace tessera {

// Hugging Face's names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj),
// Megatron's (linear_qkv: q, k and v; linear_proj: o_proj; linear_fc1: gate and up;
// linear_fc2: down_proj) or all-linear (every projection of the decoder layers), comma
// separated; returned as Hugging Face's names in a layer's order. Throws ConfigError naming an
// unknown one.
std::vector<std::string> lora_targets(const std::string& value);

}  // namespace tessera
