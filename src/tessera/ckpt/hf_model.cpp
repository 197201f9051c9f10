#include "tessera/ckpt/hf_model.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/ckpt/safetensors.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// One Hugging Face tensor inside a Tessera parameter: rows starting at element `offset`.
struct HfPiece {
  std::string name;
  int64_t offset = 0;
  std::vector<int64_t> shape;
  int64_t numel() const { return shape.size() == 1 ? shape[0] : shape[0] * shape[1]; }
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The pieces of `p`, in the order they are stacked along its first dimension.
std::vector<HfPiece> hf_pieces(const ParamInfo& p, const ModelSpec& s) {
  const int64_t cols = p.shape.rank() == 2 ? p.shape[1] : 1;
  auto split = [&](const std::string& fused,
                   const std::vector<std::pair<std::string, int64_t>>& parts) {
    const std::string base = p.name.substr(0, p.name.size() - fused.size());
    const std::string kind = ends_with(p.name, ".bias") ? "bias" : "weight";
    std::vector<HfPiece> out;
    int64_t row = 0;
    for (const auto& [name, rows] : parts) {
      HfPiece piece{base + name + "." + kind, row * cols, {rows}};
      if (p.shape.rank() == 2) piece.shape.push_back(cols);
      out.push_back(piece);
      row += rows;
    }
    return out;
  };
  const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  if (ends_with(p.name, "qkv_proj.weight"))
    return split("qkv_proj.weight", {{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}});
  if (ends_with(p.name, "qkv_proj.bias"))
    return split("qkv_proj.bias", {{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}});
  if (ends_with(p.name, "gate_up_proj.weight"))
    return split("gate_up_proj.weight", {{"gate_proj", s.ffn}, {"up_proj", s.ffn}});
  HfPiece whole{p.name, 0, {p.shape[0]}};
  if (p.shape.rank() == 2) whole.shape.push_back(cols);
  return {whole};
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON: {}", path.string(), e.what()));
  }
}

}  // namespace

// The safetensors files of a Hugging Face directory and which holds each tensor.
class HfWeightFiles {
 public:
  explicit HfWeightFiles(const fs::path& dir) {
    if (fs::exists(dir / kIndexFile)) {
      const nlohmann::json index = read_json(dir / kIndexFile);
      if (!index.contains("weight_map") || !index["weight_map"].is_object())
        throw DataError(
            fmt::format("{}: no weight_map object; expected Hugging Face's sharded index",
                        (dir / kIndexFile).string()));
      for (const auto& [name, file] : index["weight_map"].items()) {
        const fs::path path = dir / file.get<std::string>();
        if (!files_.count(path.string())) {
          if (!fs::exists(path))
            throw DataError(fmt::format("{}: missing; {} lists it for tensor '{}'", path.string(),
                                        (dir / kIndexFile).string(), name));
          files_[path.string()] = std::make_unique<SafetensorsFile>(path.string());
        }
        where_[name] = files_[path.string()].get();
      }
    } else if (fs::exists(dir / kSingleFile)) {
      auto f = std::make_unique<SafetensorsFile>((dir / kSingleFile).string());
      for (const auto& t : f->tensors()) where_[t.name] = f.get();
      files_[f->path()] = std::move(f);
    } else {
      throw DataError(
          fmt::format("{}: no {} or {}; expected Hugging Face safetensors weights "
                      "(save_pretrained(..., safe_serialization=True))",
                      dir.string(), kSingleFile, kIndexFile));
    }
  }
  const std::map<std::string, const SafetensorsFile*>& where() const { return where_; }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

namespace {

const char* hf_class_name(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::Llama:
      return "LlamaForCausalLM";
    case HfArchitecture::Qwen2:
      return "Qwen2ForCausalLM";
    case HfArchitecture::Mistral:
      return "MistralForCausalLM";
  }
  return "?";
}

}  // namespace

const char* hf_model_type(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::Llama:
      return "llama";
    case HfArchitecture::Qwen2:
      return "qwen2";
    case HfArchitecture::Mistral:
      return "mistral";
  }
  return "?";
}

