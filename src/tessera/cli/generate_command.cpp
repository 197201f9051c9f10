// tessera generate: sample text from a Tessera checkpoint or a Hugging Face model directory,
// with a KV cache (model/generator.h), on the CPU or a GPU.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/hf_model.h"
#include "tessera/ckpt/model_source.h"
#include "tessera/cli/commands.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/data/chat.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/generator.h"
#include "tessera/model/sampling.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void print_generate_help() {
  fmt::print(
      "usage: tessera generate --from CHECKPOINT_OR_HF_DIR (--prompt TEXT | --prompt_ids IDS)\n"
      "                        (--load DIR: Megatron's name of --from)\n"
      "                        [--max_new_tokens 64] [--temperature 0] [--top_k 0] [--top_p 1]\n"
      "                        [--min_p 0]\n"
      "                        [--seed 1] [--device auto|cpu|cuda] [--precision auto|fp32|bf16]\n"
      "                        [--tokenizer NAME_OR_PATH] [--ignore_eos]\n"
      "                        [--chat [--system TEXT]]\n\n"
      "Samples a continuation of the prompt, one token at a time with a KV cache, and prints the\n"
      "prompt with its continuation (as transformers' text-generation pipeline and Megatron's\n"
      "text server return them), then on stderr the new ids, the time the prompt took and the\n"
      "decoding rate in tokens/s. --from is a checkpoint\n"
      "directory, a save directory (its latest checkpoint) or a Hugging Face model directory.\n"
      "Temperature 0 decodes greedily; otherwise top-k, then top-p (nucleus) restrict the\n"
      "sampled tokens, as transformers' generate() does. The tokenizer is the checkpoint's\n"
      "(its training config), the Hugging Face directory's tokenizer.json, or --tokenizer\n"
      "(llama2, llama3, llama3.1, qwen3, a tokenizer.json, or ByteLevel); --prompt_ids takes\n"
      "space-separated token ids instead of text (no tokenizer needed). Generation stops at\n"
      "the tokenizer's end-of-document token unless --ignore_eos.\n\n"
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

}  // namespace

int generate_command(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      print_generate_help();
      return 0;
    }
  const bench::CommandArgs a(
      args,
      {"from", "load", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p",
       "min_p", "seed", "device", "precision", "tokenizer", "system"},
      {"ignore_eos", "chat"}, false);
  if (a.has("from") && a.has("load"))
    throw ConfigError("command line", "load", a.get("load", ""),
                      "one of --from and --load (the same option: Megatron calls it --load)");
  const std::string from = a.has("load") ? a.get("load", "") : a.get("from", "");
  if (from.empty())
    throw ConfigError("command line", "from", "", "--from CHECKPOINT_OR_HF_DIR (or --load)");
  if (a.has("prompt") == a.has("prompt_ids"))
    throw ConfigError("command line", "prompt", "", "exactly one of --prompt and --prompt_ids");
  const bool chat = a.has("chat");
  if (chat && a.has("prompt_ids"))
    throw ConfigError("command line", "chat", "true", "--prompt (the user's message), not --prompt_ids");
  if (a.has("system") && !chat)
    throw ConfigError("command line", "system", a.get("system", ""), "--chat with it");
  SamplingOptions so;
  so.temperature = parse_number(a, "temperature", 0.0, 0.0, 100.0);
  so.top_k = a.get_int("top_k", 0, 0);
  so.top_p = parse_number(a, "top_p", 1.0, 1e-6, 1.0);
  so.min_p = parse_number(a, "min_p", 0.0, 0.0, 1.0);
  so.seed = static_cast<uint64_t>(a.get_int("seed", 1, 0));
  const int64_t max_new = a.get_int("max_new_tokens", 64, 1);
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
  std::vector<int32_t> prompt;
  if (a.has("prompt_ids")) {
    prompt = parse_ids(a.get("prompt_ids", ""));
    if (a.has("tokenizer") || !a.has("ignore_eos"))
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
    try {
      prompt = chat_format->encode_prompt(messages, "--prompt");
    } catch (const DataError& e) {
      throw ConfigError("command line", "prompt", a.get("prompt", ""), e.what());
    }
  } else {
    tokenizer = open_tokenizer(src, a.get("tokenizer", ""), &tokenizer_json);
    tokenizer->encode(a.get("prompt", ""), &prompt);
    if (prompt.empty())
      throw ConfigError("command line", "prompt", "", "text that encodes to tokens");
  }
  const int64_t vocab =
      tokenizer ? std::min(tokenizer->vocab_size(), spec.vocab_size) : spec.vocab_size;

  Generator gen(*backend, spec, dtype, static_cast<int64_t>(prompt.size()) + max_new);
  gen.load([&](const ParamInfo& p) { return src.weights(p); },
           [&](const std::string& name) { return src.state(name); });
  Sampler sampler(so);

  const auto t0 = Clock::now();
  std::vector<float> logits = gen.prefill(prompt);
  const double prefill_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::vector<int32_t> generated;
  const auto t1 = Clock::now();
  for (int64_t i = 0; i < max_new; ++i) {
    const int32_t token = sampler.next(logits, vocab);
    generated.push_back(token);
    if (tokenizer && !a.has("ignore_eos") && token == tokenizer->eod_id()) break;
    if (chat_format && !a.has("ignore_eos") && chat_format->is_special(token)) break;
    if (i + 1 < max_new) logits = gen.step(token);
  }
  const double decode_s = std::chrono::duration<double>(Clock::now() - t1).count();

  // The prompt with its continuation, decoded together so that a tokenizer that marks word
  // starts (Llama 2's) spaces the first new word as the text reads.
  if (chat_format) {
    // The reply alone, without the token that closed it.
    std::vector<int32_t> reply = generated;
    if (!reply.empty() && (chat_format->is_special(reply.back()) || reply.back() == tokenizer->eod_id()))
      reply.pop_back();
    fmt::print("{}\n", tokenizer->decode(reply));
    std::fflush(stdout);
  } else if (tokenizer) {
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), generated.begin(), generated.end());
    fmt::print("{}\n", tokenizer->decode(all));
    std::fflush(stdout);  // the text before the numbers on stderr, also through a pipe
  }
  fmt::print(stderr, "ids: {}\n", fmt::join(generated, " "));
  fmt::print(stderr,
             "{} on {} ({}): prompt of {} tokens in {:.1f} ms; {} new tokens at {:.1f} tokens/s\n",
             src.name(), backend->description(), dtype_name(dtype), prompt.size(), prefill_ms,
             generated.size(), generated.size() / std::max(decode_s, 1e-9));
  return 0;
}

}  // namespace tessera::cli
