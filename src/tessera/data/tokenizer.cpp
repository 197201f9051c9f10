#include "tessera/data/tokenizer.h"

namespace tessera {

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
    case TokenizerType::ByteLevel: return std::make_unique<ByteTokenizer>();
  }
  return nullptr;
}

}  // namespace tessera
