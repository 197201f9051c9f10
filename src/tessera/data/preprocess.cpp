#include "tessera/data/preprocess.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/core/parallel_for.h"
#include "tessera/data/chat.h"
#include "tessera/data/text_corpus.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace fs = std::filesystem;
namespace {

// A batch is tokenized in parallel and then written in order; its size bounds the memory
// in flight and how often progress is reported.
constexpr size_t kBatchBytes = 8u << 20;
constexpr size_t kBatchDocuments = 4096;

struct InputFile {
  std::string path;
  bool json_lines;
};

struct RawDocument {
  std::string json_line;  // empty for a text file, which the worker reads itself
  const InputFile* file;
  uint64_t line;  // of a JSON line
};

std::vector<InputFile> list_inputs(const std::vector<std::string>& inputs) {
  std::vector<InputFile> files;
  for (const std::string& in : inputs) {
    // The error_code forms: a name the file system refuses (over 255 bytes) is no input.
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      for (const std::string& f : list_text_files(in)) files.push_back({f, false});
    } else if (fs::is_regular_file(in, ec)) {
      const std::string ext = fs::path(in).extension().string();
      files.push_back({in, ext == ".jsonl" || ext == ".json"});
    } else {
      throw DataError(fmt::format("{}: no such file or directory (--input)", in));
    }
  }
  return files;
}

// Reads the inputs in order, a batch of documents at a time. JSON lines are read here; text
// files are only named, and read by the workers, since reading and de-tagging a Brown file
// costs about as much as tokenizing it.
class DocumentReader {
 public:
  explicit DocumentReader(const std::vector<InputFile>& files) : files_(files) {}

  bool next_batch(std::vector<RawDocument>* batch) {
    batch->clear();
    size_t bytes = 0;
    while (bytes < kBatchBytes && batch->size() < kBatchDocuments && file_ < files_.size()) {
      const InputFile& f = files_[file_];
      if (!f.json_lines) {
        batch->push_back({"", &f, 0});
        bytes_read_ += fs::file_size(f.path);
        bytes += fs::file_size(f.path);
        ++file_;
        continue;
      }
      if (!in_.is_open()) {
        in_.open(f.path, std::ios::binary);
        if (!in_) throw DataError(fmt::format("{}: cannot open for reading", f.path));
        line_ = 0;
      }
      std::string line;
      if (!std::getline(in_, line)) {
        in_.close();
        ++file_;
        continue;
      }
      ++line_;
      bytes_read_ += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      bytes += line.size();
      batch->push_back({std::move(line), &f, line_});
    }
    return !batch->empty();
  }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  const std::vector<InputFile>& files_;
  size_t file_ = 0;
  std::ifstream in_;
  uint64_t line_ = 0, bytes_read_ = 0;
};

// The length of the valid UTF-8 sequence at text[i] (1 to 4), or 0 when it is not one: a
// stray continuation byte, an overlong form, a surrogate or a code point past U+10FFFF.
size_t utf8_sequence_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  const size_t n = c >= 0xC2 && c <= 0xDF   ? 2
                   : c >= 0xE0 && c <= 0xEF ? 3
                   : c >= 0xF0 && c <= 0xF4 ? 4
                                            : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  // The second byte's range excludes overlong forms, surrogates and values past U+10FFFF.
  const unsigned char second = byte(i + 1);
  if ((c == 0xE0 && second < 0xA0) || (c == 0xED && second > 0x9F) ||
      (c == 0xF0 && second < 0x90) || (c == 0xF4 && second > 0x8F))
    return 0;
  return n;
}

// One JSON line as an object. Refused with the column and what is wrong there: a NUL byte
// (the JSON library would stop reading at it and accept what came before), bytes that are not
// UTF-8, or JSON that does not parse (a lone UTF-16 surrogate escape such as \ud800 among
// them); and a line that parses to anything but an object.
nlohmann::ordered_json parse_json_line(std::string_view line, const std::string& where) {
  for (size_t i = 0; i < line.size();) {
    if (line[i] == '\0')
      throw DataError(
          fmt::format("{}: a NUL byte at column {}; expected a line of JSON text (a "
                      "binary file?)",
                      where, i + 1));
    const size_t n = utf8_sequence_length(line, i);
    if (n == 0)
      throw DataError(
          fmt::format("{}: invalid UTF-8 at column {} (byte 0x{:02X}); expected JSON "
                      "lines in UTF-8",
                      where, i + 1, static_cast<unsigned char>(line[i])));
    i += n;
  }
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(line);
  } catch (const nlohmann::ordered_json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 12: syntax error while
    // parsing value - invalid string: surrogate U+D800..U+DBFF must be followed by
    // U+DC00..U+DFFF; last read: '...'": keep the reason, not the text read.
    std::string reason = e.what();
    reason = reason.substr(0, reason.find("; last read"));
    if (const size_t column = reason.find("column "); column != std::string::npos)
      reason.erase(0, reason.find(": ", column) + 2);
    if (const size_t dash = reason.find(" - "); dash != std::string::npos)
      reason.replace(dash, 3, ": ");
    if (reason.find("surrogate") != std::string::npos)
      reason = "a lone UTF-16 surrogate escape (" + reason + ")";
    throw DataError(fmt::format("{}: invalid JSON at column {}: {}", where, e.byte, reason));
  } catch (const nlohmann::ordered_json::out_of_range& e) {
    // "[json.exception.out_of_range.406] number overflow parsing '1e9999'": no position.
    const std::string what = e.what();
    throw DataError(fmt::format("{}: invalid JSON: {}", where, what.substr(what.find("] ") + 2)));
  }
  if (!j.is_object())
    throw DataError(fmt::format("{}: a JSON {}, not an object (JSON lines of objects expected)",
                                where, j.type_name()));
  return j;
}

