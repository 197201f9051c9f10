// tessera generate: sample text from a Tessera checkpoint or a Hugging Face model directory,
// with a KV cache (model/continuations.h, the engine GRPO samples with), on the CPU or a GPU.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/hf_model.h"
#include "tessera/ckpt/model_source.h"
#include "tessera/cli/commands.h"
#include "tessera/config/keys.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/config/validate.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"
#include "tessera/data/chat.h"
#include "tessera/data/stop_strings.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/continuations.h"
#include "tessera/model/generator.h"
#include "tessera/model/sampling.h"
#include "tessera/train/grpo_prompts.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void print_generate_help() {
  fmt::print(
      "usage: tessera generate --from CHECKPOINT_OR_HF_DIR\n"
      "                        (--prompt TEXT | --prompt_ids IDS | --prompts FILE [-o OUT.jsonl])\n"
      "                        (--load DIR: Megatron's name of --from)\n"
      "                        [--max_new_tokens 64] [--temperature 0] [--top_k 0] [--top_p 1]\n"
      "                        [--min_p 0] [--num_samples 1] [--batch_size 64] [--stop TEXT_OR_LIST]\n"
      "                        [--seed 1] [--device auto|cpu|cuda] [--precision auto|fp32|bf16]\n"
      "                        [--tokenizer NAME_OR_PATH] [--ignore_eos]\n"
      "                        [--chat [--system TEXT]]\n\n"
      "Samples continuations of a prompt with a KV cache and prints the prompt with its\n"
      "continuation (as transformers' text-generation pipeline and Megatron's text server return\n"
      "them), then on stderr the new ids, the time the prompt took and the decoding rate in\n"
      "tokens/s. --from is a checkpoint directory, a save directory (its latest checkpoint) or a\n"
      "Hugging Face model directory. Temperature 0 decodes greedily; otherwise top-k, then top-p\n"
      "(nucleus), then min-p restrict the sampled tokens, as transformers' generate() does. The\n"
      "tokenizer is the checkpoint's (its training config), the Hugging Face directory's\n"
      "tokenizer.json, or --tokenizer (llama2, llama3, llama3.1, qwen3, a tokenizer.json, or\n"
      "ByteLevel); --prompt_ids takes space-separated token ids instead of text (no tokenizer\n"
      "needed). Generation stops at the tokenizer's end-of-document token unless --ignore_eos,\n"
      "and after the token that completes a --stop string (one string, or a list such as\n"
      "'[\"\\n\\n\", \"###\"]'), which the text keeps.\n\n"
      "--num_samples N continues the prompt N times (vLLM's n), each sample from its own random\n"
      "stream of --seed; each is printed after a line naming it. --prompts FILE reads JSON lines\n"
      "of prompts as GRPO does (\"prompt\": a string or a list of chat messages, or GSM8K's\n"
      "\"question\"), continues each --num_samples times, and writes one JSON line per prompt\n"
      "(its line, prompt, and its completions with text, ids, logprobs (each id's\n"
      "log-probability under the model, temperature 1) and finish_reason: eos, stop or length)\n"
      "to -o, published whole, or stdout. Continuations are\n"
      "decoded with continuous batching, up to --batch_size at once (vLLM's max_num_seqs; default\n"
      "64): one that ends gives its place to the next.\n\n"
      "--chat talks to a fine-tuned model: --prompt is the user's message (after --system's, if\n"
      "given), rendered with the tokenizer's chat template with the assistant's turn opened;\n"
      "the reply is printed alone and ends at the special token that closes the turn.\n");
}

// The weights: a Tessera checkpoint (a LoRA one merged into its base) or a Hugging Face
// directory.
ModelSource open_source(const std::string& from) {
  std::error_code ec;
  if (fs::exists(fs::path(from) / "config.json", ec)) return ModelSource::open_hf(from);
  if (find_latest_checkpoint(from).empty())
    throw ConfigError("command line", "from", from,
                      "a checkpoint directory, a save directory holding one, or a Hugging Face "
                      "model directory (config.json and safetensors)");
  return ModelSource::open_checkpoint(from);
}

