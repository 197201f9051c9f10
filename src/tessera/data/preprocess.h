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
//
// With `chat`, every input is JSON lines of conversations (data/chat.h: `messages`, or
// `prompt` and `completion`), rendered with the tokenizer's chat template and written to
// {output_prefix}_chat_document (tokens, no end-of-document token: a conversation ends with
// its closing token) and, aligned with it, {output_prefix}_chat_document_roles (a uint8
// TokenRole per token, from which training makes its loss mask). A sample longer than
// `seq_length` (when set) is refused, truncated or dropped as `overlong` says.
//
// With `preference`, every line is a preference pair (TRL's prompt, chosen and rejected;
// ChatFormat::encode_preference), written as two documents in a row to
// {output_prefix}_preference_document and its roles: the prompt with the chosen answer, then
// with the rejected one. A pair with a side over `seq_length` is refused, cut (both sides) or
// dropped (both sides).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/data/indexed_dataset.h"

namespace tessera {

enum class OverlongPolicy { Error, Truncate, Drop };

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::vector<std::string> json_keys = {"text"};
  DataConfig tokenizer;  // tokenizer_type and tokenizer_model
  int workers = 1;
  bool append_eod = true;
  bool chat = false;
  bool preference = false;  // preference pairs: as chat, two documents per line
  int64_t seq_length = 0;  // chat: the longest sample kept whole (0: any length)
  OverlongPolicy overlong = OverlongPolicy::Error;
};

struct PreprocessOutput {
  std::string prefix;  // {output_prefix}_{key}_document
  uint64_t documents = 0, tokens = 0;
  uint64_t empty_documents = 0;  // skipped: no tokens
  uint64_t truncated = 0, dropped = 0;  // chat: samples longer than seq_length
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
// write that fails, InvalidDataError for a conversation that is not one (chat) or a sample
// over seq_length under OverlongPolicy::Error; no output is left then, nor the directories
// made for it.
PreprocessStats preprocess(
    const PreprocessOptions& options,
    const std::function<void(uint64_t, uint64_t, uint64_t)>& progress = nullptr);

}  // namespace tessera