// One document's outputs: ids[k] for every key k (empty when it has no text); for chat,
// ids[0] the tokens and ids[1] their roles.
struct EncodedDocument {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<int32_t>> rejected;  // preference pairs: the second document's
  bool truncated = false, dropped = false;
};

// Refusals of the user's data (InvalidDataError), bad JSON included.
template <class F>
auto user_data(F&& f) {
  try {
    return f();
  } catch (const InvalidDataError&) {
    throw;
  } catch (const DataError& e) {
    throw InvalidDataError(e.what());
  }
}

// Samples longer than options.seq_length: the error to throw, or whether to drop or cut them.
// `what` names them in the error ("the sample", "the chosen side").
bool over_length(const std::vector<ChatSample*>& samples, const PreprocessOptions& options,
                 const std::string& where, EncodedDocument* out) {
  for (ChatSample* s : samples) {
    const auto length = static_cast<int64_t>(s->ids.size());
    if (options.seq_length <= 0 || length <= options.seq_length) continue;
    if (options.overlong == OverlongPolicy::Error)
      throw InvalidDataError(fmt::format(
          "{}: {} has {} tokens, more than --seq-length {}; choose --overlong truncate "
          "(keep its first {} tokens) or --overlong drop (skip it), or a longer --seq-length",
          where, samples.size() == 1 ? "the sample" : s == samples[0] ? "the chosen side" : "the rejected side",
          length, options.seq_length, options.seq_length));
    if (options.overlong == OverlongPolicy::Drop) return out->dropped = true;
  }
  for (ChatSample* s : samples) {
    if (options.seq_length <= 0 || static_cast<int64_t>(s->ids.size()) <= options.seq_length) continue;
    out->truncated = true;
    s->ids.resize(static_cast<size_t>(options.seq_length));
    s->roles.resize(static_cast<size_t>(options.seq_length));
  }
  return false;
}

// A conversation's tokens and roles (with `preference`, a pair's two), over-long samples
// handled as options.overlong says.
void encode_chat(const RawDocument& doc, const ChatFormat& chat, const PreprocessOptions& options,
                 EncodedDocument* out) {
  const std::string where = fmt::format("{}:{}", doc.file->path, doc.line);
  const nlohmann::ordered_json line = user_data([&] { return parse_json_line(doc.json_line, where); });
  if (options.preference) {
    auto [chosen, rejected] = user_data([&] { return chat.encode_preference(line, where); });
    if (over_length({&chosen, &rejected}, options, where, out)) return;
    out->ids[0] = std::move(chosen.ids);
    out->ids[1].assign(chosen.roles.begin(), chosen.roles.end());
    out->rejected = {std::move(rejected.ids), {rejected.roles.begin(), rejected.roles.end()}};
    return;
  }
  ChatSample sample = user_data([&] { return chat.encode(line, where); });
  if (over_length({&sample}, options, where, out)) return;
  out->ids[0] = std::move(sample.ids);
  out->ids[1].assign(sample.roles.begin(), sample.roles.end());
}