// --tokenizer, else the checkpoint's training config, else the Hugging Face directory's file.
// *json_path: its tokenizer.json (Hugging Face tokenizers only), where the chat template is.
std::unique_ptr<Tokenizer> open_tokenizer(const ModelSource& src, const std::string& option,
                                          std::string* json_path) {
  DataConfig d;
  const auto hugging_face = [&](const std::string& model) {
    d.tokenizer_type = TokenizerType::HuggingFace;
    d.tokenizer_model = model;
    *json_path = tokenizer_json_path(model);
    return make_tokenizer(d);
  };
  if (!option.empty()) {
    if (option == "ByteLevel") return make_tokenizer(d);
    if (!names_a_tokenizer(option))
      throw ConfigError("command line", "tokenizer", option,
                        tokenizer_model_expectation() + ", or ByteLevel");
    return hugging_face(option);
  }
  if (src.checkpoint()) {
    try {
      const YAML::Node config = YAML::Load(src.checkpoint()->state().config_yaml);
      if (!config.IsMap()) throw YAML::Exception(YAML::Mark::null_mark(), "not a mapping");
      const std::string type = config["tokenizer_type"].as<std::string>("ByteLevel");
      for (TokenizerType t :
           {TokenizerType::HuggingFace, TokenizerType::Null, TokenizerType::Gpt2Bpe})
        if (type == tokenizer_type_name(t)) d.tokenizer_type = t;
      d.tokenizer_model = config["tokenizer_model"].as<std::string>("");
      d.vocab_file = config["vocab_file"].as<std::string>("");
      d.merge_file = config["merge_file"].as<std::string>("");
      if (d.tokenizer_type == TokenizerType::HuggingFace) return hugging_face(d.tokenizer_model);
      return make_tokenizer(d, config["vocab_size"].as<int64_t>(0));
    } catch (const YAML::Exception& e) {
      throw DataError(
          fmt::format("{}: config_yaml does not name a tokenizer ({}); pass "
                      "--tokenizer",
                      (fs::path(src.name()) / "trainer_state.json").string(), e.what()));
    }
  }
  const fs::path file = fs::path(src.name()) / "tokenizer.json";
  if (!fs::exists(file))
    throw ConfigError(
        "command line", "tokenizer", "",
        fmt::format("a tokenizer: {} has no tokenizer.json; pass --tokenizer", src.name()));
  return hugging_face(file.string());
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  int64_t id = 0;
  while (in >> id) ids.push_back(static_cast<int32_t>(id));
  if (!in.eof() || ids.empty())
    throw ConfigError("command line", "prompt_ids", text, "space-separated token ids");
  return ids;
}

double parse_number(const bench::CommandArgs& a, const std::string& key, double fallback,
                    double min, double max) {
  if (!a.has(key)) return fallback;
  const std::string text = a.get(key, "");
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && v >= min && v <= max) return v;
  } catch (const std::exception&) {
  }
  throw ConfigError("command line", key, text, fmt::format("a number in [{}, {}]", min, max));
}

// How a continuation ended, in vLLM's words where it has them.
const char* finish_reason(Continuation::End end) {
  switch (end) {
    case Continuation::End::Token:
      return "eos";
    case Continuation::End::Stop:
      return "stop";
    case Continuation::End::Length:
      break;
  }
  return "length";
}

// A continuation's ids without the end token that closed it (a stop string's stay).
std::vector<int32_t> reply_ids(const Continuation& c) {
  std::vector<int32_t> ids = c.ids;
  if (c.end == Continuation::End::Token && !ids.empty()) ids.pop_back();
  return ids;
}

}  // namespace

