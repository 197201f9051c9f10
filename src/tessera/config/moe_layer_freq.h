#pragma once
// Megatron's moe_layer_freq: which decoder layers are MoE layers.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

// One flag per layer (true: MoE) from `text`, which is either an integer N >= 1 (layer i is
// MoE when i % N == 0, so 1 makes every layer MoE) or Megatron's Python list, one 0/1 entry
// per layer, written literally or as list arithmetic: "[1,0,1,0]", "[0]*3+[1]*27",
// "([0]*1+[1]*26)". nullopt with *error describing what was expected otherwise (a malformed
// list, an entry other than 0 or 1, or a length other than num_layers).
std::optional<std::vector<bool>> parse_moe_layer_freq(std::string_view text, int64_t num_layers,
                                                      std::string* error);

}  // namespace tessera
