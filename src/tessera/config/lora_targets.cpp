#include "tessera/config/lora_targets.h"

#include <algorithm>
#include <set>
#include <utility>

#include "tessera/core/error.h"

namespace tessera {

namespace {
const std::vector<std::string> kProjections = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};
}  // namespace

std::vector<std::string> lora_targets(const std::string& value) {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kMegatron = {
      {"linear_qkv", {"q_proj", "k_proj", "v_proj"}},
      {"linear_proj", {"o_proj"}},
      {"linear_fc1", {"gate_proj", "up_proj"}},
      {"linear_fc2", {"down_proj"}}};
  std::set<std::string> chosen;
  size_t at = 0;
  while (at <= value.size()) {
    size_t comma = value.find(',', at);
    if (comma == std::string::npos) comma = value.size();
    std::string name = value.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    at = comma + 1;
    if (name.empty()) continue;
    if (name == "all-linear") {
      chosen.insert(kProjections.begin(), kProjections.end());
      continue;
    }
    if (std::find(kProjections.begin(), kProjections.end(), name) != kProjections.end()) {
      chosen.insert(name);
      continue;
    }
    const auto m = std::find_if(kMegatron.begin(), kMegatron.end(),
                                [&](const auto& e) { return e.first == name; });
    if (m == kMegatron.end())
      throw ConfigError("configuration", "lora_target_modules", value,
                        "comma-separated projections: q_proj, k_proj, v_proj, o_proj, gate_proj, "
                        "up_proj, down_proj (or Megatron's linear_qkv, linear_proj, linear_fc1, "
                        "linear_fc2), or all-linear; '" + name + "' is none of them");
    chosen.insert(m->second.begin(), m->second.end());
  }
  if (chosen.empty())
    throw ConfigError("configuration", "lora_target_modules", value, "at least one projection");
  std::vector<std::string> out;  // in the layer's order
  for (const std::string& p : kProjections)
    if (chosen.count(p)) out.push_back(p);
  return out;
}

}  // namespace tessera
