#pragma once
// The dropless mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek; docs/moe.md):
// on its input ln (the normed stream):
//   logits  = ln @ Wrouter^T                              (N, E)
//   experts, weights = router(logits)                     (N, K) each
//   xp      = ln's rows sorted by expert, each expert's rows padded to kGroupAlign   (R, C)
//   h1      = xp @ W1[e]^T per expert (grouped GEMM)     (R, 2F) = [gate | up]
//   h       = silu(gate) * up                             (R, F)
//   yp      = h @ W2[e]^T per expert                      (R, C)
//   out     = shared(ln) + sum_k weights[n, k] * yp[row of (n, k)]
// with shared(ln) the optional shared expert, a dense SwiGLU of width shared_ffn. The router's
// aux and z losses enter the backward through the logits' gradient; their values, with the
// tokens each expert received, are summed into the block's statistics once per forward pass.
//
// The experts' weights are one (E, 2F, C) and one (E, C, F) tensor (under expert parallelism
// each rank holds its E / ep experts of them, param_layout.h); like a linear's, their
// gradients are written by a step's first weight-gradient GEMM and added to by later
// micro-batches' (the model's expert_linear_backward). The group offsets stay on the device
// where the grouped GEMMs read them there (bf16 experts on Hopper, all on this rank); otherwise
// they are copied to the host once per forward pass (grouped GEMMs that launch per expert size
// their GEMMs from them, and the exchange's counts). The grouped GEMMs run through the model's
// expert_linear, in FP8 when the run's FP8 covers the experts (docs/fp8.md).
//
// With expert parallelism (model/expert_exchange.h) the permuted rows of each rank's experts
// go to that rank, which runs its experts on the (source rank, expert) groups it receives,
// and the outputs (forward) and the inputs' gradients (backward) come back.
#include <algorithm>
#include <vector>

#include "tessera/model/block.h"
#include "tessera/model/moe_balance.h"

namespace tessera {

class MoeMlp final : public Mixer {
 public:
  // Rows of each expert's group are padded to a multiple of this: FP8 and the fastest bf16
  // GEMM kernels want 16-row multiples, and padding rows are zeros.
  static constexpr int64_t kGroupAlign = 16;

  explicit MoeMlp(const ModelSpec& spec) : s_(spec) {}

