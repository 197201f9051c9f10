#pragma once
// Text -> Megatron indexed dataset, as Megatron's tools/preprocess_data.py: every document is
// tokenized (in parallel) and written in input order, with an end-of-document token, to
// {output_prefix}_{key}_document.bin/.idx, one file pair per JSON key. Beside each pair,
// .meta.json records the tokenizer (config/tokenizer_model.h, TokenizerRecord), so that
// training refuses a run with a different one.
//
// Inputs, in the order given:
//   *.jsonl, *.json   one JSON object per line; each key names a string field (a list of
//                     strings is tokenized piece by piece and joined, as Megatron does)
//   a directory       one document per file: the Brown corpus's cXNN files, else *.txt
//   any other file    one document (Brown-corpus tags are recognised and removed)
// Documents without tokens are skipped.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/data/indexed_dataset.h"

namespace tessera {

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::vector<std::string> json_keys = {"text"};
  DataConfig tokenizer;  // tokenizer_type and tokenizer_model
  int workers = 1;
  bool append_eod = true;
};

struct PreprocessOutput {
  std::string prefix;  // {output_prefix}_{key}_document
  uint64_t documents = 0, tokens = 0;
  uint64_t empty_documents = 0;  // skipped: no tokens
};

struct PreprocessStats {
  uint64_t documents = 0;  // read: JSON lines and text files
  uint64_t tokens = 0;     // written, all keys, end-of-document tokens included
  uint64_t input_bytes = 0;
  double seconds = 0;
  TokenDType dtype = TokenDType::UInt16;
  std::string tokenizer;
  std::vector<PreprocessOutput> outputs;
};

// progress(bytes read so far, total input bytes, documents so far) is called after every
// batch of documents. Throws ConfigError for unusable options (an output prefix that cannot
// be written is found before any work) and for input without any text for a key, DataError
// (naming the file and line) for unreadable input or a JSON line without the key, or for a
// write that fails; no output is left then, nor the directories made for it.
PreprocessStats preprocess(
    const PreprocessOptions& options,
    const std::function<void(uint64_t, uint64_t, uint64_t)>& progress = nullptr);

}  // namespace tessera
