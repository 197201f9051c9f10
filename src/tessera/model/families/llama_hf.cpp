// The Llama family's Hugging Face side: config.json of llama, qwen2 and mistral models <->
// ModelSpec; its tensors are the decoder's shared names (hf_decoder_pieces). Both use
// rotate-half RoPE, so no weight permutation is needed.
#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/families/hf_decoder.h"
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

}  // namespace

ModelSpec LlamaFamily::read_hf_config(const nlohmann::json& j, const std::string& file) const {
  const Arch arch = parse_arch(j.value("model_type", std::string()));
  const HfConfig c(j, file, type_name(arch));
  ModelSpec s;
  try {
    // Defaults are those of transformers' config classes for a missing field.
    HfDecoderDefaults d;
    d.max_position_embeddings = arch == Arch::Llama   ? 2048
                                : arch == Arch::Qwen2 ? 32768
                                                      : 131072;
    HfRope rope;
    s = read_hf_decoder(c, d, &rope);
    s.ffn = c.required("intermediate_size");
    if (arch == Arch::Llama && j.value("attention_bias", false))
      throw c.unsupported("attention_bias: true (Llama's bias includes o_proj)");
    if (j.value("mlp_bias", false)) throw c.unsupported("mlp_bias: true");
    s.qkv_bias = arch == Arch::Qwen2;
    if (arch == Arch::Qwen2 && j.value("use_sliding_window", false))
      throw c.unsupported("use_sliding_window: true (Qwen2's per-layer windows)");
    if (arch == Arch::Mistral)
      s.sliding_window = !j.contains("sliding_window") ? 4096 : c.count("sliding_window", 0);
    read_hf_default_or_llama3_rope(c, rope, s);
  } catch (const nlohmann::json::exception& e) {
    throw c.invalid(e.what());
  }
  check_hf_decoder_sizes(c, s, s.ffn > 0, fmt::format("intermediate_size {}", s.ffn));
  return s;
}

std::string LlamaFamily::hf_model_type(const ModelSpec& s) const {
  return type_name(architecture_for(s));
}

nlohmann::ordered_json LlamaFamily::hf_config(const ModelSpec& s) const {
  const Arch arch = architecture_for(s);
  nlohmann::ordered_json j = hf_decoder_config(s, class_name(arch), type_name(arch));
  j["intermediate_size"] = s.ffn;
  write_hf_rope(j, s.rotary_base, hf_llama3_rope(s));
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
  return hf_decoder_pieces(p);
}

}  // namespace tessera
