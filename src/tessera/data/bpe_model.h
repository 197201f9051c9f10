#pragma once
// The model of a Hugging Face BPE tokenizer: the vocabulary, the merges ranked by their order
// in tokenizer.json, and the merge loop that turns one pre-token into ids.
//
// Byte-level models (GPT-2, Llama 3, Qwen) spell tokens in GPT-2's printable stand-ins for
// bytes ("Ġ" for a space); this class converts them back at load time, so words are raw bytes
// and a word is looked up without re-encoding it. Character-level models (SentencePiece
// conversions such as Llama 2) merge Unicode characters and fall back to <0xNN> byte tokens,
// or to the unknown token, for characters outside the vocabulary.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera {

struct BpeModelOptions {
  bool byte_level = true;
  bool ignore_merges = false;  // a word that is itself a vocabulary entry skips the merges
  bool byte_fallback = false;  // unknown characters become <0xNN> tokens, if all 256 exist
  bool fuse_unk = false;       // a run of unknown characters becomes one unknown token
  std::string unk_token;       // empty: none
};

class BpeModel {
 public:
  // vocab: (token as written in tokenizer.json, id); merges: pairs of such tokens, best first.
  // Throws DataError naming `source` when they are inconsistent (a merge of unknown tokens, a
  // byte-level vocabulary missing a byte, no way to encode an unknown character).
  BpeModel(const BpeModelOptions& options,
           const std::vector<std::pair<std::string_view, int32_t>>& vocab,
           const std::vector<std::pair<std::string_view, std::string_view>>& merges,
           const std::string& source);
  ~BpeModel();
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one word (a pre-token; raw bytes, any of them allowed). Thread-safe;
  // results are cached in a cache all threads share.
  void encode_word(std::string_view word, std::vector<int32_t>* out) const;

  // One past the largest id of the vocabulary.
  int32_t id_end() const { return static_cast<int32_t>(words_.size()); }
  // The word that encodes to id alone (raw bytes for byte-level models); empty for ids
  // missing from the vocabulary.
  const std::string& word(int32_t id) const { return words_[static_cast<size_t>(id)]; }
  // The id of a token as written in tokenizer.json.
  std::optional<int32_t> find_token(std::string_view token) const;
  // The byte a <0xNN> byte-fallback token stands for, or -1 when id is none.
  int fallback_byte(int32_t id) const;

 private:
  // Open-addressing hash tables (linear probing, power-of-two sizes): words to ids, and
  // (left, right) id pairs to the merge's rank and result.
  struct WordSlot {
    uint64_t head;  // the word's first 8 bytes, zero-padded: short words match without words_
    uint32_t tag;   // hash bits above the low byte, which holds the length (capped at 255)
    int32_t id;     // -1: empty
  };
  struct MergeSlot {
    uint64_t pair;  // left << 32 | right; kNoPair: empty
    int32_t rank;
    int32_t merged;
  };

  std::optional<int32_t> find_word(std::string_view word) const;
  void add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);
  const MergeSlot* find_merge(int32_t left, int32_t right) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>* symbols) const;
  void merge(std::vector<int32_t>* symbols) const;

  struct WordCache;

  BpeModelOptions options_;
  std::unique_ptr<WordCache> cache_;
  std::vector<std::string> words_;
  std::vector<WordSlot> word_slots_;
  std::vector<MergeSlot> merge_slots_;
  int32_t byte_ids_[256];      // byte-level: the token of each single byte
  int32_t fallback_ids_[256];  // character-level: <0x00>..<0xFF>, or -1
  int32_t unk_id_ = -1;
};

}  // namespace tessera
