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

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/data/bpe_tokenizer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

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
