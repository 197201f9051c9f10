#pragma once
// A BPE tokenizer read from a Hugging Face tokenizer.json, giving the ids of the reference
// implementations (tested against @huggingface/tokenizers):
//   - byte-level BPE behind Split regex pre-tokenizers (Llama 3/3.1, Qwen 2.5/3) or GPT-2's
//     ByteLevel regex, with an optional NFC normalizer (Qwen);
//   - SentencePiece-style BPE over characters with <0xNN> byte fallback (Llama 2): normalizers
//     Prepend("▁") and Replace(" " -> "▁"), no pre-tokenizer.
// Added tokens (<|begin_of_text|>, <|im_start|>, ...) are matched in the raw text first,
// longest first (also those marked "normalized", which no supported model has). encode adds no BOS/EOS (the post-processor is not applied).
//
// decode is the exact inverse of encode: decode(encode(x)) == x for any bytes x, invalid
// UTF-8 included, except where the normalizer loses information (NFC; a literal "▁" read
// back as a space). For SentencePiece-style models the space the normalizer prepends to each
// stretch of text between added tokens is removed again.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/data/tokenizer.h"

namespace simdjson::dom {
class element;
}

namespace tessera {

class BpeModel;
class SplitRegex;

class BpeTokenizer final : public Tokenizer {
 public:
  // Loads tokenizer.json at path; label names it in name() (e.g. the shipped name "llama3").
  // Throws DataError naming the file and what was expected: missing, not JSON, a model other
  // than BPE, or a normalizer / pre-tokenizer / added-token option this class does not
  // implement (rather than tokenizing differently from the reference).
  BpeTokenizer(const std::string& path, const std::string& label);
  ~BpeTokenizer() override;
  // GPT-2's tokenizer as Megatron's GPT2BPETokenizer reads it: a vocab.json (token -> id) and a
  // merges.txt (one merge per line after its "#version" line), the byte-level BPE a
  // tokenizer.json of the same model holds. Throws DataError naming the file.
  static std::unique_ptr<BpeTokenizer> from_gpt2_files(const std::string& vocab_file,
                                                       const std::string& merge_file);

  std::string name() const override { return "HuggingFace(" + label_ + ")"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(decoded_.size()); }
  int32_t eod_id() const override { return eod_id_; }
  // The end-of-document token as tokenizer.json spells it ("<|end_of_text|>", "</s>", ...).
  const std::string& eod_token() const { return eod_token_; }
  void encode(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;

  // The id of a token as tokenizer.json spells it (added tokens included).
  std::optional<int32_t> token_to_id(std::string_view token) const;

 private:
  struct Normalizer {
    enum class Kind { Nfc, Prepend, Replace } kind;
    std::string text;         // Prepend: the prefix; Replace: the string replaced
    std::string replacement;  // Replace only
  };
  struct TrieNode {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;
  };
  struct AddedMatch {
    size_t pos = std::string_view::npos, size = 0;
    int32_t id = -1;
  };

  class JsonFields;  // reads one tokenizer.json; defined in the .cpp
  // A tokenizer.json's text, named `display` in messages.
  BpeTokenizer(const std::string& json_text, const std::string& display, const std::string& label,
               bool from_text);
  void load(const JsonFields& json, const simdjson::dom::element& doc);
  void read_normalizers(const JsonFields& json, const simdjson::dom::element& doc);
  void read_pre_tokenizers(const JsonFields& json, const simdjson::dom::element& doc);
  void read_model(const JsonFields& json, const simdjson::dom::element& doc);
  void read_added_tokens(const JsonFields& json, const simdjson::dom::element& doc);
  void prepare_decoding();
  void add_token_to_trie(std::string_view content, int32_t id);
  AddedMatch find_added(std::string_view text, size_t from) const;
  std::string_view normalize(std::string_view text, std::string* storage) const;
  void encode_section(std::string_view text, std::vector<int32_t>* out) const;

  std::string label_;
  std::unique_ptr<BpeModel> model_;
  bool byte_level_ = false;
  std::vector<Normalizer> normalizers_;
  std::vector<std::unique_ptr<SplitRegex>> splits_;  // byte-level: applied in order
  // Character-level: a word ends before each word_mark_ ("▁") that follows another character,
  // when no token spans such a point (true for Llama 2); empty: the whole text is one word.
  std::string word_mark_;

  std::vector<TrieNode> trie_;  // added tokens by content; node 0 is the root
  bool starts_added_[256] = {};
  std::vector<std::pair<std::string, int32_t>> added_;  // (content, id)

  std::vector<std::string> decoded_;  // by id: the bytes decode writes
  std::vector<bool> is_added_;        // by id
  std::string section_prefix_;        // decoded form of the Prepend normalizer's prefix
  int32_t eod_id_ = -1;
  std::string eod_token_;
};

}  // namespace tessera
