#include "tessera/data/tokenizer.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/core/parallel_for.h"
#include "tessera/data/bpe_tokenizer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

}  // namespace

void Tokenizer::encode_batch(std::span<const std::string_view> texts,
                             std::vector<std::vector<int32_t>>* out, int num_threads) const {
  out->resize(texts.size());
  parallel_for(texts.size(), [&](size_t i) {
    (*out)[i].clear();
    encode(texts[i], &(*out)[i]);
  }, num_threads > 0 ? static_cast<size_t>(num_threads) : 0);
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

void NullTokenizer::encode(std::string_view text, std::vector<int32_t>* out) const {
  size_t at = 0;
  while (true) {
    at = text.find_first_not_of(" \t\r\n", at);
    if (at == std::string_view::npos) return;
    const size_t end = std::min(text.find_first_of(" \t\r\n", at), text.size());
    const std::string_view word = text.substr(at, end - at);
    int64_t id = -1;
    const auto [p, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
    if (ec != std::errc() || p != word.data() + word.size() || id < 0 || id >= vocab_size())
      throw DataError(fmt::format(
          "NullTokenizer: '{}' is not a token id: expected decimal ids from 0 to {} separated by "
          "whitespace (the text of NullTokenizer data is its ids)",
          word, vocab_size() - 1));
    out->push_back(static_cast<int32_t>(id));
    at = end;
  }
}

std::string NullTokenizer::decode(const std::vector<int32_t>& ids) const {
  return fmt::format("{}", fmt::join(ids, " "));
}

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& data, int64_t vocab_size) {
  switch (data.tokenizer_type) {
    case TokenizerType::ByteLevel:
      return std::make_unique<ByteTokenizer>();
    case TokenizerType::Null:
      if (vocab_size <= 0)
        throw ConfigError("configuration", "vocab_size", std::to_string(vocab_size),
                          "a positive size with tokenizer_type NullTokenizer");
      return std::make_unique<NullTokenizer>(vocab_size);
    case TokenizerType::Gpt2Bpe:
      return BpeTokenizer::from_gpt2_files(data.vocab_file, data.merge_file);
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
