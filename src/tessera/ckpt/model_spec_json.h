#pragma once
// A ModelSpec as JSON (in checkpoints' trainer_state.json) and the comparison of two specs,
// worded with the config keys a user would change.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/model/model_spec.h"

namespace tessera {

nlohmann::json spec_to_json(const ModelSpec& spec);
// Throws DataError naming `file`, the field and what was expected when a field is missing,
// has the wrong type or a size beyond any model (require_model_size).
ModelSpec spec_from_json(const nlohmann::json& j, const std::string& file);

// Throws DataError naming `file` when `spec` describes more parameters than any model has
// (2^48): a damaged or forged description, checked before a layout is built from it.
void require_model_size(const ModelSpec& spec, const std::string& file);

struct SpecDifferences {
  // Differences that change tensor shapes: weights cannot be loaded across them.
  std::vector<std::string> shape;
  // Differences that change what the same weights compute (RoPE, norm epsilon, window).
  std::vector<std::string> behaviour;
};

// Each difference reads "hidden_size: 64 in <found_label>, 32 configured".
SpecDifferences compare_specs(const ModelSpec& found, const ModelSpec& configured,
                              const std::string& found_label);

// Joins lines with "; ".
std::string join_lines(const std::vector<std::string>& lines);

}  // namespace tessera
