#pragma once
// Grouped-query self-attention with rotary embeddings (Llama, Qwen 2.5, Mistral):
//   ln  = rmsnorm(x)                         (N, C)
//   qkv = ln @ Wqkv^T (+ bias)               (N, (H + 2 KV) D), q, k, v heads packed per token
//   with qk_norm (Qwen3): RMSNorm over each q head (q_norm) and k head (k_norm)
//   rope on the q and k heads; att = causal (optionally windowed) softmax attention (N, H D)
//   out = x + att @ Wo^T                     (N, C)
// In generation each position's key and value heads go to the cache (2 KV D per position), and
// a new token's query attends to them (Backend::attention_decode).
#include "tessera/model/block.h"

namespace tessera {

class GqaAttentionBlock final : public Block {
 public:
  explicit GqaAttentionBlock(const ModelSpec& spec) : s_(spec) {}

  const char* range_name() const override { return "attention_block"; }
  const char* backward_range_name() const override { return "attention_block_backward"; }
  void declare_params(ParamLayoutBuilder& builder) override;
  std::vector<int> linear_weights() const override { return {qkv_weight_, o_proj_}; }
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const Tensor& x) override;
  void forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) override;
  void backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) override;
  int64_t cache_width() const override { return 2 * s_.kv_heads * s_.head_dim; }
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x, const Tensor& out,
                      const Tensor& cache, int64_t pos) override;
  int64_t matmul_params() const override;
  double attention_flops_per_token(int64_t seq_length) const override;

 private:
  AttentionShape shape(int64_t batch, int64_t seq) const;

  ModelSpec s_;
  int norm_ = -1, qkv_weight_ = -1, qkv_bias_ = -1, o_proj_ = -1;
  int q_norm_ = -1, k_norm_ = -1;
  Tensor ln_, rstd_, qkv_, att_, lse_;  // activations
  Tensor qkv_raw_, qk_rstd_;            // with qk_norm: the projection before the norms
  Tensor datt_, dqkv_;                  // backward scratch
};

}  // namespace tessera
