#pragma once
// Tokenizers turn text into ids. The byte-level tokenizer maps every UTF-8 byte to its own
// id (0-255) and reserves 256 for end-of-document, so any text round-trips exactly.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eod_id() const = 0;
  virtual void encode(std::string_view text, std::vector<int32_t>* out) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "ByteLevel"; }
  int64_t vocab_size() const override { return 257; }
  int32_t eod_id() const override { return 256; }
  void encode(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
};

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& data);

}  // namespace tessera
