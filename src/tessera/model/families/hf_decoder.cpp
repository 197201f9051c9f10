#include "tessera/model/families/hf_decoder.h"

#include <algorithm>

#include <fmt/format.h>

namespace tessera {

int64_t HfConfig::required(const char* key) const {
  if (!has(key)) throw DataError(fmt::format("{}: field '{}' is missing", file_, key));
  return json_[key].get<int64_t>();
}

DataError HfConfig::unsupported(const std::string& what) const {
  return DataError(
      fmt::format("{}: {} is not supported by Tessera's {} model", file_, what, model_type_));
}

DataError HfConfig::invalid(const std::string& what) const {
  return DataError(fmt::format("{}: {}", file_, what));
}

HfRope read_hf_rope(const nlohmann::json& j, double default_theta) {
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  HfRope r;
  if (has("rope_parameters"))
    r.params = j["rope_parameters"];
  else if (has("rope_scaling"))
    r.params = j["rope_scaling"];
  r.theta = r.params.contains("rope_theta") ? r.params["rope_theta"].get<double>()
            : has("rope_theta")             ? j["rope_theta"].get<double>()
                                            : default_theta;
  r.type = r.params.value("rope_type", r.params.value("type", std::string("default")));
  return r;
}

ModelSpec read_hf_decoder(const HfConfig& c, const HfDecoderDefaults& d, HfRope* rope) {
  const nlohmann::json& j = c.json();
  ModelSpec s;
  s.hidden = c.required("hidden_size");
  s.num_layers = c.required("num_hidden_layers");
  s.heads = c.required("num_attention_heads");
  s.vocab_size = c.required("vocab_size");
  s.kv_heads = c.count("num_key_value_heads", s.heads);
  s.head_dim = c.count("head_dim", s.hidden / std::max<int64_t>(s.heads, 1));
  s.max_position_embeddings = c.count("max_position_embeddings", d.max_position_embeddings);
  s.norm_eps = static_cast<float>(j.value("rms_norm_eps", d.rms_norm_eps));
  s.tied_embeddings = j.value("tie_word_embeddings", false);
  s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
  if (j.value("hidden_act", std::string("silu")) != "silu")
    throw c.unsupported(
        fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
  *rope = read_hf_rope(j, d.rope_theta);
  s.rotary_base = rope->theta;
  s.tokenizer_vocab = s.vocab_size;
  return s;
}

void read_hf_default_or_llama3_rope(const HfConfig& c, const HfRope& rope, ModelSpec& s) {
  if (rope.type == "default") return;
  if (rope.type != "llama3")
    throw c.unsupported(fmt::format("RoPE type '{}' (expected llama3 or default)", rope.type));
  const nlohmann::json& r = rope.params;
  s.rope_scaling.enabled = true;
  s.rope_scaling.factor = r.at("factor").get<double>();
  s.rope_scaling.low_freq_factor = r.at("low_freq_factor").get<double>();
  s.rope_scaling.high_freq_factor = r.at("high_freq_factor").get<double>();
  s.rope_scaling.original_max_position_embeddings =
      r.at("original_max_position_embeddings").get<int64_t>();
}

void check_hf_decoder_sizes(const HfConfig& c, const ModelSpec& s, bool more_ok,
                            const std::string& more) {
  if (s.hidden > 0 && s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0 &&
      s.head_dim > 0 && s.num_layers > 0 && s.vocab_size > 0 && more_ok)
    return;
  throw c.invalid(fmt::format(
      "inconsistent sizes (hidden_size {}, num_attention_heads {}, num_key_value_heads {}, "
      "head_dim {}, num_hidden_layers {}, vocab_size {}{})",
      s.hidden, s.heads, s.kv_heads, s.head_dim, s.num_layers, s.vocab_size,
      more.empty() ? "" : ", " + more));
}

double shortest_decimal(float v) {
  return std::stod(fmt::format("{}", v));
}

nlohmann::ordered_json hf_decoder_config(const ModelSpec& s, const std::string& hf_class,
                                         const std::string& model_type, bool head_dim) {
  nlohmann::ordered_json j;
  j["architectures"] = {hf_class};
  j["model_type"] = model_type;
  j["vocab_size"] = s.vocab_size;
  j["hidden_size"] = s.hidden;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.kv_heads;
  if (head_dim) j["head_dim"] = s.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = s.max_position_embeddings;
  j["rms_norm_eps"] = shortest_decimal(s.norm_eps);
  j["tie_word_embeddings"] = s.tied_embeddings;
  j["initializer_range"] = shortest_decimal(s.init_std);
  j["attention_dropout"] = 0.0;
  return j;
}

void write_hf_rope(nlohmann::ordered_json& j, double theta, const nlohmann::ordered_json& scaling) {
  nlohmann::ordered_json params = {{"rope_type", "default"}};
  if (!scaling.is_null()) {
    params = scaling;
    params.erase("type");
  }
  params["rope_theta"] = theta;
  j["rope_theta"] = theta;
  j["rope_scaling"] = scaling;
  j["rope_parameters"] = params;
}

nlohmann::ordered_json hf_llama3_rope(const ModelSpec& s) {
  if (!s.rope_scaling.enabled) return nullptr;
  return {{"rope_type", "llama3"},
          {"factor", s.rope_scaling.factor},
          {"low_freq_factor", s.rope_scaling.low_freq_factor},
          {"high_freq_factor", s.rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", s.rope_scaling.original_max_position_embeddings}};
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<HfTensorPiece> hf_decoder_pieces(const ParamInfo& p) {
  const int64_t cols = p.shape.rank() == 2 ? p.shape[1] : 1;
  auto piece = [&](std::string name, int64_t row, int64_t rows) {
    HfTensorPiece t{std::move(name), row * cols, {rows}};
    if (p.shape.rank() == 2) t.shape.push_back(cols);
    return t;
  };
  // The fused projections, with Hugging Face's names of their pieces in stacking order.
  static const std::pair<std::string_view, std::vector<std::string_view>> kFused[] = {
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}}, {"gate_up_proj", {"gate_proj", "up_proj"}}};
  const std::string kind = ends_with(p.name, ".bias") ? "bias" : "weight";
  for (const auto& [fused, parts] : kFused) {
    const std::string suffix = std::string(fused) + "." + kind;
    if (!ends_with(p.name, suffix)) continue;
    TS_CHECK(p.fused_rows.size() == parts.size(), "{}: {} fused pieces, expected {}", p.name,
             p.fused_rows.size(), parts.size());
    const std::string base = p.name.substr(0, p.name.size() - suffix.size());
    std::vector<HfTensorPiece> out;
    int64_t row = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      out.push_back(piece(base + std::string(parts[i]) + "." + kind, row, p.fused_rows[i]));
      row += p.fused_rows[i];
    }
    return out;
  }
  // A block's pre-norm carries its Hugging Face class's name.
  static const std::pair<std::string_view, std::string_view> kNorms[] = {
      {"self_attn.norm.weight", "input_layernorm.weight"},
      {"mlp.norm.weight", "post_attention_layernorm.weight"}};
  for (const auto& [tessera, hf] : kNorms)
    if (ends_with(p.name, std::string(tessera)))
      return {
          piece(p.name.substr(0, p.name.size() - tessera.size()) + std::string(hf), 0, p.shape[0])};
  return {piece(p.name, 0, p.shape[0])};
}

}  // namespace tessera
