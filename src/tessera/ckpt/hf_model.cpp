#include "tessera/ckpt/hf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/json_fields.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/ckpt/safetensors.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/data/bpe_tokenizer.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/model_family.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kGenerationConfigFile = "generation_config.json";
constexpr const char* kTokenizerFile = "tokenizer.json";
constexpr const char* kTokenizerConfigFile = "tokenizer_config.json";
constexpr const char* kSpecialTokensMapFile = "special_tokens_map.json";

// transformers' special-token attributes, in the order it writes special_tokens_map.json.
constexpr const char* kSpecialTokenKeys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                             "pad_token", "cls_token", "mask_token"};

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON: {}", path.string(), e.what()));
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A special token as tokenizer_config.json gives it: a string or an AddedToken object; null
// or absent: none.
std::optional<std::string> token_content(const nlohmann::ordered_json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return std::string();  // not a token; the caller names the file
}

// What a tokenizer.json says about its special tokens beyond what BpeTokenizer reads.
struct AddedTokenFlags {
  // content -> the AddedToken object transformers writes into special_tokens_map.json
  std::map<std::string, nlohmann::ordered_json> added;
  // The special token the post-processor puts before a single sequence (the BOS), if any.
  std::optional<std::string> prepended;
};

std::optional<std::string> prepended_token(simdjson::dom::element processor) {
  std::string_view type;
  if (processor["type"].get(type) != simdjson::SUCCESS) return std::nullopt;
  if (type == "Sequence") {
    simdjson::dom::array steps;
    if (processor["processors"].get(steps) != simdjson::SUCCESS) return std::nullopt;
    for (simdjson::dom::element step : steps)
      if (auto token = prepended_token(step)) return token;
    return std::nullopt;
  }
  simdjson::dom::array single;
  std::string_view name, token;
  if (type != "TemplateProcessing" || processor["single"].get(single) != simdjson::SUCCESS ||
      single.size() == 0 || single.at(0)["SpecialToken"]["id"].get(name) != simdjson::SUCCESS)
    return std::nullopt;
  // The template names a special token; special_tokens maps the name to its token(s).
  simdjson::dom::array tokens;
  if (processor["special_tokens"][name]["tokens"].get(tokens) == simdjson::SUCCESS &&
      tokens.size() == 1 && tokens.at(0).get(token) == simdjson::SUCCESS)
    return std::string(token);
  return std::string(name);
}

AddedTokenFlags read_added_token_flags(const std::string& path) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (const auto error = parser.load(path).get(doc); error != simdjson::SUCCESS)
    throw DataError(fmt::format("{}: not valid JSON ({})", path, simdjson::error_message(error)));
  AddedTokenFlags out;
  simdjson::dom::array added;
  if (doc["added_tokens"].get(added) == simdjson::SUCCESS) {
    for (simdjson::dom::element t : added) {
      std::string_view content;
      if (t["content"].get(content) != simdjson::SUCCESS) continue;
      nlohmann::ordered_json token = {{"content", std::string(content)}};
      for (const char* flag : {"lstrip", "normalized", "rstrip", "single_word"}) {
        bool value = false;
        if (t[flag].get(value) != simdjson::SUCCESS) value = false;  // transformers' default
        token[flag] = value;
      }
      out.added[std::string(content)] = std::move(token);
    }
  }
  simdjson::dom::element processor;
  if (doc["post_processor"].get(processor) == simdjson::SUCCESS && processor.is_object())
    out.prepended = prepended_token(processor);
  return out;
}

nlohmann::ordered_json id_or_null(std::optional<int32_t> id) {
  return id ? nlohmann::ordered_json(*id) : nlohmann::ordered_json(nullptr);
}

// bos and eos always (null where the tokenizer has none, which transformers would otherwise
// replace by its config class's defaults, e.g. Llama's 1 and 2); pad only where there is one.
void add_token_ids(const HfTokenizer& t, nlohmann::ordered_json* j) {
  (*j)["bos_token_id"] = id_or_null(t.bos_id);
  (*j)["eos_token_id"] = id_or_null(t.eos_id);
  if (t.pad_id) (*j)["pad_token_id"] = *t.pad_id;
}

