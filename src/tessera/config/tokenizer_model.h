#pragma once
// What a tokenizer_model value names: a shipped tokenizer, found under Tessera's data root
// (core/data_root.h: an install's share/tessera/tokenizers, or a checkout's npm packages), or a
// tokenizer.json path. Here, with the configuration, so that validation can check the value
// before anything is loaded; data/tokenizer.h loads it. Also the record of the tokenizer a
// dataset was made with, which validation compares with the run's.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

// The shipped tokenizer names tokenizer_model accepts (llama2, llama3, llama3.1, qwen3).
std::vector<std::string> shipped_tokenizer_names();

// Whether `tokenizer_model` names a tokenizer: a shipped name or an existing path (checked
// before anything runs; whether the file parses is found when it is loaded).
bool names_a_tokenizer(const std::string& tokenizer_model);
// What tokenizer_model expects, for error messages.
std::string tokenizer_model_expectation();

// The tokenizer.json that tokenizer_model names (see make_tokenizer). Throws DataError when a
// shipped name's file is not under the data root (the message names the path and the search)
// or a path does not exist.
std::string tokenizer_json_path(const std::string& tokenizer_model);

// The tokenizer_type key's spelling of a type: ByteLevel, HuggingFaceTokenizer.
std::string tokenizer_type_name(TokenizerType type);

// SHA-256 of a file as `sha256sum` prints it (Hugging Face shows the same digest for files it
// keeps in Git LFS). Throws DataError when the file cannot be read.
std::string file_sha256(const std::string& path);

// The tokenizer a dataset was made with, as `tessera preprocess` records it beside the
// dataset in PREFIX.meta.json. Token ids mean something only under the tokenizer that made
// them, and a name does not pin a tokenizer down (a path's file can change), so the record
// holds the tokenizer.json's content hash.
struct TokenizerRecord {
  TokenizerType tokenizer_type = TokenizerType::ByteLevel;
  std::string tokenizer_model;  // as given to preprocess; empty for ByteLevel
  int64_t vocab_size = 0;
  std::string tokenizer_json_sha256;  // empty for ByteLevel
};

std::string dataset_meta_path(const std::string& prefix);
std::string tokenizer_record_json(const TokenizerRecord& record);
// Dataset `prefix`'s record; none for datasets without PREFIX.meta.json (made by Megatron's
// tools or before Tessera wrote one). Throws DataError naming the file when it is not a record
// this Tessera reads (malformed, or a later version).
std::optional<TokenizerRecord> read_tokenizer_record(const std::string& prefix);
// "HuggingFaceTokenizer llama3 (vocabulary 128256, tokenizer.json sha256 c05a3c2174e9)".
std::string describe_tokenizer_record(const TokenizerRecord& record);

}  // namespace tessera
