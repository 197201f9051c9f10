#pragma once
// The oracle of the op-test registry (op_registry.h): a backend whose every computing op runs
// the double instances of backend/cpu/reference.h on double copies of its fp32 tensors (int32
// for ids) and rounds the results to fp32 once. So the CPU backend, which runs the float
// instances, OpenBLAS and OpenMP, is tested like any other backend.
//
// Memory, transfers and events are the CPU backend's (host memory). Everything else is
// overridden, fill and convert included, so that no op of the backend under test is ever
// compared with itself. Exceptions, where the op is defined in float: init_normal (bit for bit
// the float instance), the FP8 codes (core/fp8.h, of the fp32 product x * scale, as GPUs
// compute it) and the FP8 scale update (core/fp8.h's fp32 reference).
#include "tessera/backend/cpu/cpu_backend.h"

namespace tessera::test {

class ReferenceBackend final : public CpuBackend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string description() const override { return "double-precision reference"; }

 protected:
  void do_fill(const Tensor& dst, float value) override;
  void do_convert(const Tensor& dst, const Tensor& src) override;
  void do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                      float std) override;

  void do_matmul(const MatmulArgs& args) override;
  void do_bias_backward(const Tensor& dbias, const Tensor& dout) override;
  void do_fp8_cast_transpose(const Fp8CastArgs& args) override;
  void do_fp8_grouped_cast(const Fp8GroupedCastArgs& args) override;
  void do_matmul_fp8(const Fp8MatmulArgs& args) override;
  void do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) override;
  void do_fp8_block_cast(const Fp8BlockCastArgs& args) override;

  void do_embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) override;
  void do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                             const Tensor& tokens) override;
  void do_embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table,
                                  int64_t first_id) override;
  void do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens,
                                   int64_t first_id) override;
  void do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                          const Tensor& weight, float eps) override;
  void do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                           const Tensor& x, const Tensor& weight, const Tensor& rstd) override;
  void do_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) override;
  void do_rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s) override;
  void do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                            const AttentionShape& s) override;
  void do_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& qkv,
                             const AttentionShape& s) override;
  void do_attention_gathered_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_all,
                                     const Tensor& positions, int64_t segment,
                                     const AttentionShape& s) override;
  void do_attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout, const Tensor& out,
                                      const Tensor& lse, const Tensor& qkv_all,
                                      const Tensor& positions, int64_t segment,
                                      const AttentionShape& s) override;
  void do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv, int64_t pos,
                           const AttentionShape& s) override;
  void do_mla_qkv_forward(const MlaQkvArgs& a) override;
  void do_mla_qkv_backward(const MlaQkvArgs& g) override;
  void do_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                       int64_t cols) override;
  void do_swiglu_forward(const Tensor& out, const Tensor& gate_up) override;
  void do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                          const Tensor& gate_up) override;
  void do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                    const Tensor& targets, int64_t first_id) override;
  void do_cross_entropy_shard(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                              const Tensor& all_stats, int64_t first_id, const Tensor& dlogits,
                              float grad_scale) override;
  void do_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                        const Tensor& dlogits, float grad_scale) override;

  void do_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                          const Tensor& q_weight, const Tensor& k_weight, const AttentionShape& s,
                          float eps) override;
  void do_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight, const Tensor& dk_weight,
                           const Tensor& dout, const Tensor& qkv, const Tensor& q_weight,
                           const Tensor& k_weight, const Tensor& rstd,
                           const AttentionShape& s) override;
  void do_moe_router_forward(const Tensor& indices, const Tensor& weights, const Tensor& logits,
                             const Tensor& bias, const MoeRouting& r) override;
  void do_moe_router_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& logits,
                              const Tensor& indices, const MoeRouting& r) override;
  void do_moe_aux_loss(const MoeAuxLossArgs& args) override;
  void do_moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                     float grad_scale) override;
  void do_moe_expert_counts(const Tensor& counts, const Tensor& indices) override;
  void do_moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) override;
  void do_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets, const Tensor& x,
                      const Tensor& indices, int64_t align, const MoeCapacity& capacity) override;
  void do_moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) override;
  void do_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                        const Tensor& weights) override;
  void do_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights, const Tensor& dout,
                                 const Tensor& yp, const Tensor& rows,
                                 const Tensor& weights) override;
  void do_grouped_matmul(const GroupedMatmulArgs& args) override;
  void do_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& args) override;
  void do_grouped_matmul_fp8(const GroupedFp8MatmulArgs& args) override;
  void do_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& args) override;

  void do_sum(const Tensor& out, const Tensor& x, bool accumulate) override;
  void do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) override;
  void do_adamw_step(const AdamWArgs& args) override;
};

}  // namespace tessera::test