// The config.json fields the model families read, with their JSON types and (for sizes)
// ranges, checked before a family reads any: a wrong type is named with its field (the JSON
// library's own error names none), and no model layout is built from sizes no model has.
// `nullable`: the families read null as "not given" there.
enum class FieldKind { Integer, Number, Boolean, String, Object, IntegerList };
struct ConfigField {
  const char* key;
  FieldKind kind;
  bool nullable = false;
  int64_t min = 0, max = 0;  // Integer and IntegerList
};
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // hidden sizes and their kin
constexpr int64_t kMaxCount = int64_t{1} << 16;  // layers, heads, experts
constexpr int64_t kMaxRows = int64_t{1} << 24;   // vocabularies and MLP widths
constexpr int64_t kMaxPositions = int64_t{1} << 31;
constexpr ConfigField kConfigFields[] = {
    {"model_type", FieldKind::String},
    {"hidden_act", FieldKind::String},
    {"hidden_size", FieldKind::Integer, true, 1, kMaxWidth},
    {"intermediate_size", FieldKind::Integer, true, 1, kMaxRows},
    {"num_hidden_layers", FieldKind::Integer, true, 1, kMaxCount},
    {"num_attention_heads", FieldKind::Integer, true, 1, kMaxCount},
    {"num_key_value_heads", FieldKind::Integer, true, 1, kMaxCount},
    {"head_dim", FieldKind::Integer, true, 1, kMaxCount},
    {"vocab_size", FieldKind::Integer, true, 1, kMaxRows},
    {"max_position_embeddings", FieldKind::Integer, false, 1, kMaxPositions},
    {"sliding_window", FieldKind::Integer, true, 0, kMaxPositions},
    {"max_window_layers", FieldKind::Integer, true, 0, kMaxCount},
    {"rms_norm_eps", FieldKind::Number},
    {"initializer_range", FieldKind::Number},
    {"rope_theta", FieldKind::Number, true},
    {"rope_scaling", FieldKind::Object, true},
    {"rope_parameters", FieldKind::Object, true},
    {"tie_word_embeddings", FieldKind::Boolean},
    {"attention_bias", FieldKind::Boolean},
    {"mlp_bias", FieldKind::Boolean},
    {"use_sliding_window", FieldKind::Boolean},
    {"rope_interleave", FieldKind::Boolean},
    {"norm_topk_prob", FieldKind::Boolean},
    {"num_local_experts", FieldKind::Integer, true, 0, kMaxCount},
    {"num_experts", FieldKind::Integer, true, 0, kMaxCount},
    {"n_routed_experts", FieldKind::Integer, true, 0, kMaxCount},
    {"num_experts_per_tok", FieldKind::Integer, true, 0, kMaxCount},
    {"moe_intermediate_size", FieldKind::Integer, true, 1, kMaxRows},
    {"n_shared_experts", FieldKind::Integer, true, 0, kMaxCount},
    {"first_k_dense_replace", FieldKind::Integer, true, 0, kMaxCount},
    {"decoder_sparse_step", FieldKind::Integer, false, 0, kMaxCount},
    {"mlp_only_layers", FieldKind::IntegerList, true, 0, kMaxCount},
    {"q_lora_rank", FieldKind::Integer, true, 0, kMaxWidth},
    {"kv_lora_rank", FieldKind::Integer, true, 1, kMaxWidth},
    {"qk_nope_head_dim", FieldKind::Integer, true, 1, kMaxCount},
    {"qk_rope_head_dim", FieldKind::Integer, true, 1, kMaxCount},
    {"v_head_dim", FieldKind::Integer, true, 1, kMaxCount},
    {"routed_scaling_factor", FieldKind::Number, true},
};
// Inside rope_scaling / rope_parameters.
constexpr ConfigField kRopeFields[] = {
    {"rope_type", FieldKind::String},
    {"type", FieldKind::String},
    {"rope_theta", FieldKind::Number},
    {"factor", FieldKind::Number, true},
    {"low_freq_factor", FieldKind::Number},
    {"high_freq_factor", FieldKind::Number},
    {"original_max_position_embeddings", FieldKind::Integer, true, 1, kMaxPositions},
    {"beta_fast", FieldKind::Number, true},
    {"beta_slow", FieldKind::Number, true},
    {"mscale", FieldKind::Number, true},
    {"mscale_all_dim", FieldKind::Number, true},
    {"attention_factor", FieldKind::Number, true},
};

