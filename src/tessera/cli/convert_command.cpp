// tessera convert: Tessera checkpoints <-> Hugging Face model directories, and a logits dump
// that lets another framework check Tessera's numerics on the same weights and tokens.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/hf_model.h"
#include "tessera/ckpt/model_source.h"
#include "tessera/ckpt/safetensors.h"
#include "tessera/cli/commands.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/model_family.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

void print_convert_help() {
  fmt::print(
      "usage:\n"
      "  tessera convert --from CHECKPOINT --to-hf OUT_DIR [--dtype bf16|fp32] [--shard-size 5GB]\n"
      "                  [--tokenizer NAME|PATH]\n"
      "  tessera convert --from-hf HF_DIR --to CHECKPOINT_DIR\n"
      "  tessera convert (--from CHECKPOINT | --from-hf HF_DIR) --check-logits TOKENS.txt\n"
      "                  --out LOGITS.safetensors\n\n"
      "CHECKPOINT is a checkpoint directory (iter_NNNNNNN) or a save directory (its latest\n"
      "checkpoint). --to-hf writes config.json (model_type {}, from the model's family\n"
      "and features) and\n"
      "model.safetensors, or shards of at most --shard-size with\n"
      "model.safetensors.index.json; the fp32 master weights are exported when the checkpoint\n"
      "has them. With them come the run's tokenizer (tokenizer.json, tokenizer_config.json,\n"
      "special_tokens_map.json) and generation_config.json, so that transformers' AutoTokenizer\n"
      "and pipeline(\"text-generation\") load the directory; the tokenizer is the one the\n"
      "checkpoint's configuration names, or --tokenizer: a shipped name (llama2, llama3,\n"
      "llama3.1, qwen3) or a tokenizer.json (or a directory holding one). A byte-level run has\n"
      "no Hugging Face tokenizer: only its token ids are written. --to writes a weights-only\n"
      "checkpoint that `tessera train --load` starts from.\n"
      "--check-logits runs the model in fp32 on the CPU reference backend on each line of\n"
      "TOKENS.txt (space-separated ids, equal lengths) and writes logits [B, T, vocab], the\n"
      "mean next-token loss (as transformers computes it with labels = input ids) and the\n"
      "tokens.\n"
      "Outputs are written to a temporary name and renamed when complete.\n",
      hf_model_type_names());
}

struct ConvertOptions {
  std::string from, from_hf, to_hf, to, check_logits, out;
  std::optional<std::string> tokenizer;  // --tokenizer: overrides the checkpoint's
  DType dtype = DType::BF16;
  uint64_t shard_bytes = 5'000'000'000ull;
};

// "5GB", "500MB", "2GiB" or plain bytes; KB/MB/GB are decimal, as in Hugging Face's
// max_shard_size.
uint64_t parse_size(const std::string& text) {
  static const std::pair<const char*, double> kUnits[] = {{"GiB", 1024.0 * 1024 * 1024},
                                                          {"MiB", 1024.0 * 1024},
                                                          {"KiB", 1024.0},
                                                          {"GB", 1e9},
                                                          {"MB", 1e6},
                                                          {"KB", 1e3},
                                                          {"B", 1}};
  double scale = 1;
  std::string number = text;
  for (const auto& [unit, factor] : kUnits) {
    if (text.size() > std::strlen(unit) && text.ends_with(unit)) {
      number = text.substr(0, text.size() - std::strlen(unit));
      scale = factor;
      break;
    }
  }
  size_t used = 0;
  double value = -1;
  try {
    value = std::stod(number, &used);
  } catch (const std::exception&) {
  }
  if (used != number.size() || !(value > 0))
    throw ConfigError("command line", "shard-size", text, "a size such as 5GB, 500MB or 2GiB");
  return static_cast<uint64_t>(value * scale);
}