// Tokenizes one document into out->ids[k] for every key k (empty when it has no text).
void encode_document(const RawDocument& doc, const std::vector<std::string>& keys,
                     const Tokenizer& tokenizer, const ChatFormat* chat,
                     const PreprocessOptions& options, EncodedDocument* out) {
  for (auto& v : out->ids) v.clear();
  out->rejected.clear();
  out->truncated = out->dropped = false;
  if (chat) {
    encode_chat(doc, *chat, options, out);
    return;
  }
  std::vector<std::vector<int32_t>>* ids = &out->ids;
  if (!doc.file->json_lines) {
    tokenizer.encode(read_text_document(doc.file->path), &(*ids)[0]);
  } else {
    const std::string where = fmt::format("{}:{}", doc.file->path, doc.line);
    const nlohmann::ordered_json j = parse_json_line(doc.json_line, where);
    for (size_t k = 0; k < keys.size(); ++k) {
      const auto it = j.find(keys[k]);
      if (it == j.end())
        throw DataError(
            fmt::format("{}: no key '{}' (choose the field with --json-keys)", where, keys[k]));
      if (it->is_string()) {
        tokenizer.encode(it->get_ref<const std::string&>(), &(*ids)[k]);
        continue;
      }
      // Megatron's pre-split form: a list of sentences, tokenized one by one.
      if (!it->is_array())
        throw DataError(
            fmt::format("{}: '{}' is not a string or a list of strings", where, keys[k]));
      for (const auto& piece : *it) {
        if (!piece.is_string())
          throw DataError(
              fmt::format("{}: '{}' is not a string or a list of strings", where, keys[k]));
        tokenizer.encode(piece.get_ref<const std::string&>(), &(*ids)[k]);
      }
    }
  }
  if (options.append_eod)
    for (auto& v : *ids)
      if (!v.empty()) v.push_back(tokenizer.eod_id());
}

// Refuses, before any work, an output prefix that cannot be written: without this a
// directory under a file aborted the run, and a read-only one failed only after everything
// was tokenized.
void check_output_location(const std::string& prefix, const std::vector<std::string>& keys) {
  // Files go into the nearest directory that exists, or into directories made under it.
  fs::path existing = fs::path(prefix).parent_path();
  std::error_code ec;
  while (!existing.empty() && !fs::exists(existing, ec)) existing = existing.parent_path();
  if (existing.empty()) existing = ".";
  if (!fs::is_directory(existing))
    throw ConfigError(
        "command line", "output-prefix", prefix,
        fmt::format("a path in a directory, but {} is not a directory", existing.string()));
  if (::access(existing.c_str(), W_OK | X_OK) != 0)
    throw ConfigError("command line", "output-prefix", prefix,
                      fmt::format("a writable location, but directory {} is not writable: {}",
                                  existing.string(), std::strerror(errno)));
  for (const std::string& key : keys) {
    const std::string out = fmt::format("{}_{}_document", prefix, key);
    for (const std::string& file : {out + ".bin", out + ".idx", dataset_meta_path(out)})
      if (fs::is_directory(file))
        throw ConfigError(
            "command line", "output-prefix", prefix,
            fmt::format("a prefix whose outputs can be files, but {} is a directory", file));
  }
}

// The output's missing directories: made before the first file is written and, unless the
// run succeeds, removed again (deepest first, and only while empty), so that a refused or
// failed run leaves nothing behind.
class OutputDirectories {
 public:
  explicit OutputDirectories(const fs::path& dir) {
    std::error_code ec;
    for (fs::path d = dir; !d.empty() && !fs::exists(d, ec); d = d.parent_path())
      made_.push_back(d);
    if (!made_.empty()) fs::create_directories(dir, ec);
    if (ec) {
      remove_made();
      throw DataError(
          fmt::format("{}: cannot create the output directory: {}", dir.string(), ec.message()));
    }
  }
  ~OutputDirectories() {
    if (!keep_) remove_made();
  }
  void keep() { keep_ = true; }

 private:
  void remove_made() {
    std::error_code ignored;
    for (const fs::path& d : made_) fs::remove(d, ignored);
  }
  std::vector<fs::path> made_;  // deepest first
  bool keep_ = false;
};

}  // namespace

