#pragma once
// What every decoder family's spec builder shares: the experiment's attention, MLP, RoPE and
// norm keys as Megatron derives them, and the error for a key a family cannot honour.
#include <string>

#include "tessera/config/config.h"
#include "tessera/model/model_spec.h"

namespace tessera {

// The sizes every decoder family shares (attention, dense MLP, RoPE, norms, vocabulary left
// to the caller), derived as Megatron derives them.
ModelSpec decoder_spec(const Experiment& e);
// What a dense decoder family with QK norms and neither QKV biases nor windows (as Qwen3 and
// OLMo 2 are) requires of the experiment's model keys: each refusal names the key and says,
// from `why`, what the family's models are.
struct QkNormDecoderFacts {
  const char* dense;         // "the dense Qwen3 models"
  const char* qk_norm;       // "Qwen3 normalises each query and key head"
  const char* no_bias;       // "Qwen3 has no QKV bias"
  const char* full_context;  // "its released models attend to the whole context"
};
void require_qk_norm_decoder_keys(const Experiment& e, const std::string& family,
                                  const QkNormDecoderFacts& why);
// Why `family`, a dense decoder with QK norms and neither biases nor windows (as Qwen3 and
// OLMo 2 are), cannot build a description read from a file; empty when it can.
std::string qk_norm_decoder_problem(const ModelSpec& s, const std::string& family);
// ConfigError naming `key` (its value and where it was set) and what was expected.
[[noreturn]] void reject_model_key(const Experiment& e, const char* key,
                                   const std::string& expected);

}  // namespace tessera
