#pragma once
// What every decoder family's Hugging Face config.json shares, read and written once: the
// sizes of attention and layers, the vocabulary, RMSNorm's epsilon, tied embeddings, the
// initializer, the activation and RoPE's base and scaling, in both of transformers' spellings.
// A family reads these, then its own fields (experts, latent ranks, windows, biases).
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/model/model_family.h"
#include "tessera/model/model_spec.h"

namespace tessera {

// One config.json being read: `model_type` names the architecture in messages ("qwen3").
class HfConfig {
 public:
  HfConfig(const nlohmann::json& json, std::string file, std::string model_type)
      : json_(json), file_(std::move(file)), model_type_(std::move(model_type)) {}

  const nlohmann::json& json() const { return json_; }
  const std::string& file() const { return file_; }
  // Present and not null.
  bool has(const char* key) const { return json_.contains(key) && !json_[key].is_null(); }
  // DataError naming the file and the field when it is missing.
  int64_t required(const char* key) const;
  // The field, or `fallback` (transformers' default) when missing or null.
  int64_t count(const char* key, int64_t fallback) const {
    return has(key) ? json_[key].get<int64_t>() : fallback;
  }
  // "<file>: <what> is not supported by Tessera's <model_type> model".
  DataError unsupported(const std::string& what) const;
  // DataError "<file>: <what>" for a field of the wrong type or an inconsistency.
  DataError invalid(const std::string& what) const;

 private:
  const nlohmann::json& json_;
  std::string file_, model_type_;
};

// transformers' defaults of one architecture for fields a config may leave out.
struct HfDecoderDefaults {
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
};

// A Hugging Face config's RoPE: transformers 5 keeps rope_theta and the scaling in
// rope_parameters, earlier versions rope_theta and rope_scaling at the top level. `params` is
// whichever holds the scaling (empty without one), `theta` the base (default_theta when
// neither says), `type` its rope_type (or legacy type; "default" without one).
struct HfRope {
  nlohmann::json params = nlohmann::json::object();
  double theta = 10000.0;
  std::string type = "default";
};
HfRope read_hf_rope(const nlohmann::json& config, double default_theta);

// The shared fields: hidden_size, num_hidden_layers, num_attention_heads and vocab_size
// (required), num_key_value_heads, head_dim, max_position_embeddings, rms_norm_eps,
// tie_word_embeddings, initializer_range and rope_theta (with `d` for a missing one), and
// hidden_act, which must be silu. Returns the spec with those set and the RoPE it found, for
// the family to accept or refuse its type (rope_llama3() reads Llama 3.1's).
ModelSpec read_hf_decoder(const HfConfig& c, const HfDecoderDefaults& d, HfRope* rope);
// Unscaled RoPE (type "default"), or Llama 3.1's scaling (type "llama3") into `s`; any other
// type is refused as unsupported.
void read_hf_default_or_llama3_rope(const HfConfig& c, const HfRope& rope, ModelSpec& s);
// DataError naming the file unless the attention and layer sizes of `s` are positive and the
// heads a multiple of the KV heads; `more` adds the family's own sizes to the message.
void check_hf_decoder_sizes(const HfConfig& c, const ModelSpec& s, bool more_ok = true,
                            const std::string& more = "");

// config.json's shared fields for `s` as the class `hf_class` of `model_type`, in
// transformers' order (head_dim left out where the architecture derives it); the family adds
// its own, then write_hf_rope and "use_cache".
nlohmann::ordered_json hf_decoder_config(const ModelSpec& s, const std::string& hf_class,
                                         const std::string& model_type, bool head_dim = true);
// rope_theta and the scaling (null, or an object with its rope_type) in both spellings:
// rope_theta + rope_scaling for transformers 4, rope_parameters for 5 (which has no legacy
// "type" key).
void write_hf_rope(nlohmann::ordered_json& j, double theta, const nlohmann::ordered_json& scaling);
// Llama 3.1's scaling of `s` as config.json writes it, or null.
nlohmann::ordered_json hf_llama3_rope(const ModelSpec& s);
// The tensors of the parameters every decoder family names alike: q/k/v and gate/up, which
// Tessera fuses along the output dimension (each fused tensor is its Hugging Face pieces
// stacked in order, ParamInfo::fused_rows), the blocks' pre-norms (Hugging Face's
// input_layernorm and post_attention_layernorm), and everything else under its own name.
std::vector<HfTensorPiece> hf_decoder_pieces(const ParamInfo& p);
bool ends_with(const std::string& s, std::string_view suffix);

// The shortest decimal that reads back as the same float: 1e-05, not 9.999999747e-06.
double shortest_decimal(float v);

}  // namespace tessera