template <size_t N>
void check_config_fields(const JsonFields& f, const ConfigField (&fields)[N]) {
  for (const ConfigField& c : fields) {
    const auto it = f.json().find(c.key);
    if (it == f.json().end() || (c.nullable && it->is_null())) continue;
    switch (c.kind) {
      case FieldKind::Integer:
        f.integer(c.key, c.min, c.max);
        break;
      case FieldKind::Number:
        f.number(c.key, -std::numeric_limits<double>::max(), std::numeric_limits<double>::max());
        break;
      case FieldKind::Boolean:
        f.boolean(c.key);
        break;
      case FieldKind::String:
        f.string(c.key);
        break;
      case FieldKind::Object:
        check_config_fields(f.object(c.key), kRopeFields);
        break;
      case FieldKind::IntegerList: {
        const nlohmann::json& list = f.array(c.key);
        for (size_t i = 0; i < list.size(); ++i)
          f.integer_value(list[i], fmt::format("{}[{}]", f.field(c.key), i), c.min, c.max);
        break;
      }
    }
  }
}

// The decoder layers the weights hold, from Hugging Face's names "model.layers.<N>.": one more
// than the highest N; 0 when no tensor is named so.
int64_t layers_in_weights(const std::map<std::string, const SafetensorsFile*>& where) {
  constexpr std::string_view kPrefix = "model.layers.";
  int64_t layers = 0;
  for (const auto& [name, file] : where) {
    if (!name.starts_with(kPrefix)) continue;
    int64_t n = 0;
    const char* begin = name.data() + kPrefix.size();
    const auto [end, ec] = std::from_chars(begin, name.data() + name.size(), n);
    if (ec == std::errc() && end != begin && *end == '.' && n < kMaxCount)
      layers = std::max(layers, n + 1);
  }
  return layers;
}

}  // namespace