PreprocessStats preprocess(const PreprocessOptions& o,
                           const std::function<void(uint64_t, uint64_t, uint64_t)>& progress) {
  const auto start = std::chrono::steady_clock::now();
  if (o.inputs.empty())
    throw ConfigError("command line", "input", "", "at least one input file or directory");
  if (o.output_prefix.empty())
    throw ConfigError("command line", "output-prefix", "", "an output path prefix");
  if (o.json_keys.empty()) throw ConfigError("command line", "json-keys", "", "at least one key");
  if (o.workers < 1)
    throw ConfigError("command line", "workers", std::to_string(o.workers), "at least 1");
  if (o.seq_length < 0)
    throw ConfigError("command line", "seq-length", std::to_string(o.seq_length), "a positive number of tokens");
  if (o.chat && o.preference)
    throw ConfigError("command line", "preference", "true",
                      "one of --chat (conversations) and --preference (preference pairs)");
  const bool chat_data = o.chat || o.preference;
  const char* chat_flag = o.preference ? "preference" : "chat";
  if (chat_data && o.tokenizer.tokenizer_type != TokenizerType::HuggingFace)
    throw ConfigError("command line", chat_flag, "true",
                      "a Hugging Face tokenizer with a chat template (--tokenizer-model llama3.1, "
                      "qwen3 or a chat model's tokenizer.json)");
  // Chat data writes tokens and their roles under one key.
  const std::vector<std::string> keys =
      chat_data ? std::vector<std::string>{chat_flag} : o.json_keys;
  check_output_location(o.output_prefix, keys);
  const std::vector<InputFile> files = list_inputs(o.inputs);
  for (const auto& f : files)
    if (!f.json_lines && chat_data)
      throw ConfigError("command line", "input", f.path,
                        fmt::format("JSON lines (*.jsonl, *.json) with --{}", chat_flag));
  for (const auto& f : files)
    if (!f.json_lines && o.json_keys.size() > 1)
      throw ConfigError(
          "command line", "json-keys", fmt::format("{}", fmt::join(o.json_keys, " ")),
          fmt::format("a single key: {} is a text file, which has no fields", f.path));

  // One tokenizer for all workers: encode() is const and thread-safe (tokenizer.h).
  const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(o.tokenizer);
  PreprocessStats stats;
  stats.tokenizer = tokenizer->name();
  stats.dtype = token_dtype_for_vocab(tokenizer->vocab_size());
  for (const auto& f : files) stats.input_bytes += fs::file_size(f.path);
  TokenizerRecord record;
  record.tokenizer_type = o.tokenizer.tokenizer_type;
  record.vocab_size = tokenizer->vocab_size();
  if (o.tokenizer.tokenizer_type == TokenizerType::HuggingFace) {
    record.tokenizer_model = o.tokenizer.tokenizer_model;
    record.tokenizer_json_sha256 = file_sha256(tokenizer_json_path(o.tokenizer.tokenizer_model));
  }

  std::unique_ptr<ChatFormat> chat;
  if (chat_data)
    chat = std::make_unique<ChatFormat>(tokenizer_json_path(o.tokenizer.tokenizer_model), *tokenizer);

  OutputDirectories directories(fs::path(o.output_prefix).parent_path());
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  for (const std::string& key : keys) {
    stats.outputs.push_back({fmt::format("{}_{}_document", o.output_prefix, key)});
    writers.push_back(std::make_unique<IndexedDatasetWriter>(
        stats.outputs.back().prefix, stats.dtype, tokenizer_record_json(record)));
  }
  if (chat_data) {
    stats.outputs.push_back({chat_roles_prefix(stats.outputs[0].prefix)});
    writers.push_back(std::make_unique<IndexedDatasetWriter>(stats.outputs.back().prefix, TokenDType::UInt8));
  }
  DocumentReader reader(files);
  std::vector<RawDocument> batch;
  std::vector<EncodedDocument> encoded;
  while (reader.next_batch(&batch)) {
    EncodedDocument empty;
    empty.ids.resize(writers.size());
    encoded.resize(batch.size(), empty);
    // Documents vary wildly in length: each thread takes the next as it gets free.
    parallel_for(batch.size(), [&](size_t i) {
      encode_document(batch[i], o.json_keys, *tokenizer, chat.get(), o, &encoded[i]);
    }, static_cast<size_t>(o.workers));
    for (size_t i = 0; i < batch.size(); ++i) {
      for (size_t k = 0; k < writers.size(); ++k) {
        PreprocessOutput& out = stats.outputs[k];
        const std::vector<int32_t>& ids = encoded[i].ids[k];
        out.truncated += encoded[i].truncated;
        out.dropped += encoded[i].dropped;
        if (ids.empty()) {
          out.empty_documents += !encoded[i].dropped;
          continue;
        }
        // A preference pair's rejected side follows its chosen one.
        const std::vector<int32_t>* rejected =
            encoded[i].rejected.empty() ? nullptr : &encoded[i].rejected[k];
        for (const std::vector<int32_t>* document : {&ids, rejected}) {
          if (!document) continue;
          writers[k]->add_document(document->data(), document->size());
          ++out.documents;
          out.tokens += document->size();
          if (!chat_data || k == 0) stats.tokens += document->size();
        }
      }
    }
    stats.documents += batch.size();
    if (progress) progress(reader.bytes_read(), stats.input_bytes, stats.documents);
  }
  // An empty dataset only fails later, in training, far from its cause.
  for (size_t k = 0; k < writers.size(); ++k)
    if (stats.outputs[k].documents == 0)
      throw ConfigError(
          "command line", "input", fmt::format("{}", fmt::join(o.inputs, " ")),
          fmt::format("documents with text for key '{}', but {}; nothing was written",
                      keys[std::min(k, keys.size() - 1)],
                      stats.documents == 0
                          ? "the input holds no documents"
                          : fmt::format("none of the {} documents read has any", stats.documents)));
  for (auto& w : writers) w->finish();
  directories.keep();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace tessera