ConvertOptions parse_args(const Args& args) {
  ConvertOptions o;
  const std::map<std::string, std::string*> paths = {
      {"from", &o.from}, {"from_hf", &o.from_hf},           {"to_hf", &o.to_hf},
      {"to", &o.to},     {"check_logits", &o.check_logits}, {"out", &o.out}};
  for (size_t i = 0; i < args.size(); ++i) {
    // Every option takes a value: --to-hf DIR, --to_hf=DIR (core/command_line.h).
    const std::string given = args[i].substr(0, args[i].find('='));  // as given, for messages
    const auto option = parse_command_line_option(args[i]);
    const std::string key = option ? option->name : args[i];
    std::string value;
    if (option && option->value) {
      value = *option->value;
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      throw ConfigError("command line", key, "", "a value after " + given);
    }
    if (const auto it = paths.find(key); it != paths.end()) {
      *it->second = value;
    } else if (key == "tokenizer") {
      if (!names_a_tokenizer(value))
        throw ConfigError("command line", "tokenizer", value, tokenizer_model_expectation());
      o.tokenizer = value;
    } else if (key == "shard_size") {
      o.shard_bytes = parse_size(value);
    } else if (key == "dtype") {
      if (!parse_dtype(value, &o.dtype) || (o.dtype != DType::BF16 && o.dtype != DType::F32))
        throw ConfigError("command line", "dtype", value, "bf16 or fp32");
    } else {
      throw ConfigError("command line", given, value,
                        "one of --from, --from-hf, --to-hf, --to, --check-logits, --out, --dtype, "
                        "--shard-size, --tokenizer (see tessera convert --help)");
    }
  }
  // "out/" -> "out": the export is published by renaming OUT_DIR.tmp to OUT_DIR, which needs
  // OUT_DIR to name an entry of its parent.
  while (o.to_hf.size() > 1 && o.to_hf.ends_with('/')) o.to_hf.pop_back();
  if (o.from.empty() == o.from_hf.empty())
    throw ConfigError("command line", "from", o.from + o.from_hf,
                      "exactly one of --from CHECKPOINT and --from-hf HF_DIR");
  if (o.to_hf.empty() && o.to.empty() && o.check_logits.empty())
    throw ConfigError("command line", "to", "",
                      "--to-hf OUT_DIR, --to CHECKPOINT_DIR or --check-logits TOKENS.txt");
  if (!o.check_logits.empty() && o.out.empty())
    throw ConfigError("command line", "out", "", "--out LOGITS.safetensors with --check-logits");
  if (o.tokenizer && o.to_hf.empty())
    throw ConfigError("command line", "tokenizer", *o.tokenizer,
                      "--to-hf OUT_DIR with --tokenizer");
  return o;
}

// Outputs never replace existing files: a mistyped path must not cost a model.
void require_new_directory(const std::string& path, const char* key) {
  require_output_directory(path, "command line", key);
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_empty(path, ec)) {
    throw ConfigError("command line", key, path,
                      ec ? "a new or empty directory (cannot list it: " + ec.message() + ")"
                         : "a new or empty directory (it holds files)");
  }
}

// Every output location is checked before the source is read, so that a bad path fails at once
// (exit 2) and not after loading or converting a model.
void check_outputs(const ConvertOptions& o) {
  if (!o.to_hf.empty()) {
    require_new_directory(o.to_hf, "to-hf");
    // The export is built in OUT_DIR.tmp beside OUT_DIR and renamed into place.
    const fs::path parent = fs::path(o.to_hf).parent_path();
    require_output_directory(parent.empty() ? fs::path(".") : parent, "command line", "to-hf");
  }
  if (!o.to.empty()) require_new_directory(o.to, "to");
  if (!o.out.empty()) require_output_file(o.out, "command line", "out");
}

// The weights to convert: a Tessera checkpoint (a LoRA one merged into its base) or a Hugging
// Face directory.
ModelSource open_source(const ConvertOptions& o) {
  return o.from_hf.empty() ? ModelSource::open_checkpoint(o.from) : ModelSource::open_hf(o.from_hf);
}

// The tokenizer --tokenizer names, loaded before the source is read so that a bad one fails at
// once (exit 2).
std::optional<HfTokenizer> tokenizer_option(const ConvertOptions& o) {
  if (!o.tokenizer) return std::nullopt;
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = *o.tokenizer;
  try {
    return read_hf_tokenizer(data);
  } catch (const DataError& e) {
    throw ConfigError("command line", "tokenizer", *o.tokenizer,
                      fmt::format("{} ({})", tokenizer_model_expectation(), e.what()));
  }
}

