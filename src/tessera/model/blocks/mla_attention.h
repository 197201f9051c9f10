#pragma once
// Multi-head latent attention (DeepSeek-V2/V3, as Hugging Face's DeepseekV3Attention computes
// it), H heads, queries and keys of D = Dn + Dr (a part without RoPE and one with it), values
// of Dv, on its input `in` (ln, the normed stream):
//   a     = ln @ Wa^T = [q_a | c_kv | k_rope]   with q_lora_rank Qr       (N, Qr + Kr + Dr)
//                     = [q   | c_kv | k_rope]   without                   (N, H D + Kr + Dr)
//   q     = rmsnorm(q_a) @ Wq_b^T                (with q_lora_rank)       (N, H D)
//   kv    = rmsnorm(c_kv) @ Wkv_b^T              per head [k_nope | v]    (N, H (Dn + Dv))
//   qkv   = per head: the query; [k_nope | the rope key]; v, with RoPE on the queries' rope
//           parts and the rope key only, one rope key for every head (Backend::mla_qkv_forward;
//           DeepSeek's interleaved RoPE, so Hugging Face's weights load as they are)
//   att   = causal attention, queries and keys of D, values of Dv        (N, H Dv)
//   out   = att @ Wo^T
// Wa fuses Hugging Face's q_a_proj (or q_proj) and kv_a_proj_with_mqa, so one GEMM reads ln and
// one data-gradient GEMM gives d(ln). The softmax scale is 1/sqrt(D), times YaRN's
// mscale(factor, mscale_all_dim)^2 (model/rope.h).
//
// Stored for the backward: the latents before their norms (q_a, c_kv), the packed qkv, the
// attention output and its log-sum-exps; the latents' norm outputs are recomputable. The fused
// output a, the queries q and kv are needed only until the packing: they live in the buffers of
// their own gradients, which are backward scratch (free outside a block's backward).
//
// In generation each position's keys and values (H (D + Dv)) go to the cache: the full heads,
// not the latent.
#include "tessera/model/block.h"

namespace tessera {

class MlaAttention final : public Mixer {
 public:
  explicit MlaAttention(const ModelSpec& spec);

  const char* range_name() const override { return "attention_block"; }
  const char* backward_range_name() const override { return "attention_block_backward"; }
  const char* param_prefix() const override { return "self_attn."; }
  void declare_params(ParamLayoutBuilder& builder) override;
  std::vector<int> linear_weights() const override;
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const LinearOperand& in) override;
  void forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) override;
  void backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout, const Tensor& din,
                const std::function<void()>& recompute_in) override;
  int64_t cache_width() const override { return H_ * (D_ + Dv_); }
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in, const Tensor& out,
                      const Tensor& residual, const Tensor& cache, const CachePosition& at) override;
  std::vector<double> rope_bases() const override { return {0.0}; }
  std::vector<LinearGemm> linear_gemms() const override;
  std::optional<AttentionShape> attention_shape(int64_t batch, int64_t seq) const override {
    return shape(batch, seq);
  }
  double attention_flops_per_token(int64_t seq_length) const override;

  // Width of the fused projection's output a: the queries (or their latent), c_kv, the rope key.
  int64_t fused_width() const { return Qa_ + Kr_ + Dr_; }

 private:
  AttentionShape shape(int64_t batch, int64_t seq) const;
  // The tensors of one forward pass over n tokens (training or generation).
  struct Pass {
    Tensor ln, a, q_a, q_a_ln, q_rstd, q, c_kv, c_kv_ln, kv_rstd, kv, qkv;
  };
  // t.ln (the mixer's input) -> t.qkv, the attention's packed input; freqs row t is the rope
  // table of token t of each sequence.
  void pack_qkv(ForwardOps& ops, const Pass& t, const Tensor& freqs, const AttentionShape& a);

  ModelSpec s_;
  bool lora_ = false;
  int64_t H_ = 0, Dn_ = 0, Dr_ = 0, D_ = 0, Dv_ = 0, Qr_ = 0, Kr_ = 0;
  int64_t Qa_ = 0;  // columns of a before c_kv: Qr with q_lora_rank, else H D
  int a_proj_ = -1, q_a_norm_ = -1, q_b_proj_ = -1, kv_a_norm_ = -1, kv_b_proj_ = -1;
  int o_proj_ = -1;
  // activations
  Tensor q_a_, q_a_ln_, q_rstd_, c_kv_, c_kv_ln_, kv_rstd_, qkv_, att_, lse_;
  // backward scratch (da, dq and dkv also hold the forward's a, q and kv)
  Tensor datt_, dqkv_, dq_, dkv_, da_, dq_a_ln_, dq_a_, dc_kv_ln_, dc_kv_;
};

}  // namespace tessera
