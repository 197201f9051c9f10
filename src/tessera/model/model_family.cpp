#include "tessera/model/model_family.h"

#include <algorithm>
#include <span>

#include "tessera/core/error.h"
#include "tessera/model/families/deepseek.h"
#include "tessera/model/families/llama.h"
#include "tessera/model/families/moe.h"
#include "tessera/model/families/olmo2.h"
#include "tessera/model/families/qwen3.h"

namespace tessera {
namespace {

// The registry: one line per family.
std::span<const ModelFamily* const> families() {
  static const ModelFamily* const all[] = {
      &llama_family(),
      &qwen3_family(),
      &olmo2_family(),
      &mixtral_family(),
      &qwen3_moe_family(),
      &deepseek_family(),
  };
  return all;
}

}  // namespace

const ModelFamily* find_model_family(std::string_view name) {
  for (const ModelFamily* f : families())
    if (f->name() == name) return f;
  return nullptr;
}

const ModelFamily& model_family(std::string_view name) {
  const ModelFamily* f = find_model_family(name);
  TS_CHECK(f != nullptr, "no model family '{}' (one of {})", name, model_family_names());
  return *f;
}

std::string model_family_names() {
  std::string names;
  for (const ModelFamily* f : families())
    names += (names.empty() ? "" : ", ") + std::string(f->name());
  return names;
}

std::string hf_model_type_names() {
  std::vector<std::string> types;
  for (const ModelFamily* f : families())
    for (const std::string& t : f->hf_model_types()) types.push_back(t);
  std::string names;
  for (size_t i = 0; i < types.size(); ++i)
    names += (i == 0 ? "" : i + 1 == types.size() ? " or " : ", ") + types[i];
  return names;
}

const ModelFamily* model_family_for_hf_type(std::string_view model_type) {
  for (const ModelFamily* f : families()) {
    const auto types = f->hf_model_types();
    if (std::find(types.begin(), types.end(), model_type) != types.end()) return f;
  }
  return nullptr;
}

}  // namespace tessera