// The tokenizer of the run that wrote checkpoint `c`, from the configuration it recorded;
// nullopt, with the reason in *why, when there is none.
std::optional<DataConfig> recorded_tokenizer(const Checkpoint& c, std::string* why) {
  const std::string state_file = (fs::path(c.dir()) / "trainer_state.json").string();
  if (c.state().config_yaml.empty()) {
    *why = state_file + " records no configuration (a checkpoint converted from Hugging Face?)";
    return std::nullopt;
  }
  YAML::Node config;
  try {
    config = YAML::Load(c.state().config_yaml);
  } catch (const YAML::Exception& e) {
    throw DataError(fmt::format("{}: config_yaml is not YAML: {}", state_file, e.what()));
  }
  // Mock data of a vocabulary of its own never went through the tokenizer (run_setup.h).
  const int64_t vocab_size = config["vocab_size"].as<int64_t>(0);
  if (config["mock_data"].as<bool>(false) && vocab_size > 0) {
    *why = fmt::format("the run trained on mock data over vocab_size {}, not on tokenized text",
                       vocab_size);
    return std::nullopt;
  }
  DataConfig data;
  const std::string type = config["tokenizer_type"].as<std::string>("");
  if (type == tokenizer_type_name(TokenizerType::Null) ||
      type == tokenizer_type_name(TokenizerType::Gpt2Bpe)) {
    *why = fmt::format(
        "the run's tokenizer is {}, which has no tokenizer.json to copy (give --tokenizer one)",
        type);
    return std::nullopt;
  }
  if (type == tokenizer_type_name(TokenizerType::HuggingFace)) {
    data.tokenizer_type = TokenizerType::HuggingFace;
  } else if (type != tokenizer_type_name(TokenizerType::ByteLevel)) {
    throw DataError(fmt::format("{}: config_yaml has tokenizer_type '{}': expected {} or {}",
                                state_file, type, tokenizer_type_name(TokenizerType::ByteLevel),
                                tokenizer_type_name(TokenizerType::HuggingFace)));
  }
  data.tokenizer_model = config["tokenizer_model"].as<std::string>("");
  return data;
}

// What the export carries: --tokenizer's, else the run's; nullopt (after a warning) when
// neither is known.
std::optional<HfTokenizer> export_tokenizer(const ConvertOptions& o,
                                            std::optional<HfTokenizer> chosen, const ModelSource& src) {
  const int64_t vocab = src.spec().vocab_size;
  if (chosen) {
    if (chosen->vocab > vocab)
      throw ConfigError("command line", "tokenizer", *o.tokenizer,
                        fmt::format("a tokenizer of this model: its ids run to {}, but the "
                                    "model's vocabulary has {}",
                                    chosen->vocab - 1, vocab));
    return chosen;
  }
  std::string why =
      "the source is a Hugging Face directory (--tokenizer " + src.name() + " copies its tokenizer)";
  if (src.checkpoint()) {
    if (const auto data = recorded_tokenizer(*src.checkpoint(), &why)) {
      try {
        return read_hf_tokenizer(*data);
      } catch (const Error& e) {
        throw DataError(fmt::format(
            "{} (the tokenizer {}'s configuration names; --tokenizer NAME|PATH exports another)",
            e.what(), src.name()));
      }
    }
  }
  fmt::print(stderr,
             "warning: {}: no tokenizer files, generation_config.json or token ids: {}; pass "
             "--tokenizer NAME|PATH to include the tokenizer\n",
             o.to_hf, why);
  return std::nullopt;
}

// One sequence of token ids per line, all of one length.
std::vector<int32_t> read_tokens(const std::string& path, int64_t vocab, int64_t* rows,
                                 int64_t* cols) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open the tokens file", path));
  std::vector<int32_t> ids;
  *rows = *cols = 0;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    std::istringstream ls(line);
    int64_t id, count = 0;
    while (ls >> id) {
      if (id < 0 || id >= vocab)
        throw DataError(fmt::format("{}:{}: token id {} outside the model's vocabulary [0, {})",
                                    path, n, id, vocab));
      ids.push_back(static_cast<int32_t>(id));
      ++count;
    }
    if (!ls.eof())
      throw DataError(fmt::format("{}:{}: expected space-separated token ids", path, n));
    if (count == 0) continue;
    if (*cols && count != *cols)
      throw DataError(
          fmt::format("{}:{}: {} tokens; expected {} like the first line", path, n, count, *cols));
    *cols = count;
    ++*rows;
  }
  if (*rows == 0) throw DataError(fmt::format("{}: no token ids", path));
  return ids;
}

