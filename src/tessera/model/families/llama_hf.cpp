// The Llama family's Hugging Face side: config.json of llama, qwen2 and mistral models <->
// ModelSpec, and the tensor names of each parameter. Hugging Face keeps q/k/v and gate/up as
// separate tensors; Tessera fuses them along the output dimension (rows), so each fused tensor
// is its Hugging Face pieces stacked in order (ParamInfo::fused_rows). Both use rotate-half
// RoPE, so no weight permutation is needed.
#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/families/llama.h"

namespace tessera {
namespace {

enum class Arch { Llama, Qwen2, Mistral };

Arch parse_arch(const std::string& type) {
  return type == "qwen2" ? Arch::Qwen2 : type == "mistral" ? Arch::Mistral : Arch::Llama;
}

const char* type_name(Arch a) {
  switch (a) {
    case Arch::Llama:
      return "llama";
    case Arch::Qwen2:
      return "qwen2";
    case Arch::Mistral:
      return "mistral";
  }
  return "?";
}

const char* class_name(Arch a) {
  switch (a) {
    case Arch::Llama:
      return "LlamaForCausalLM";
    case Arch::Qwen2:
      return "Qwen2ForCausalLM";
    case Arch::Mistral:
      return "MistralForCausalLM";
  }
  return "?";
}

// qwen2 with QKV bias, mistral with a sliding window, else llama.
Arch architecture_for(const ModelSpec& s) {
  if (s.qkv_bias && s.sliding_window > 0)
    throw DataError(
        "no supported Hugging Face architecture has both QKV bias and a sliding window "
        "(qwen2 has the bias, mistral the window)");
  if (s.qkv_bias) return Arch::Qwen2;
  return s.sliding_window > 0 ? Arch::Mistral : Arch::Llama;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ModelSpec LlamaFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  const std::string type = j.value("model_type", std::string());
  const Arch arch = parse_arch(type);
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
    const int64_t default_positions = arch == Arch::Llama   ? 2048
                                      : arch == Arch::Qwen2 ? 32768
                                                            : 131072;
    s.max_position_embeddings = j.value("max_position_embeddings", default_positions);
    s.norm_eps = static_cast<float>(j.value("rms_norm_eps", 1e-6));
    s.tied_embeddings = j.value("tie_word_embeddings", false);
    s.init_std = static_cast<float>(j.value("initializer_range", 0.02));
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw unsupported(
          fmt::format("hidden_act '{}' (expected silu)", j["hidden_act"].get<std::string>()));
    if (arch == Arch::Llama && j.value("attention_bias", false))
      throw unsupported("attention_bias: true (Llama's bias includes o_proj)");
    if (j.value("mlp_bias", false)) throw unsupported("mlp_bias: true");
    s.qkv_bias = arch == Arch::Qwen2;
    if (arch == Arch::Qwen2 && j.value("use_sliding_window", false))
      throw unsupported("use_sliding_window: true (Qwen2's per-layer windows)");
    if (arch == Arch::Mistral)
      s.sliding_window = !j.contains("sliding_window") ? 4096
                         : has("sliding_window")       ? j["sliding_window"].get<int64_t>()
                                                       : 0;
    const HfRope hf_rope = read_hf_rope(j, 10000.0);
    const nlohmann::json& rope = hf_rope.params;
    const std::string& rope_type = hf_rope.type;
    s.rotary_base = hf_rope.theta;
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
  return s;
}

std::string LlamaFamily::hf_model_type(const ModelSpec& s) const {
  return type_name(architecture_for(s));
}

nlohmann::ordered_json LlamaFamily::hf_config(const ModelSpec& s) const {
  const Arch arch = architecture_for(s);
  nlohmann::ordered_json j;
  j["architectures"] = {class_name(arch)};
  j["model_type"] = type_name(arch);
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
    case Arch::Llama:
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
      break;
    case Arch::Qwen2:
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = s.num_layers;
      break;
    case Arch::Mistral:
      j["sliding_window"] = s.sliding_window;
      break;
  }
  j["use_cache"] = true;
  return j;
}

std::vector<HfTensorPiece> LlamaFamily::hf_pieces(const ParamInfo& p,
                                                  const ModelSpec& /*s*/) const {
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
