#pragma once
// Grouped-query self-attention with rotary embeddings (Llama, Qwen, Mistral, OLMo 2), on its
// input `in` (the normed stream):
//   qkv = in @ Wqkv^T (+ bias)               (N, (H + 2 KV) D), q, k, v heads packed per token
//   QK norms: RMSNorm over each q head (q_norm) and k head (k_norm) (Qwen3), or over all of q
//   and all of k (OLMo 2)
//   rope on the q and k heads (but in NoPE layers); att = causal (optionally windowed) softmax
//   attention (N, H D)
//   out = att @ Wo^T                         (N, C)
// Window, rope base, NoPE and the QK norms are per layer (AttentionOptions): local and global
// layers are one mixer with two sets of options.
// In generation each position's key and value heads go to the cache (2 KV D per position), and
// a new token's query attends to them (Backend::attention_decode).
#include "tessera/model/block.h"

namespace tessera {

enum class QkNorm {
  None,
  PerHead,  // q_norm and k_norm of head_dim, shared by the heads (Qwen3, Gemma 3)
  Whole,    // q_norm over every query head's values, k_norm over every key head's (OLMo 2)
};

// What a family chooses for one layer's attention.
struct AttentionOptions {
  int64_t window = 0;    // sliding window; 0: full causal attention
  bool rope = true;      // false: no rotary embedding (NoPE layers)
  double rope_base = 0;  // the rotary table's base; 0: the model's (rotary_base, its scaling)
  QkNorm qk_norm = QkNorm::None;
};

// The model-wide choices of `spec`: its sliding window, its rope, Qwen3's per-head QK norms.
AttentionOptions default_attention(const ModelSpec& spec);

class GqaAttention final : public Mixer {
 public:
  GqaAttention(const ModelSpec& spec, AttentionOptions options);

  const char* range_name() const override { return "attention_block"; }
  const char* backward_range_name() const override { return "attention_block_backward"; }
  const char* param_prefix() const override { return "self_attn."; }
  void declare_params(ParamLayoutBuilder& builder) override;
  std::vector<int> linear_weights() const override { return {qkv_weight_, o_proj_}; }
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const LinearOperand& in) override;
  int input_linear() const override { return qkv_weight_; }
  void forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) override;
  void backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout, const Tensor& din,
                const std::function<void()>& recompute_in) override;
  int64_t cache_width() const override { return 2 * s_.kv_heads * s_.head_dim; }
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in, const Tensor& out,
                      const Tensor& residual, const Tensor& cache, const CachePosition& at) override;
  std::vector<double> rope_bases() const override;
  std::vector<LinearGemm> linear_gemms() const override;
  std::optional<AttentionShape> attention_shape(int64_t batch, int64_t seq) const override {
    return shape(batch, seq);
  }
  double attention_flops_per_token(int64_t seq_length) const override;

 private:
  AttentionShape shape(int64_t batch, int64_t seq) const;
  // The norms' tensors of one pass: the projection before them (raw), and for whole-q/k norms
  // contiguous copies of q and k with their statistics.
  struct QkTensors {
    Tensor raw, rstd;  // the projection (N, width); PerHead: rstd (N, H + KV)
    // Whole: q (N, H D) and k (N, KV D) as projected, their rstd (N) each, and a norm's
    // output (N, H D) before it goes back into qkv.
    Tensor q, k, q_rstd, k_rstd, normed;
  };
  // t.raw -> qkv through the QK norms.
  void qk_norm_forward(ForwardOps& ops, const QkTensors& t, const Tensor& qkv,
                       const AttentionShape& a) const;
  // The QK norms' tensors of n tokens taken from `scratch` (generation).
  QkTensors qk_scratch(ScratchArena& scratch, int64_t n, DType dtype) const;

  ModelSpec s_;
  AttentionOptions o_;
  int qkv_weight_ = -1, qkv_bias_ = -1, o_proj_ = -1;
  int q_norm_ = -1, k_norm_ = -1;
  Tensor qkv_, att_, lse_;    // activations
  QkTensors qk_;              // with QK norms
  Tensor datt_, dqkv_;        // backward scratch
  Tensor dq_, dk_, dnormed_;  // backward scratch of whole-q/k norms
};

}  // namespace tessera