void write_logits(const ModelSource& src, const ConvertOptions& o) {
  const ModelSpec& spec = src.spec();
  int64_t B = 0, T = 0;
  std::vector<int32_t> tokens = read_tokens(o.check_logits, spec.vocab_size, &B, &T);
  const int64_t V = spec.vocab_size;
  // fp32 logits for a numerics check: the CUDA backend computes in bf16 (and is checked
  // against this reference by the GPU tests).
  auto backend = make_backend(DeviceChoice::Cpu, 0);
  ModelRuntime rt;
  rt.micro_batch = B;
  rt.seq_length = T;
  rt.compute_dtype = DType::F32;
  DecoderModel model(*backend, spec, rt);
  for (const auto& p : model.layout().params)
    backend->upload(model.params().flat_range(p.offset, p.numel()), src.weights(p).data());
  for (const auto& [name, tensor] : model.persistent_state())
    if (const std::vector<float> v = src.state(name); !v.empty()) backend->upload(tensor, v.data());
  const std::vector<int32_t> no_targets(tokens.size(), -1);
  model.set_batch(tokens.data(), no_targets.data());
  DeviceBuffer buffer(*backend, static_cast<size_t>(B * T * V) * sizeof(float), "logits");
  const Tensor logits = buffer.tensor(DType::F32, {B * T, V});
  model.forward_logits(logits);
  std::vector<float> host(static_cast<size_t>(B * T * V));
  backend->download(host.data(), logits);
  // Mean cross-entropy of each next token, in double: transformers' loss with labels = ids.
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t + 1 < T; ++t) {
      const float* row = host.data() + (b * T + t) * V;
      double max = row[0], sum = 0;
      for (int64_t v = 1; v < V; ++v) max = std::max(max, static_cast<double>(row[v]));
      for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
      loss += max + std::log(sum) - row[tokens[b * T + t + 1]];
    }
  }
  const float mean_loss =
      T > 1 ? static_cast<float>(loss / static_cast<double>(B * (T - 1))) : 0.0f;
  write_safetensors(o.out,
                    {{"logits", DType::F32, {B, T, V}, host.data()},
                     {"loss", DType::F32, {1}, &mean_loss},
                     {"tokens", DType::I32, {B, T}, tokens.data()}},
                    {{"source", src.name()}, {"model", spec.summary()}});
  fmt::print("logits of {} x {} tokens from {} on {} -> {} (loss {:.6f})\n", B, T, src.name(),
             backend->description(), o.out, mean_loss);
}

}  // namespace

int convert_command(const Args& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      print_convert_help();
      return 0;
    }
  }
  const ConvertOptions o = parse_args(args);
  check_outputs(o);
  std::optional<HfTokenizer> tokenizer = tokenizer_option(o);
  const ModelSource src = open_source(o);
  const auto weights = [&](const ParamInfo& p) { return src.weights(p); };
  if (!o.to_hf.empty()) {
    tokenizer = export_tokenizer(o, std::move(tokenizer), src);
    write_hf_model(o.to_hf, src.spec(), weights, {o.dtype, o.shard_bytes, tokenizer},
                   [&](const std::string& name) { return src.state(name); });
    if (tokenizer && tokenizer->tokenizer_json.empty())
      fmt::print(stderr,
                 "warning: {}: no tokenizer files: {}. config.json and generation_config.json "
                 "hold its end-of-document id {}\n",
                 o.to_hf, tokenizer->no_files_reason, *tokenizer->eos_id);
    fmt::print("wrote {} ({}, {} weights, tokenizer {}) from {}: {}\n", o.to_hf,
               model_family(src.spec().family).hf_model_type(src.spec()), dtype_name(o.dtype),
               tokenizer ? tokenizer->name : "none", src.name(), src.spec().summary());
  }
  if (!o.to.empty()) {
    const std::string dir = save_weights_checkpoint(o.to, src.spec(), weights, src.all_state());
    fmt::print("wrote weights-only checkpoint {} from {}: {}\n", dir, src.name(),
               src.spec().summary());
  }
  if (!o.check_logits.empty()) write_logits(src, o);
  return 0;
}

}  // namespace tessera::cli