int generate_command(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      print_generate_help();
      return 0;
    }
  const bench::CommandArgs a(
      args,
      {"from", "load", "prompt", "prompt_ids", "prompts", "output", "max_new_tokens", "temperature",
       "top_k", "top_p", "min_p", "num_samples", "batch_size", "stop", "seed", "device", "precision",
       "tokenizer", "system"},
      {"ignore_eos", "chat"}, false);
  if (a.has("from") && a.has("load"))
    throw ConfigError("command line", "load", a.get("load", ""),
                      "one of --from and --load (the same option: Megatron calls it --load)");
  const std::string from = a.has("load") ? a.get("load", "") : a.get("from", "");
  if (from.empty())
    throw ConfigError("command line", "from", "", "--from CHECKPOINT_OR_HF_DIR (or --load)");
  if (a.has("prompt") + a.has("prompt_ids") + a.has("prompts") != 1)
    throw ConfigError("command line", "prompt", "",
                      "exactly one of --prompt, --prompt_ids and --prompts");
  const bool chat = a.has("chat");
  if (chat && !a.has("prompt"))
    throw ConfigError("command line", "chat", "true",
                      "--prompt (the user's message), not --prompt_ids or --prompts");
  if (a.has("system") && !chat)
    throw ConfigError("command line", "system", a.get("system", ""), "--chat with it");
  if (a.has("output") && !a.has("prompts"))
    throw ConfigError("command line", "output", a.get("output", ""),
                      "--prompts with it (the file of completions it writes)");
  if (a.has("output")) require_output_file(a.get("output", ""), "command line", "output");
  SamplingOptions so;
  so.temperature = parse_number(a, "temperature", 0.0, 0.0, 100.0);
  so.top_k = a.get_int("top_k", 0, 0);
  so.top_p = parse_number(a, "top_p", 1.0, 1e-6, 1.0);
  so.min_p = parse_number(a, "min_p", 0.0, 0.0, 1.0);
  so.seed = static_cast<uint64_t>(a.get_int("seed", 1, 0));
  const int64_t max_new = a.get_int("max_new_tokens", 64, 1);
  const int64_t samples = a.get_int("num_samples", 1, 1);
  const int64_t batch_size = a.get_int("batch_size", 64, 1);
  std::vector<std::string> stops;
  try {
    stops = parse_stop_strings(a.get("stop", ""));
  } catch (const std::invalid_argument& e) {
    throw ConfigError("command line", "stop", a.get("stop", ""),
                      std::string("one string or a list of non-empty strings (") + e.what() + ")");
  }
  const std::string device = a.get("device", "auto"), precision = a.get("precision", "auto");
  const DeviceChoice choice = parse_device_choice(device);
  if (precision != "auto" && precision != "fp32" && precision != "bf16")
    throw ConfigError("command line", "precision", precision, "auto, fp32 or bf16");

  // The device first: a precision it cannot run is refused before any file is read.
  auto backend = make_backend(choice, 0);
  const DType dtype = precision == "fp32"   ? DType::F32
                      : precision == "bf16" ? DType::BF16
                                            : backend->default_compute_dtype();
  if (dtype == DType::BF16 && !backend->supports(Capability::Bf16Compute))
    throw ConfigError("command line", "precision", precision,
                      "auto or fp32 on " + backend->description() +
                          ": bf16 runs on GPUs (the CPU backend is the fp32 reference)");
  const ModelSource src = open_source(from);
  const ModelSpec& spec = src.spec();
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatFormat> chat_format;
  std::string tokenizer_json;
  std::vector<GrpoPrompt> prompts;  // --prompts; else the one prompt
  if (a.has("prompt_ids")) {
    prompts.push_back({parse_ids(a.get("prompt_ids", "")), "", "", 0});
    if (a.has("tokenizer") || !a.has("ignore_eos") || !stops.empty())
      tokenizer = open_tokenizer(src, a.get("tokenizer", ""), &tokenizer_json);
  } else if (chat) {
    tokenizer = open_tokenizer(src, a.get("tokenizer", ""), &tokenizer_json);
    if (tokenizer_json.empty())
      throw ConfigError("command line", "chat", "true",
                        "a Hugging Face tokenizer with a chat template, not " + tokenizer->name());
    chat_format = std::make_unique<ChatFormat>(tokenizer_json, *tokenizer);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (a.has("system")) messages.push_back({{"role", "system"}, {"content", a.get("system", "")}});
    messages.push_back({{"role", "user"}, {"content", a.get("prompt", "")}});
    GrpoPrompt& p = prompts.emplace_back();
    try {
      p.ids = chat_format->encode_prompt(messages, "--prompt");
    } catch (const DataError& e) {
      throw ConfigError("command line", "prompt", a.get("prompt", ""), e.what());
    }
  } else if (a.has("prompts")) {
    tokenizer = open_tokenizer(src, a.get("tokenizer", ""), &tokenizer_json);
    if (!tokenizer_json.empty())
      chat_format = std::make_unique<ChatFormat>(tokenizer_json, *tokenizer);
    prompts = read_grpo_prompts(a.get("prompts", ""), *tokenizer, chat_format.get(),
                                /*need_answer=*/false, std::numeric_limits<int64_t>::max());
  } else {
    tokenizer = open_tokenizer(src, a.get("tokenizer", ""), &tokenizer_json);
    GrpoPrompt& p = prompts.emplace_back();
    tokenizer->encode(a.get("prompt", ""), &p.ids);
    if (p.ids.empty())
      throw ConfigError("command line", "prompt", "", "text that encodes to tokens");
  }
  size_t longest = 0;
  for (const GrpoPrompt& p : prompts) longest = std::max(longest, p.ids.size());

  ContinuationRequest request;
  request.sampling = so;
  request.max_new_tokens = max_new;
  request.vocab = tokenizer ? std::min(tokenizer->vocab_size(), spec.vocab_size) : spec.vocab_size;
  if (!a.has("ignore_eos"))
    request.is_end_token = [&](int32_t token) {
      return (tokenizer && token == tokenizer->eod_id()) ||
             (chat_format && chat_format->is_special(token));
    };
  const StopStrings stop = tokenizer ? StopStrings(*tokenizer, stops) : StopStrings();
  if (!stop.empty())
    request.stopped = [&](std::span<const int32_t> ids) { return stop.stopped(ids); };

  std::vector<PromptContinuations> asked;
  for (const GrpoPrompt& p : prompts) {
    PromptContinuations& c = asked.emplace_back();
    c.prompt = p.ids;
    c.streams.resize(static_cast<size_t>(samples));
    std::iota(c.streams.begin(), c.streams.end(), 0);
  }
  const int64_t continuations = samples * static_cast<int64_t>(prompts.size());
  Generator gen(*backend, spec, dtype, static_cast<int64_t>(longest) + max_new,
                std::min(batch_size, continuations));
  gen.load([&](const ParamInfo& p) { return src.weights(p); },
           [&](const std::string& name) { return src.state(name); });

  const auto t0 = Clock::now();
  int64_t new_tokens = 0;
  const std::vector<std::vector<Continuation>> done = continue_prompts(gen, asked, request);
  for (const std::vector<Continuation>& group : done)
    for (const Continuation& c : group) new_tokens += static_cast<int64_t>(c.ids.size());
  if (a.has("prompts")) {
    std::string lines;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const GrpoPrompt& p = prompts[i];
      nlohmann::ordered_json completions = nlohmann::ordered_json::array();
      for (const Continuation& c : done[i])
        completions.push_back({{"text", tokenizer->decode(reply_ids(c))},
                               {"ids", c.ids},
                               {"logprobs", c.logps},
                               {"finish_reason", finish_reason(c.end)}});
      // Bytes that are not UTF-8 (a byte-level tokenizer's pieces of a character) become
      // U+FFFD in the text; the ids keep them.
      lines +=
          nlohmann::ordered_json{{"line", p.line}, {"prompt", p.text}, {"completions", completions}}
              .dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) +
          "\n";
    }
    if (a.has("output")) {
      const fs::path out = a.get("output", "");
      if (out.has_parent_path()) fs::create_directories(out.parent_path());
      write_file_atomically(out.string(), lines);
    } else {
      fmt::print("{}", lines);
      std::fflush(stdout);
    }
  } else {
    const std::vector<int32_t>& prompt = prompts[0].ids;
    const std::vector<Continuation>& samples_done = done[0];
    for (size_t i = 0; i < samples_done.size(); ++i) {
      const Continuation& c = samples_done[i];
      if (samples > 1)
        fmt::print("--- sample {} ({}, {} tokens)\n", i + 1, finish_reason(c.end), c.ids.size());
      // The prompt with its continuation, decoded together so that a tokenizer that marks word
      // starts (Llama 2's) spaces the first new word as the text reads; in a chat, the reply
      // alone.
      if (chat_format) {
        fmt::print("{}\n", tokenizer->decode(reply_ids(c)));
      } else if (tokenizer) {
        std::vector<int32_t> all = prompt;
        all.insert(all.end(), c.ids.begin(), c.ids.end());
        fmt::print("{}\n", tokenizer->decode(all));
      }
    }
    std::fflush(stdout);  // the text before the numbers on stderr, also through a pipe
    for (size_t i = 0; i < samples_done.size(); ++i)
      fmt::print(stderr, "{}: {}\n",
                 samples > 1 ? fmt::format("ids[{}]", i + 1) : std::string("ids"),
                 fmt::join(samples_done[i].ids, " "));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string what =
      a.has("prompts") ? fmt::format("{} prompts of up to {} tokens", prompts.size(), longest)
                       : fmt::format("prompt of {} tokens", longest);
  fmt::print(stderr,
             "{} on {} ({}): {}, {} continuation{}{}; {} new tokens at {:.1f} tokens/s ({:.2f} s "
             "with the prompts' passes; {} sequence{} decoded at once at most{})\n",
             src.name(), backend->description(), dtype_name(dtype), what, samples,
             samples == 1 ? "" : "s", a.has("prompts") ? " each" : "", new_tokens,
             new_tokens / std::max(seconds, 1e-9), seconds, gen.max_batch(), gen.max_batch() == 1 ? "" : "s",
             gen.captures_steps() ? ", steps captured as CUDA graphs" : "");
  return 0;
}

}  // namespace tessera::cli
