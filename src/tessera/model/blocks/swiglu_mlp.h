#pragma once
// The dense SwiGLU MLP (Llama, Qwen, Mistral, OLMo 2), on its input `in` (the normed stream):
//   gate_up = in @ Wgate_up^T       (N, 2F) = [gate | up]
//   h = silu(gate) * up             (N, F)
//   out = h @ Wdown^T               (N, C)
// An FP8 down projection's forward cast of h is folded into the SwiGLU
// (swiglu_forward_cast): h's codes are written with h, and h is not read back before the
// backward. Where nothing but the down projection reads h (no adapters), the SwiGLU writes
// h's transposed codes for the down projection's weight gradient in h's place, and h itself
// is never stored. Likewise the gate_up projection's output-gradient cast is folded into the
// SwiGLU backward (swiglu_backward_cast), which then never stores d(gate_up).
#include "tessera/model/block.h"

namespace tessera {

class SwigluMlp final : public Mixer {
 public:
  explicit SwigluMlp(const ModelSpec& spec) : s_(spec) {}

  const char* range_name() const override { return "mlp_block"; }
  const char* backward_range_name() const override { return "mlp_block_backward"; }
  const char* param_prefix() const override { return "mlp."; }
  void declare_params(ParamLayoutBuilder& builder) override;
  std::vector<int> linear_weights() const override { return {gate_up_, down_}; }
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const LinearOperand& in) override;
  int input_linear() const override { return gate_up_; }
  void forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) override;
  void backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout, const Tensor& din,
                const std::function<void()>& recompute_in) override;
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in, const Tensor& out,
                      const Tensor& residual, const Tensor& cache, const CachePosition& at) override;
  std::vector<LinearGemm> linear_gemms() const override {
    return {{.name = "gate_up", .out_features = 2 * s_.ffn, .in_features = s_.hidden},
            {.name = "down", .out_features = s_.hidden, .in_features = s_.ffn, .residual = true}};
  }

 private:
  ModelSpec s_;
  int gate_up_ = -1, down_ = -1;
  Tensor gate_up_out_, h_;  // activations
  Tensor dh_, dgate_up_;    // backward scratch
};

}  // namespace tessera
