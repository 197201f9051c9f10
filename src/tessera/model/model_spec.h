#pragma once
// ModelSpec: the resolved dimensions of a decoder model (derived values filled in, vocabulary
// padded), plus the parameter and FLOP counts every report uses. One struct holds the sizes
// of every family; its family (model/model_family.h) says which of them its blocks read.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

struct RopeScaling {  // Llama 3.1 ("llama3" rope_type in Hugging Face configs)
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// DeepSeek's YaRN RoPE (rope_type yarn; model/rope.h builds its table): frequencies making fewer
// than beta_slow rotations over original_max_position_embeddings are divided by `factor`, those
// making more than beta_fast are kept, a linear ramp lies between; cos and sin are multiplied by
// mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale by
// mscale(factor, mscale_all_dim)^2, with mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1).
struct YarnRope {
  bool enabled = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;
};

// Multi-head latent attention (DeepSeek-V2/V3; model/blocks/mla_attention.h). An MLA model has
// as many key/value heads as query heads, and its head_dim is the RoPE part (the rope table's
// width), as Hugging Face's DeepseekV3Config sets it.
struct MlaSpec {
  bool enabled = false;
  int64_t q_lora_rank = 0;  // 0: queries projected straight from the hidden state
  int64_t kv_lora_rank = 0;
  int64_t qk_head_dim = 0;  // per head, without RoPE (Dn)
  int64_t rope_dim = 0;     // per head, with RoPE (Dr; the key's shared by every head)
  int64_t v_head_dim = 0;   // Dv
  int64_t qk_dim() const { return qk_head_dim + rope_dim; }  // D = Dn + Dr
};

// The mixture-of-experts part of a model (docs/moe.md); experts 0 is a dense model.
struct MoeSpec {
  int64_t experts = 0;
  int64_t topk = 0;
  int64_t ffn = 0;           // each routed expert's SwiGLU width
  int64_t shared_ffn = 0;    // the shared expert's width; 0: none
  std::vector<bool> layers;  // per decoder layer: an MoE MLP (else the dense SwiGLU)
  MoeLoadBalancing load_balancing = MoeLoadBalancing::AuxLoss;
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  bool sigmoid = false;  // moe_router_score_function sigmoid
  bool pre_softmax = false;
  bool expert_bias = false;  // aux-loss-free balancing
  double bias_update_rate = 1e-3;
  int64_t num_groups = 0, group_topk = 0;
  double topk_scaling = 0.0;  // 0: unscaled
  // Token dropping (moe_expert_capacity_factor; 0: dropless) and which pairs go
  // (moe_token_drop_policy position: the latest tokens; else the lowest weights).
  double capacity_factor = 0.0;
  bool drop_by_position = false;

  bool enabled() const { return experts > 0; }
  // (token, expert) pairs each expert takes of a pass over `tokens` tokens (Megatron's
  // get_capacity over tokens x topk pairs); 0 when dropless.
  int64_t capacity(int64_t tokens) const;
  bool is_moe_layer(int64_t layer) const {
    return enabled() && layer >= 0 && layer < static_cast<int64_t>(layers.size()) &&
           layers[static_cast<size_t>(layer)];
  }
  int64_t moe_layers() const;
};

struct ModelSpec {
  std::string family = "llama";  // model/model_family.h
  int64_t vocab_size = 0;        // padded; rows of the embedding and output head
  int64_t tokenizer_vocab = 0;   // ids the data can contain (<= vocab_size)
  int64_t num_layers = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rotary_base = 10000.0;
  RopeScaling rope_scaling;
  float norm_eps = 1e-5f;
  bool qkv_bias = false;
  bool tied_embeddings = false;
  int64_t sliding_window = 0;
  float init_std = 0.02f;
  bool qk_norm = false;  // RMSNorm over each query and key head (Qwen3)
  // Family options of the decoder's ends: the embedding's output times embedding_scale (0:
  // none; Gemma's sqrt(hidden)), and the logits soft-capped at logit_softcap (0: none; Gemma
  // 2's final_logit_softcapping).
  double embedding_scale = 0;
  double logit_softcap = 0;
  MoeSpec moe;
  MlaSpec mla;
  YarnRope yarn;

  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
  int64_t kv_width() const { return 2 * kv_heads * head_dim; }  // of qkv's keys and values
  int64_t attn_width() const { return heads * head_dim; }
  // Weights that are multiplied: every layer's projections and the output head (not the
  // embedding lookup), as in the Megatron/NeMo FLOPs convention; each block counts its own.
  // An MoE layer counts the weights one token multiplies: the router, its top-k experts and
  // the shared expert (active parameters).
  int64_t matmul_params() const;
  int64_t total_params() const;
  // total_params without the routed experts a token does not use (all of them when dense).
  int64_t active_params() const;
  // Model FLOPs per token for training: 6 * matmul_params + each block's attention FLOPs
  // (GQA: 12 * s_eff * heads*head_dim per layer, s_eff = min(seq_length, sliding_window);
  // MLA: 6 * s_eff * heads * (qk_dim + v_head_dim), the same with its two head sizes), the
  // attention term counted over every pair in reach (Megatron's num_floating_point_operations)
  // or halved for causal masks (Megatron-Bridge's recipes: causal_self_attn).
  enum class AttentionCount { AllPairs, CausalHalf };
  double flops_per_token(int64_t seq_length,
                         AttentionCount count = AttentionCount::AllPairs) const;
  std::string summary() const;
};

// What one of `parts` tensor-parallel ranks computes of `spec`'s model: its share of the
// query heads, key/value heads, MLP width and vocabulary (Megatron's per-partition sizes).
// Blocks built from it declare the shapes of a rank's part of each parameter.
ModelSpec tensor_parallel_shard(const ModelSpec& spec, int parts);

// The experiment's model: its family (model_family key; ConfigError naming the registered
// families otherwise) resolves the derived sizes, then the vocabulary is padded to a multiple
// of make_vocab_size_divisible_by x tensor_model_parallel_size (Megatron). `tokenizer_vocab` fills
// vocab_size=0. Throws ConfigError if vocab_size is smaller than the tokenizer's.
ModelSpec make_model_spec(const Experiment& e, int64_t tokenizer_vocab);

}  // namespace tessera