  const char* range_name() const override { return "moe_block"; }
  const char* backward_range_name() const override { return "moe_block_backward"; }
  const char* param_prefix() const override { return "mlp."; }
  void declare_params(ParamLayoutBuilder& builder) override;
  // The shared expert's projections.
  std::vector<int> linear_weights() const override;
  // The routed experts' two stacks (their grouped GEMMs run in FP8 under fp8, but blockwise).
  std::vector<std::pair<int, Fp8LinearShape>> expert_linears(const ModelRuntime& rt) const override;
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) override;
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) override;
  void forward_inner(LayerOps& ops, const LinearOperand& in) override;
  void forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) override;
  void backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout, const Tensor& din,
                const std::function<void()>& recompute_in) override;
  size_t cached_scratch_bytes(int64_t n, DType dtype) const override;
  bool decode_reads_host(const Backend& backend, int64_t tokens, DType dtype) const override {
    return !backend.grouped_matmul_reads_device_offsets(dtype, permuted_rows(tokens, s_.moe),
                                                        s_.moe.experts);
  }
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in, const Tensor& out,
                      const Tensor& residual, const Tensor& cache, const CachePosition& at) override;
  std::vector<LinearGemm> linear_gemms() const override;
  // Per expert the (token, slot) pairs routed to it, then the aux loss, the z-loss and the
  // pairs dropped beyond the experts' capacity (0 when dropless).
  int64_t stats_width() const override { return moe_stats_width(s_.moe.experts); }
  void bind_stats(const Tensor& stats) override { stats_ = stats; }
  // The expert bias of aux-loss-free balancing (moe_router_enable_expert_bias): added to the
  // router's scores for choosing, moved after every step from the step's tokens per expert.
  int64_t state_width() const override { return s_.moe.expert_bias ? s_.moe.experts : 0; }
  void bind_state(const Tensor& state) override { expert_bias_ = state; }
  const char* state_name() const override { return "mlp.router.expert_bias"; }
  void update_state(Backend& backend) override;

  // Rows of the permuted activations for n tokens: every routing fits (with token dropping,
  // every expert at its capacity), in a whole number of kGroupAlign rows (the FP8 weight
  // gradients' transposed activations are rows of this many codes, a multiple of 16).
  static int64_t permuted_rows(int64_t n, const MoeSpec& moe) {
    return aligned_rows(kept_pairs(n, moe.experts, moe.capacity(n), moe.topk) +
                        moe.experts * (kGroupAlign - 1));
  }
  static int64_t aligned_rows(int64_t rows) {
    return (rows + kGroupAlign - 1) / kGroupAlign * kGroupAlign;
  }
  // (token, expert) pairs of n tokens that `experts` experts keep at most (capacity 0:
  // dropless).
  static int64_t kept_pairs(int64_t n, int64_t experts, int64_t capacity, int64_t topk) {
    return capacity > 0 ? std::min(n * topk, experts * capacity) : n * topk;
  }

 private:
  MoeRouting routing(bool force_balance) const;
  // Router, dispatch, the experts and the shared expert (when shared_gu is defined) for the
  // tokens of ln, into yp and shared_h: the part every pass runs.
  struct Buffers {
    Tensor ln, logits, indices, weights, rows, offsets, xp, h1, h, yp, shared_gu, shared_h;
    Tensor dropped;  // (1) with token dropping: the pass's dropped pairs
  };
  // What a pass's backward reads of its routing on the host: the experts' row groups of this
  // rank's tokens (offsets; empty where the grouped GEMMs read the device's), and with expert
  // parallelism the (source rank, expert) groups received (expert_offsets, group_weights: each
  // group's local expert) and the rows sent to and received from each rank.
  struct HostRouting {
    std::vector<int32_t> offsets, expert_offsets, group_weights;
    std::vector<int64_t> send_rows, send_first, recv_rows, recv_first;
  };
  // ex: the expert exchange (expert parallelism), or null when every expert runs here.
  void route_and_run_experts(ForwardOps& ops, const Buffers& t, bool force_balance,
                             ExpertExchange* ex, HostRouting& host);
  // The exchange of the pass, checked against the plan; null without expert parallelism.
  ExpertExchange* exchange(LayerOps& ops) const;
  // Rows the experts of this rank run on, at most, for n tokens per rank.
  int64_t expert_rows(int64_t n, const ModelRuntime& rt) const;
  // The experts each rank of the exchange runs.
  int64_t local_count(const ExpertExchange& ex) const { return s_.moe.experts / ex.size(); }
  // The row groups the experts run on: this rank's own (offsets, host_offsets), or with an
  // exchange the (source rank, expert) groups it received (plan_exchange).
  ExpertGroups expert_groups(const ExpertExchange* ex, const Tensor& offsets,
                             const HostRouting& host) const;
  // The load-balancing loss of the routing in logits_ / indices_ (Backend::moe_aux_loss).
  MoeAuxLossArgs aux_loss_args(const ModelRuntime& rt) const;
  // Swaps the per-expert counts with the group and lays out the rows to send and receive.
  void plan_exchange(Backend& b, ExpertExchange& ex, HostRouting& host);
  // out = the shared expert's output (+ residual), the residual, or zeros: what the combine
  // adds the routed experts' outputs to.
  void combine_start(ForwardOps& ops, const Tensor& out, const Tensor& shared_h,
                     const Tensor& residual) const;

  ModelSpec s_;
  int router_ = -1, gate_up_ = -1, down_ = -1;
  int shared_gate_up_ = -1, shared_down_ = -1;
  // activations
  Tensor logits_, indices_, weights_, rows_, offsets_, xp_, h1_, h_, yp_, dropped_;
  Tensor shared_gu_, shared_h_;
  // backward scratch (dxp reuses dyp's memory: dyp is dead once W2's gradients are taken)
  Tensor dyp_, dweights_, dh_, dh1_, dlogits_, dlogits_c_, dshared_h_, dshared_gu_;
  // Per activation slot: a stage of a pipeline, and DPO's two answers, keep several passes'
  // activations at once, each backward reading its own forward's routing.
  std::vector<HostRouting> host_routing_;
  // Expert parallelism: the rows this rank's experts receive (xr, yr, dyr) and their
  // (source rank, expert) groups on the device.
  int ep_ = 1;
  Tensor xr_, yr_, dyr_, expert_offsets_;
  Tensor stats_, expert_bias_;
};

}  // namespace tessera