ModelSpec read_hf_config(const std::string& dir, HfArchitecture* arch_out) {
  const fs::path path = fs::path(dir) / kConfigFile;
  const std::string file = path.string();
  if (!fs::exists(path))
    throw DataError(
        fmt::format("{}: missing; expected a Hugging Face model directory (config.json and "
                    "model.safetensors or sharded model-*.safetensors with {})",
                    file, kIndexFile));
  const nlohmann::json j = read_json(path);
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  std::string type = has("model_type") ? j["model_type"].get<std::string>() : "";
  HfArchitecture arch;
  if (type == "llama")
    arch = HfArchitecture::Llama;
  else if (type == "qwen2")
    arch = HfArchitecture::Qwen2;
  else if (type == "mistral")
    arch = HfArchitecture::Mistral;
  else
    throw DataError(fmt::format(
        "{}: model_type '{}' is not supported; expected llama, qwen2 or mistral", file, type));
  auto unsupported = [&](const std::string& what) {
    return DataError(
        fmt::format("{}: {} is not supported by Tessera's {} model", file, what, type));
  };
  ModelSpec s;
  try {
    auto required = [&](const char* key) {
      if (!has(key)) throw DataError(fmt::format("{}: field '{}' is missing", file, key));
      return j[key].get<int64_t>();
    };
    s.hidden = required("hidden_size");
    s.ffn = required("intermediate_size");
    s.num_layers = required("num_hidden_layers");
    s.heads = required("num_attention_heads");
    s.vocab_size = required("vocab_size");
    s.kv_heads = has("num_key_value_heads") ? j["num_key_value_heads"].get<int64_t>() : s.heads;
    s.head_dim =
        has("head_dim") ? j["head_dim"].get<int64_t>() : s.hidden / std::max<int64_t>(s.heads, 1);
    // Defaults are those of transformers' config classes for a missing field.
    const int64_t default_positions = arch == HfArchitecture::Llama   ? 2048
                                      : arch == HfArchitecture::Qwen2 ? 32768
                                                                      : 131072;
    s.max_position_embeddings = j.value("max_position_embeddings", default_positions);
    s.norm_eps = static_cast<float>(j.value("rms_norm_eps", 1e-6));
    s.tied_embeddings = j.value("tie_word_embeddings", false);
    s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw unsupported(
          fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
    if (arch == HfArchitecture::Llama && j.value("attention_bias", false))
      throw unsupported("attention_bias: true (Llama's bias includes o_proj)");
    if (j.value("mlp_bias", false)) throw unsupported("mlp_bias: true");
    s.qkv_bias = arch == HfArchitecture::Qwen2;
    if (arch == HfArchitecture::Qwen2 && j.value("use_sliding_window", false))
      throw unsupported("use_sliding_window: true (Qwen2's per-layer windows)");
    if (arch == HfArchitecture::Mistral)
      s.sliding_window = !j.contains("sliding_window") ? 4096
                         : has("sliding_window")       ? j["sliding_window"].get<int64_t>()
                                                       : 0;
    // transformers 5 keeps rope_theta and the scaling in rope_parameters; earlier versions
    // write rope_theta and rope_scaling at the top level.
    const nlohmann::json none = nlohmann::json::object();
    const nlohmann::json& rope = has("rope_parameters") ? j["rope_parameters"]
                                 : has("rope_scaling")  ? j["rope_scaling"]
                                                        : none;
    s.rotary_base = rope.contains("rope_theta") ? rope["rope_theta"].get<double>()
                    : has("rope_theta")         ? j["rope_theta"].get<double>()
                                                : 10000.0;
    const std::string rope_type =
        rope.value("rope_type", rope.value("type", std::string("default")));
    if (rope_type == "llama3") {
      s.rope_scaling.enabled = true;
      s.rope_scaling.factor = rope.at("factor").get<double>();
      s.rope_scaling.low_freq_factor = rope.at("low_freq_factor").get<double>();
      s.rope_scaling.high_freq_factor = rope.at("high_freq_factor").get<double>();
      s.rope_scaling.original_max_position_embeddings =
          rope.at("original_max_position_embeddings").get<int64_t>();
    } else if (rope_type != "default") {
      throw unsupported(fmt::format("RoPE type '{}' (expected llama3 or default)", rope_type));
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: {}", file, e.what()));
  }
  if (s.hidden <= 0 || s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0 ||
      s.head_dim <= 0 || s.num_layers <= 0 || s.ffn <= 0 || s.vocab_size <= 0)
    throw DataError(fmt::format(
        "{}: inconsistent sizes (hidden_size {}, num_attention_heads {}, "
        "num_key_value_heads {}, head_dim {}, num_hidden_layers {}, "
        "intermediate_size {}, vocab_size {})",
        file, s.hidden, s.heads, s.kv_heads, s.head_dim, s.num_layers, s.ffn, s.vocab_size));
  s.tokenizer_vocab = s.vocab_size;
  if (arch_out) *arch_out = arch;
  return s;
}

HfArchitecture hf_architecture_for(const ModelSpec& s) {
  if (s.qkv_bias && s.sliding_window > 0)
    throw DataError(
        "no supported Hugging Face architecture has both QKV bias and a sliding window "
        "(qwen2 has the bias, mistral the window)");
  if (s.qkv_bias) return HfArchitecture::Qwen2;
  return s.sliding_window > 0 ? HfArchitecture::Mistral : HfArchitecture::Llama;
}

nlohmann::ordered_json hf_config_json(const ModelSpec& s, DType dtype) {
  const HfArchitecture arch = hf_architecture_for(s);
  nlohmann::ordered_json j;
  j["architectures"] = {hf_class_name(arch)};
  j["model_type"] = hf_model_type(arch);
  j["vocab_size"] = s.vocab_size;
  j["hidden_size"] = s.hidden;
  j["intermediate_size"] = s.ffn;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.kv_heads;
  j["head_dim"] = s.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = s.max_position_embeddings;
  // The shortest decimal that reads back as the same float: 1e-05, not 9.999999747e-06.
  j["rms_norm_eps"] = std::stod(fmt::format("{}", s.norm_eps));
  // Both spellings: rope_theta + rope_scaling for transformers 4, rope_parameters for 5.
  nlohmann::ordered_json scaling = nullptr, rope = {{"rope_type", "default"}};
  if (s.rope_scaling.enabled) {
    scaling = {
        {"rope_type", "llama3"},
        {"factor", s.rope_scaling.factor},
        {"low_freq_factor", s.rope_scaling.low_freq_factor},
        {"high_freq_factor", s.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", s.rope_scaling.original_max_position_embeddings}};
    rope = scaling;
  }
  rope["rope_theta"] = s.rotary_base;
  j["rope_theta"] = s.rotary_base;
  j["rope_scaling"] = scaling;
  j["rope_parameters"] = rope;
  j["tie_word_embeddings"] = s.tied_embeddings;
  j["initializer_range"] = std::stod(fmt::format("{}", s.init_std));
  j["attention_dropout"] = 0.0;
  switch (arch) {
    case HfArchitecture::Llama:
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
      break;
    case HfArchitecture::Qwen2:
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = s.num_layers;
      break;
    case HfArchitecture::Mistral:
      j["sliding_window"] = s.sliding_window;
      break;
  }
  j["use_cache"] = true;
  j["torch_dtype"] = dtype == DType::BF16  ? "bfloat16"
                     : dtype == DType::F16 ? "float16"
                                           : "float32";
  return j;
}

HfModelReader::HfModelReader(const std::string& dir) : spec_(read_hf_config(dir, &arch_)) {
  layout_ = make_param_layout(spec_);
  files_ = std::make_unique<HfWeightFiles>(fs::path(dir));
  const auto& where = files_->where();
  std::set<std::string> used;
  for (const auto& p : layout_.params) {
    for (const HfPiece& piece : hf_pieces(p, spec_)) {
      const auto it = where.find(piece.name);
      if (it == where.end())
        throw DataError(fmt::format("{}: tensor '{}' is missing; expected [{}] for the model in {}",
                                    dir, piece.name, fmt::join(piece.shape, ", "), kConfigFile));
      const SafetensorsTensor* t = it->second->find(piece.name);
      if (!t)
        throw DataError(fmt::format("{}: tensor '{}' is missing (the index lists it here)",
                                    it->second->path(), piece.name));
      if (t->shape != piece.shape)
        throw DataError(fmt::format(
            "{}: tensor '{}' has shape [{}]; expected [{}] for the model in {}", it->second->path(),
            piece.name, fmt::join(t->shape, ", "), fmt::join(piece.shape, ", "), kConfigFile));
      if (t->dtype != DType::F32 && t->dtype != DType::BF16 && t->dtype != DType::F16)
        throw DataError(fmt::format("{}: tensor '{}' is {}; expected F32, BF16 or F16",
                                    it->second->path(), piece.name,
                                    safetensors_dtype_name(t->dtype)));
      used.insert(piece.name);
    }
  }
  for (const auto& [name, file] : where) {
    // Old Llama checkpoints store RoPE's inverse frequencies; tied models may store the
    // head anyway. Neither carries information the config does not.
    const bool redundant = ends_with(name, "rotary_emb.inv_freq") ||
                           (spec_.tied_embeddings && name == "lm_head.weight");
    if (!used.count(name) && !redundant)
      throw DataError(
          fmt::format("{}: tensor '{}' has no place in the model {} describes (an "
                      "unsupported feature?)",
                      file->path(), name, kConfigFile));
  }
}

HfModelReader::~HfModelReader() = default;

std::vector<float> HfModelReader::weights(const ParamInfo& p) const {
  std::vector<float> values(p.numel());
  for (const HfPiece& piece : hf_pieces(p, spec_)) {
    const std::vector<float> v = files_->where().at(piece.name)->to_float(piece.name);
    std::copy(v.begin(), v.end(), values.begin() + piece.offset);
  }
  return values;
}

std::vector<std::string> load_hf_weights(const std::string& dir, const ModelSpec& configured,
                                         const ParamLayout& layout, Backend& backend,
                                         const std::vector<FlatSlice>& master) {
  const HfModelReader hf(dir);
  const std::string config = (fs::path(dir) / kConfigFile).string();
  const SpecDifferences d = compare_specs(hf.spec(), configured, config);
  if (!d.shape.empty())
    throw DataError(
        fmt::format("{}: the Hugging Face model differs from the configured model: {}; set "
                    "the model keys to match ({})",
                    config, join_lines(d.shape), hf.spec().summary()));
  for (const FlatSlice& s : master) {
    backend.fill(s.values, 0.0f);  // alignment padding
    layout.for_each_param_in(s.range, [&](const ParamInfo& p, const ParamRange& part) {
      const std::vector<float> w = hf.weights(p);
      backend.upload(s.values.flat_range(part.begin - s.range.begin, part.count()),
                     w.data() + (part.begin - p.offset));
    });
  }
  return d.behaviour;
}

void write_hf_model(const std::string& out_dir, const ModelSpec& spec,
                    const std::function<std::vector<float>(const ParamInfo&)>& weights,
                    const HfExportOptions& options) {
  TS_CHECK(options.dtype == DType::F32 || options.dtype == DType::BF16, "export dtype {}",
           dtype_name(options.dtype));
  const nlohmann::ordered_json config = hf_config_json(spec, options.dtype);
  const ParamLayout layout = make_param_layout(spec);
  struct Entry {
    const ParamInfo* param;
    HfPiece piece;
  };
  // Greedy sharding in parameter order, as save_pretrained does; a tensor larger than the
  // shard size gets a shard of its own.
  std::vector<std::vector<Entry>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& p : layout.params) {
    for (HfPiece& piece : hf_pieces(p, spec)) {
      const uint64_t bytes = static_cast<uint64_t>(piece.numel()) * dtype_size(options.dtype);
      if (!shards.back().empty() && shard_bytes + bytes > options.shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back({&p, std::move(piece)});
      shard_bytes += bytes;
      total_bytes += bytes;
    }
  }
  const std::string tmp = out_dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write_file_atomically((fs::path(tmp) / kConfigFile).string(), config.dump(2) + "\n");
    nlohmann::ordered_json weight_map;
    const ParamInfo* cached_param = nullptr;  // fused tensors are fetched once for all pieces
    std::vector<float> cached;
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string name =
          shards.size() == 1
              ? kSingleFile
              : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
      std::vector<SafetensorsTensor> tensors;
      for (const Entry& e : shards[k]) {
        tensors.push_back({e.piece.name, options.dtype, e.piece.shape});
        weight_map[e.piece.name] = name;
      }
      write_safetensors((fs::path(tmp) / name).string(), tensors, {{"format", "pt"}},
                        [&](size_t i, void* dst) {
                          const Entry& e = shards[k][i];
                          if (cached_param != e.param) {
                            cached = weights(*e.param);
                            cached_param = e.param;
                          }
                          const float* src = cached.data() + e.piece.offset;
                          if (options.dtype == DType::F32) {
                            std::memcpy(dst, src, e.piece.numel() * sizeof(float));
                          } else {
                            auto* out = static_cast<uint16_t*>(dst);
                            for (int64_t n = 0; n < e.piece.numel(); ++n)
                              out[n] = float_to_bf16_bits(src[n]);
                          }
                        });
    }
    if (shards.size() > 1) {
      const nlohmann::ordered_json index = {{"metadata", {{"total_size", total_bytes}}},
                                            {"weight_map", weight_map}};
      write_file_atomically((fs::path(tmp) / kIndexFile).string(), index.dump(2) + "\n");
    }
    publish_directory(tmp, out_dir);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace tessera