// The safetensors files of a Hugging Face directory and which holds each tensor.
class HfWeightFiles {
 public:
  explicit HfWeightFiles(const fs::path& dir) {
    std::error_code ec;
    if (fs::exists(dir / kIndexFile, ec)) {
      const nlohmann::json index = read_json(dir / kIndexFile);
      if (!index.contains("weight_map") || !index["weight_map"].is_object())
        throw DataError(
            fmt::format("{}: no weight_map object; expected Hugging Face's sharded index",
                        (dir / kIndexFile).string()));
      for (const auto& [name, file] : index["weight_map"].items()) {
        // A shard beside the index: never a path out of the model directory.
        if (!file.is_string() || !is_plain_file_name(file.get<std::string>()))
          throw DataError(fmt::format(
              "{}: weight_map['{}'] is {}; expected the name of a safetensors file in {}",
              (dir / kIndexFile).string(), name, file.dump(), dir.string()));
        const fs::path path = dir / file.get<std::string>();
        if (!files_.count(path.string())) {
          if (!fs::exists(path, ec))
            throw DataError(fmt::format("{}: missing; {} lists it for tensor '{}'", path.string(),
                                        (dir / kIndexFile).string(), name));
          files_[path.string()] = std::make_unique<SafetensorsFile>(path.string());
        }
        where_[name] = files_[path.string()].get();
      }
    } else if (fs::exists(dir / kSingleFile, ec)) {
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
  std::vector<std::string> paths() const {
    std::vector<std::string> out;
    for (const auto& [path, file] : files_) out.push_back(path);
    return out;
  }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

std::vector<std::string> hf_weight_files(const std::string& dir) { return HfWeightFiles(dir).paths(); }

ModelSpec read_hf_config(const std::string& dir, std::string* model_type) {
  const fs::path path = fs::path(dir) / kConfigFile;
  const std::string file = path.string();
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw DataError(
        fmt::format("{}: missing; expected a Hugging Face model directory (config.json and "
                    "model.safetensors or sharded model-*.safetensors with {})",
                    file, kIndexFile));
  const nlohmann::json j = read_json(path);
  const JsonFields fields(j, file);
  check_config_fields(fields, kConfigFields);
  const std::string type = j.contains("model_type") && j["model_type"].is_string()
                               ? j["model_type"].get<std::string>()
                               : "";
  const ModelFamily* family = model_family_for_hf_type(type);
  if (family == nullptr)
    throw DataError(fmt::format("{}: model_type '{}' is not supported; expected {}", file, type,
                                hf_model_type_names()));
  ModelSpec s = family->read_hf_config(j, file);
  s.family = family->name();
  if (model_type) *model_type = type;
  return s;
}

nlohmann::ordered_json hf_config_json(const ModelSpec& s, DType dtype) {
  nlohmann::ordered_json j = model_family(s.family).hf_config(s);
  j["torch_dtype"] = dtype == DType::BF16  ? "bfloat16"
                     : dtype == DType::F16 ? "float16"
                                           : "float32";
  return j;
}

HfModelReader::HfModelReader(const std::string& dir) : spec_(read_hf_config(dir, &model_type_)) {
  files_ = std::make_unique<HfWeightFiles>(fs::path(dir));
  const auto& where = files_->where();
  // config.json against the weights before the layout is built from it: a layer count the
  // weights do not have is named as such, not found tensor by tensor.
  if (const int64_t layers = layers_in_weights(where); layers > 0 && layers != spec_.num_layers)
    throw DataError(fmt::format(
        "{}: num_hidden_layers is {}, but the weights hold layers 0 to {} (model.layers.N.*); "
        "expected a config.json that describes these weights",
        (fs::path(dir) / kConfigFile).string(), spec_.num_layers, layers - 1));
  require_model_size(spec_, (fs::path(dir) / kConfigFile).string());
  layout_ = make_param_layout(spec_);
  std::set<std::string> used;
  for (const auto& p : layout_.params) {
    for (const HfTensorPiece& piece : model_family(spec_.family).hf_pieces(p, spec_)) {
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
  // State kept outside the parameters (an expert bias): read when asked for; a file without
  // it holds the initial zeros.
  for (const HfStateTensor& t : model_family(spec_.family).hf_state(spec_)) {
    const auto it = where.find(t.tensor.name);
    if (it == where.end()) continue;
    const SafetensorsTensor* found = it->second->find(t.tensor.name);
    if (!found || found->shape != t.tensor.shape)
      throw DataError(fmt::format("{}: tensor '{}' has shape [{}]; expected [{}]",
                                  it->second->path(), t.tensor.name,
                                  found ? fmt::format("{}", fmt::join(found->shape, ", ")) : "",
                                  fmt::join(t.tensor.shape, ", ")));
    if (found->dtype != DType::F32 && found->dtype != DType::BF16 && found->dtype != DType::F16)
      throw DataError(fmt::format("{}: tensor '{}' is {}; expected F32, BF16 or F16",
                                  it->second->path(), t.tensor.name,
                                  safetensors_dtype_name(found->dtype)));
    used.insert(t.tensor.name);
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
  for (const HfTensorPiece& piece : model_family(spec_.family).hf_pieces(p, spec_)) {
    const SafetensorsFile& file = *files_->where().at(piece.name);
    const std::vector<float> v = file.to_float(piece.name);
    // A model file never holds NaN or infinity: such weights are damage, and training from
    // them would stop later with a non-finite loss that points nowhere near the file.
    if (const auto bad =
            std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
        bad != v.end())
      throw DataError(fmt::format(
          "{}: tensor '{}' holds {} non-finite values (the first, {}, at element {}); expected "
          "finite weights (a damaged or wrongly converted model?)",
          file.path(), piece.name,
          std::count_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); }), *bad,
          bad - v.begin()));
    std::copy(v.begin(), v.end(), values.begin() + piece.offset);
  }
  return values;
}

std::vector<float> HfModelReader::state(const std::string& name) const {
  for (const HfStateTensor& t : model_family(spec_.family).hf_state(spec_)) {
    if (t.state != name) continue;
    const auto it = files_->where().find(t.tensor.name);
    if (it == files_->where().end()) return std::vector<float>(t.tensor.numel(), 0.0f);
    return it->second->to_float(t.tensor.name);
  }
  return {};
}

namespace {

// Throws DataError unless the model `hf` reads has the shapes of `configured`; returns the
// differences that only change what the weights compute.
std::vector<std::string> require_configured_model(const HfModelReader& hf, const std::string& dir,
                                                  const ModelSpec& configured) {
  const std::string config = (fs::path(dir) / kConfigFile).string();
  SpecDifferences d = compare_specs(hf.spec(), configured, config);
  if (!d.shape.empty())
    throw DataError(
        fmt::format("{}: the Hugging Face model differs from the configured model: {}; set "
                    "the model keys to match ({})",
                    config, join_lines(d.shape), hf.spec().summary()));
  return std::move(d.behaviour);
}

}  // namespace

void check_hf_weights(const std::string& dir, const ModelSpec& configured) {
  const HfModelReader hf(dir);
  require_configured_model(hf, dir, configured);
}

std::vector<std::string> load_hf_weights(const std::string& dir, const ModelSpec& configured,
                                         const ParamLayout& layout, Backend& backend,
                                         const std::vector<FlatSlice>& master,
                                         const std::vector<std::pair<std::string, Tensor>>& state) {
  const HfModelReader hf(dir);
  const std::vector<std::string> behaviour = require_configured_model(hf, dir, configured);
  // A split model's rank holds parts of the parameters: each is read whole, as Hugging Face
  // stores it, and its part's runs are taken from it.
  const ParamLayout whole = make_param_layout(configured);
  for (const FlatSlice& s : master) {
    backend.fill(s.values, 0.0f);  // alignment padding
    layout.for_each_param_in(s.range, [&](const ParamInfo& p, const ParamRange& part) {
      const ParamInfo* full = whole.find(p.name);
      TS_CHECK(full != nullptr, "{} is not a parameter of the configured model", p.name);
      const std::vector<float> w = hf.weights(*full);
      p.for_each_run(part.begin - p.offset, part.end - p.offset,
                     [&](int64_t begin, int64_t count, int64_t full_begin) {
                       upload_values(backend,
                                     s.values.flat_range(p.offset + begin - s.range.begin, count),
                                     w.data() + full_begin);
                     });
    });
  }
  for (const auto& [name, tensor] : state) {
    const std::vector<float> values = hf.state(name);
    if (values.empty()) continue;  // not stored: it starts at zero
    TS_CHECK(static_cast<int64_t>(values.size()) == tensor.numel(), "{}: {} values for {}", name,
             values.size(), tensor.numel());
    backend.upload(tensor, values.data());
  }
  // A model configured without the expert bias would route differently from the file.
  if (!configured.moe.expert_bias) {
    for (const HfStateTensor& t : model_family(hf.spec().family).hf_state(hf.spec())) {
      const std::vector<float> values = hf.state(t.state);
      if (std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; }))
        throw DataError(fmt::format(
            "{}: tensor '{}' (a trained expert bias) is not zero, but the configured model has no "
            "expert bias to hold it; set moe_router_enable_expert_bias: true",
            dir, t.tensor.name));
    }
  }
  return behaviour;
}

HfTokenizer read_hf_tokenizer(const DataConfig& data) {
  HfTokenizer t;
  if (data.tokenizer_type == TokenizerType::ByteLevel) {
    t.name = tokenizer_type_name(data.tokenizer_type);
    t.vocab = 257;
    t.eos_id = 256;
    t.no_files_reason =
        "no Hugging Face tokenizer encodes exactly like Tessera's byte tokenizer (ids 0-255 = "
        "the bytes of the text, 256 = end of document): transformers only treats 256 as the end "
        "of text if it is a special token, and a special token is matched inside the text, so "
        "a document that spells it would encode differently";
    return t;
  }
  const std::unique_ptr<Tokenizer> loaded = make_tokenizer(data);
  const auto& bpe = dynamic_cast<const BpeTokenizer&>(*loaded);
  t.name = data.tokenizer_model;
  t.vocab = bpe.vocab_size();
  t.tokenizer_json = tokenizer_json_path(data.tokenizer_model);
  const AddedTokenFlags flags = read_added_token_flags(t.tokenizer_json);

  const fs::path source_config = fs::path(t.tokenizer_json).parent_path() / kTokenizerConfigFile;
  nlohmann::ordered_json& config = t.tokenizer_config;
  if (fs::exists(source_config)) {
    std::ifstream in(source_config);
    config = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!config.is_object())
      throw DataError(fmt::format("{}: not a JSON object (malformed?): expected a Hugging Face {}",
                                  source_config.string(), kTokenizerConfigFile));
  } else {
    // What the tokenizer.json itself implies; decoding leaves spaces as they are, as
    // Tessera's decode does.
    config["bos_token"] = flags.prepended ? nlohmann::ordered_json(*flags.prepended) : nullptr;
    config["clean_up_tokenization_spaces"] = false;
  }
  // The class that runs tokenizer.json as it is, in transformers 4 and 5: transformers 5's
  // model-specific classes (LlamaTokenizer, Qwen2Tokenizer) rebuild the normalizer,
  // pre-tokenizer and decoder from their own definitions, which for Llama 2 encodes text that
  // starts with a space differently.
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  // The model learned to end a document with the token training appended to each one.
  config["eos_token"] = bpe.eod_token();

