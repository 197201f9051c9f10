// tessera preprocess: text -> Megatron indexed dataset (data/preprocess.h). Takes Megatron's
// tools/preprocess_data.py options (dashes or underscores), so existing scripts carry over.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/cli/commands.h"
#include "tessera/config/keys.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"
#include "tessera/data/preprocess.h"

namespace tessera::cli {
namespace {

void print_preprocess_help() {
  fmt::print(
      "usage: tessera preprocess --input FILE_OR_DIR [...] --output-prefix PREFIX\n"
      "                          [--json-keys text [...]] [--tokenizer-type ByteLevel|"
      "HuggingFaceTokenizer]\n"
      "                          [--tokenizer-model NAME_OR_TOKENIZER_JSON] [--workers N] "
      "[--no-append-eod]\n"
      "                          [--chat | --preference [--seq-length N] [--overlong error|truncate|drop]]\n\n"
      "Tokenizes text into Megatron's indexed format: PREFIX_{{key}}_document.bin/.idx (MMIDIDX\n"
      "v1; uint16 tokens for vocabularies under 65,500, else int32), one document per JSON line\n"
      "or text file, each ending with the end-of-document token. Inputs: *.jsonl / *.json (JSON\n"
      "lines; --json-keys names the fields, one output per key), a directory (its *.txt files,\n"
      "or the Brown corpus's cXNN files), or any other file (one document). Beside each\n"
      "dataset, PREFIX_{{key}}_document.meta.json records the tokenizer; training refuses the\n"
      "dataset with another. Train on the result with --data_path PREFIX_text_document (or a\n"
      "blend: \"0.7 A 0.3 B\").\n\n"
      "  --tokenizer-model  a shipped name (llama2, llama3, llama3.1, qwen3) or a tokenizer.json;\n"
      "                     implies --tokenizer-type HuggingFaceTokenizer (default: ByteLevel)\n"
      "  --workers N        tokenizing threads (default: all cores); output order is input order\n"
      "  --append-eod       end each document with the end-of-document token (the default)\n"
      "  --no-append-eod    do not\n"
      "  --chat             conversations for fine-tuning: JSON lines with \"messages\" (a list of\n"
      "                     {{role, content}}, roles system/user/assistant/tool) or \"prompt\" and\n"
      "                     \"completion\", rendered with the tokenizer's chat template; writes\n"
      "                     PREFIX_chat_document (tokens) and PREFIX_chat_document_roles (whose\n"
      "                     each token is, for the loss mask). Train with --data_path\n"
      "                     PREFIX_chat_document.\n"
      "  --preference       preference pairs for DPO: JSON lines with \"prompt\", \"chosen\" and\n"
      "                     \"rejected\" (TRL's; strings, or lists of messages), each answer after\n"
      "                     the prompt as --chat renders a prompt and completion; writes\n"
      "                     PREFIX_preference_document (the chosen, then the rejected, of each\n"
      "                     pair) and its _roles\n"
      "  --seq-length N     with --chat or --preference: the longest sample, in tokens\n"
      "  --overlong P       a longer sample: error (the default: refused, nothing written),\n"
      "                     truncate (its first N tokens kept) or drop (skipped); counted\n");
}

std::string eta(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return fmt::format("{}m{:02d}s", s / 60, s % 60);
}

// A progress bar on a terminal (stderr), redrawn at most four times a second.
class ProgressBar {
 public:
  ProgressBar() : tty_(isatty(fileno(stderr))), start_(Clock::now()), last_(start_) {}
  void update(uint64_t bytes, uint64_t total, uint64_t documents) {
    if (!tty_ || Clock::now() - last_ < std::chrono::milliseconds(250)) return;
    last_ = Clock::now();
    const double done = total ? std::min(1.0, static_cast<double>(bytes) / total) : 0.0;
    const double seconds = std::chrono::duration<double>(last_ - start_).count();
    const int filled = static_cast<int>(done * 30);
    fmt::print(stderr,
               "\rpreprocess [{}{}] {:3.0f}% {:.1f}/{:.1f} MB, {} documents, {:.1f} MB/s, ETA {}  ",
               std::string(filled, '#'), std::string(30 - filled, '.'), 100 * done, bytes / 1e6,
               total / 1e6, documents, bytes / 1e6 / std::max(seconds, 1e-9),
               done > 0 ? eta(seconds / done * (1 - done)) : "?");
    std::fflush(stderr);
    drawn_ = true;
  }
  void clear() {
    if (drawn_) fmt::print(stderr, "\r{:<120}\r", "");
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool tty_, drawn_ = false;
  Clock::time_point start_, last_;
};

}  // namespace

int preprocess_command(const Args& args) {
  PreprocessOptions o;
  o.workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Experiment e;  // carries tokenizer_type / tokenizer_model through the config key parsers
  bool type_given = false, model_given = false, keys_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    // Megatron's tools/preprocess_data.py spells the options with dashes; as everywhere, both
    // spellings work (core/command_line.h).
    const auto option = parse_command_line_option(args[i]);
    const std::string name = option ? option->name : args[i];
    const std::string flag = args[i].substr(0, args[i].find('='));  // as given, for messages
    const bool has_inline = option && option->value;
    const std::string inline_value = has_inline ? *option->value : "";
    // The values after a flag: its "=value", or the arguments up to the next option.
    auto values = [&] {
      std::vector<std::string> v;
      if (has_inline) v.push_back(inline_value);
      while (!has_inline && i + 1 < args.size() && !args[i + 1].starts_with("--"))
        v.push_back(args[++i]);
      if (v.empty()) throw ConfigError("command line", name, "", "a value after " + flag);
      return v;
    };
    auto value = [&] {
      const auto v = values();
      if (v.size() != 1)
        throw ConfigError("command line", name, fmt::format("{}", fmt::join(v, " ")), "one value");
      return v[0];
    };
    if (args[i] == "--help" || args[i] == "-h") {
      print_preprocess_help();
      return 0;
    } else if (name == "input") {
      for (auto& v : values()) o.inputs.push_back(v);
    } else if (name == "output_prefix") {
      o.output_prefix = value();
    } else if (name == "json_keys") {
      o.json_keys = values();
      keys_given = true;
    } else if (name == "tokenizer_type" || name == "tokenizer_model") {
      const bool type = name == "tokenizer_type";
      const std::string key = type ? "tokenizer_type" : "tokenizer_model";
      const std::string v = value();
      const std::string expected = find_key(key)->set(e, v);
      if (!expected.empty()) throw ConfigError("command line", key, v, expected);
      (type ? type_given : model_given) = true;
    } else if (name == "workers") {
      const std::string v = value();
      try {
        o.workers = std::stoi(v);
      } catch (const std::exception&) {
        throw ConfigError("command line", "workers", v, "a number of threads");
      }
    } else if (name == "chat") {
      o.chat = true;
    } else if (name == "preference") {
      o.preference = true;
    } else if (name == "seq_length") {
      const std::string v = value();
      try {
        size_t used = 0;
        o.seq_length = std::stoll(v, &used);
        if (used != v.size() || o.seq_length <= 0) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        throw ConfigError("command line", "seq-length", v, "a positive number of tokens");
      }
    } else if (name == "overlong") {
      const std::string v = value();
      if (v == "error") o.overlong = OverlongPolicy::Error;
      else if (v == "truncate") o.overlong = OverlongPolicy::Truncate;
      else if (v == "drop") o.overlong = OverlongPolicy::Drop;
      else throw ConfigError("command line", "overlong", v, "error, truncate or drop");
    } else if (name == "append_eod") {
      o.append_eod = true;
    } else if (name == "no_append_eod") {
      o.append_eod = false;
    } else {
      throw ConfigError("command line", flag, "",
                        "an option of `tessera preprocess`: --input, --output-prefix, --json-keys, "
                        "--tokenizer-type, --tokenizer-model, --workers, --append-eod, "
                        "--no-append-eod, --chat, --preference, --seq-length, --overlong (see "
                        "--help)");
    }
  }
  if ((o.chat || o.preference) && keys_given)
    throw ConfigError("command line", "json-keys", fmt::format("{}", fmt::join(o.json_keys, " ")),
                      o.chat ? "no --json-keys with --chat: a conversation is read from "
                               "\"messages\", or \"prompt\" and \"completion\""
                             : "no --json-keys with --preference: a pair is read from \"prompt\", "
                               "\"chosen\" and \"rejected\"");
  if (!o.chat && !o.preference && (o.seq_length > 0 || o.overlong != OverlongPolicy::Error))
    throw ConfigError("command line", o.seq_length > 0 ? "seq-length" : "overlong",
                      o.seq_length > 0 ? std::to_string(o.seq_length) : "truncate or drop",
                      "--chat or --preference with it: plain documents are cut into samples at "
                      "training time");
  // Every tokenizer model is a Hugging Face tokenizer.json, so a model alone says the type;
  // the byte-level default with a model would quietly write byte ids that training then
  // reads under the model's vocabulary.
  std::string how_chosen;
  if (model_given && !type_given) {
    e.data.tokenizer_type = TokenizerType::HuggingFace;
    how_chosen = " (type inferred from --tokenizer-model)";
  } else if (model_given && e.data.tokenizer_type == TokenizerType::ByteLevel) {
    throw ConfigError("command line", "tokenizer_type", "ByteLevel",
                      fmt::format("HuggingFaceTokenizer (or no --tokenizer-type) with "
                                  "--tokenizer-model {}: the byte-level tokenizer reads no "
                                  "model; drop one of the two",
                                  e.data.tokenizer_model));
  } else if (!type_given) {
    how_chosen = " (the default without --tokenizer-model)";
  }
  fmt::print("tokenizer: {}{}{}\n", tokenizer_type_name(e.data.tokenizer_type),
             model_given ? " " + e.data.tokenizer_model : "", how_chosen);
  std::fflush(stdout);
  o.tokenizer = e.data;
  ProgressBar bar;
  const PreprocessStats s = preprocess(o, [&](uint64_t bytes, uint64_t total, uint64_t documents) {
    bar.update(bytes, total, documents);
  });
  bar.clear();
  const double seconds = std::max(s.seconds, 1e-9);
  fmt::print(
      "preprocessed {} documents ({:.1f} MB) in {:.2f} s with {} workers, {} tokenizer: "
      "{:.0f} docs/s, {:.0f} tokens/s, {:.1f} MB/s\n",
      s.documents, s.input_bytes / 1e6, s.seconds, o.workers, s.tokenizer, s.documents / seconds,
      s.tokens / seconds, s.input_bytes / 1e6 / seconds);
  for (size_t k = 0; k < s.outputs.size(); ++k) {
    const PreprocessOutput& out = s.outputs[k];
    if ((o.chat || o.preference) && k == 1) {
      fmt::print("wrote {}.bin/.idx: the role of each token (uint8)\n", out.prefix);
      continue;
    }
    fmt::print("wrote {}.bin/.idx: {} documents, {} {} tokens{}; its tokenizer in {}\n", out.prefix,
               out.documents, out.tokens, token_dtype_name(s.dtype),
               out.empty_documents
                   ? fmt::format(" ({} documents without text skipped)", out.empty_documents)
                   : "",
               dataset_meta_path(out.prefix));
    if ((o.chat || o.preference) && o.seq_length > 0)
      fmt::print("samples over --seq-length {}: {} truncated, {} dropped\n", o.seq_length, out.truncated,
                 out.dropped);
  }
  return 0;
}

}  // namespace tessera::cli
