#pragma once
// The dense SwiGLU MLP (Llama, Qwen 2.5, Mistral):
//   ln = rmsnorm(x)                 (N, C)
//   gate_up = ln @ Wgate_up^T       (N, 2F) = [gate | up]
//   h = silu(gate) * up             (N, F)
//   out = x + h @ Wdown^T           (N, C)
#include "tessera/model/block.h"

namespace tessera {

class SwigluMlpBlock final : public Block {
 public:
  explicit SwigluMlpBlock(const ModelSpec& spec) : s_(spec) {}

  const char* range_name() const override { return "mlp_block"; }
  const char* backward_range_name() const override { return "mlp_block_backward"; }
  void declare_params(ParamLayoutBuilder& builder) override;
  std::vector<int> linear_weights() const override { return {gate_up_, down_}; }
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const Tensor& x) override;
  void forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) override;
  void backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) override;
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x, const Tensor& out,
                      const Tensor& cache, int64_t pos) override;
  int64_t matmul_params() const override { return 3 * s_.hidden * s_.ffn; }

 private:
  ModelSpec s_;
  int norm_ = -1, gate_up_ = -1, down_ = -1;
  Tensor ln_, rstd_, gate_up_out_, h_;  // activations
  Tensor dh_, dgate_up_;                // backward scratch
};

}  // namespace tessera