  for (const char* key : kSpecialTokenKeys) {
    const std::optional<std::string> content = token_content(config, key);
    if (!content) continue;
    const std::optional<int32_t> id = bpe.token_to_id(*content);
    if (!id)
      throw DataError(fmt::format("{}: {} '{}' is not a token of {}", source_config.string(), key,
                                  *content, t.tokenizer_json));
    if (key == std::string_view("bos_token")) t.bos_id = id;
    if (key == std::string_view("pad_token")) t.pad_id = id;
    const auto added = flags.added.find(*content);
    t.special_tokens_map[key] = added != flags.added.end()
                                    ? added->second
                                    : nlohmann::ordered_json{{"content", *content},
                                                             {"lstrip", false},
                                                             {"normalized", false},
                                                             {"rstrip", false},
                                                             {"single_word", false}};
  }
  t.eos_id = bpe.eod_id();
  if (const auto extra = config.find("additional_special_tokens");
      extra != config.end() && extra->is_array() && !extra->empty())
    t.special_tokens_map["additional_special_tokens"] = *extra;
  return t;
}

void write_hf_model(const std::string& out_dir, const ModelSpec& spec,
                    const std::function<std::vector<float>(const ParamInfo&)>& weights,
                    const HfExportOptions& options, const HfStateValues& state) {
  TS_CHECK(options.dtype == DType::F32 || options.dtype == DType::BF16, "export dtype {}",
           dtype_name(options.dtype));
  nlohmann::ordered_json config = hf_config_json(spec, options.dtype);
  const HfTokenizer* tokenizer = options.tokenizer ? &*options.tokenizer : nullptr;
  if (tokenizer) {
    if (tokenizer->vocab > spec.vocab_size)
      throw DataError(fmt::format(
          "tokenizer {}: ids up to {}, but the model's vocabulary has {} (a tokenizer of "
          "another model?)",
          tokenizer->name, tokenizer->vocab - 1, spec.vocab_size));
    add_token_ids(*tokenizer, &config);
  }
  const ParamLayout layout = make_param_layout(spec);
  struct Entry {
    const ParamInfo* param;  // null: the state called `state`
    HfTensorPiece piece;
    DType dtype;
    std::string state;
  };
  // Greedy sharding in parameter order, as save_pretrained does; a tensor larger than the
  // shard size gets a shard of its own.
  std::vector<std::vector<Entry>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  auto add = [&](const ParamInfo* p, HfTensorPiece piece, DType dtype, std::string state_name) {
    const uint64_t bytes = static_cast<uint64_t>(piece.numel()) * dtype_size(dtype);
    if (!shards.back().empty() && shard_bytes + bytes > options.shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back({p, std::move(piece), dtype, std::move(state_name)});
    shard_bytes += bytes;
    total_bytes += bytes;
  };
  for (const auto& p : layout.params)
    for (HfTensorPiece& piece : model_family(spec.family).hf_pieces(p, spec))
      add(&p, std::move(piece), options.dtype, "");
  // State outside the parameters (an expert bias) is fp32 in Tessera and written exactly.
  for (HfStateTensor& t : model_family(spec.family).hf_state(spec))
    add(nullptr, std::move(t.tensor), DType::F32, std::move(t.state));
  const std::string tmp = out_dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write_file_atomically((fs::path(tmp) / kConfigFile).string(), config.dump(2) + "\n");
    if (tokenizer) {
      // Greedy decoding: transformers' default; the run has no sampling settings to record.
      nlohmann::ordered_json generation;
      add_token_ids(*tokenizer, &generation);
      generation["do_sample"] = false;
      write_file_atomically((fs::path(tmp) / kGenerationConfigFile).string(),
                            generation.dump(2) + "\n");
    }
    if (tokenizer && !tokenizer->tokenizer_json.empty()) {
      // model_max_length bounds the inputs (truncation, over-length warnings): the longest
      // sequence config.json declares the model for.
      nlohmann::ordered_json tokenizer_config = tokenizer->tokenizer_config;
      tokenizer_config["model_max_length"] = spec.max_position_embeddings;
      write_file_atomically((fs::path(tmp) / kTokenizerFile).string(),
                            read_bytes(tokenizer->tokenizer_json));
      write_file_atomically((fs::path(tmp) / kTokenizerConfigFile).string(),
                            tokenizer_config.dump(2) + "\n");
      write_file_atomically((fs::path(tmp) / kSpecialTokensMapFile).string(),
                            tokenizer->special_tokens_map.dump(2) + "\n");
    }
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
        tensors.push_back({e.piece.name, e.dtype, e.piece.shape});
        weight_map[e.piece.name] = name;
      }
      write_safetensors(
          (fs::path(tmp) / name).string(), tensors, {{"format", "pt"}}, [&](size_t i, void* dst) {
            const Entry& e = shards[k][i];
            if (e.param == nullptr) {
              const std::vector<float> v = state ? state(e.state) : std::vector<float>();
              if (v.empty()) {  // never moved from its initial zeros
                std::memset(dst, 0, e.piece.numel() * sizeof(float));
                return;
              }
              TS_CHECK(static_cast<int64_t>(v.size()) == e.piece.numel(), "{}: {} values for {}",
                       e.state, v.size(), e.piece.numel());
              std::memcpy(dst, v.data(), v.size() * sizeof(float));
              return;
            }
            if (cached_param != e.param) {
              cached = weights(*e.param);
              cached_param = e.param;
            }
            const float* src = cached.data() + e.piece.offset;
            if (options.dtype == DType::F32) {
              std::memcpy(dst, src, e.piece.numel() * sizeof(float));
            } else {
              auto* out = static_cast<uint16_t*>(dst);
              for (int64_t n = 0; n < e.piece.numel(); ++n) out[n] = float_to_bf16_bits(src[n]);
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
