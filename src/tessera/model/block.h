#pragma once
// A decoder layer is a sequence of blocks, each a pre-norm residual sub-layer
// out = x + f(norm(x)): an attention block (GQA now; MLA next) then an MLP block (dense
// SwiGLU now; MoE next). A block declares its parameters, activations and backward scratch,
// and runs its forward and backward through LayerOps, which the model implements: parameter
// access, linear layers (bf16 or FP8) and the shared tensors of a pass. A new kind of block
// is a new file here; a family (model/model_family.h) says which blocks its layers have.
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/model/activation_plan.h"
#include "tessera/model/expert_exchange.h"
#include "tessera/model/model.h"
#include "tessera/model/param_layout.h"
#include "tessera/model/scratch_arena.h"

namespace tessera {

// What a block sees of its model during a forward pass, in training or generation.
class ForwardOps {
 public:
  virtual ~ForwardOps() = default;
  virtual Backend& backend() const = 0;
  virtual const ModelSpec& spec() const = 0;
  virtual Tensor param(int index) const = 0;
  // out = in @ W^T (+ bias) (+ residual). A residual is added exactly once: folded into the
  // GEMM (its beta) on the rank that owns the output's sum (model.h, tensor_parallel_rank).
  // Under tensor parallelism W is this rank's part, and the collectives its style needs run
  // here: a row-parallel output is summed over the ranks (or reduce-scattered onto the
  // sequence shards, with sequence parallelism, when out has sequence_tokens() rows), and a
  // column-parallel input with sequence_tokens() rows is gathered first.
  virtual void linear(const Tensor& out, const Tensor& in, int weight, int bias,
                      const Tensor& residual = {}) = 0;
  // (positions, rotary dims) fp32: the rope ops' cos/sin table; row t is the position of the
  // sequence's token t on this rank (position t, but under context parallelism).
  virtual const Tensor& rope_table() const = 0;
  // An MoE layer's experts: out (R, out) = in (R, in) @ w[e]^T over the row groups (rows
  // past them zeroed), w (local experts, out, in) this rank's experts of parameter `weight`;
  // bf16 grouped GEMMs, or FP8 ones when the run's FP8 covers the stack (expert_linears).
  virtual void expert_linear(const Tensor& out, const Tensor& in, int weight, const Tensor& w,
                             const ExpertGroups& groups) {
    GroupedMatmulArgs g;
    g.out = out, g.a = in, g.b = w, g.trans_b = true;
    g.offsets = groups.offsets, g.host_offsets = groups.host_offsets;
    g.group_weights = groups.group_weights;
    (void)weight;
    backend().grouped_matmul(g);
  }
  // Causal (windowed) attention over a packed QKV activation (Backend::attention_forward);
  // under context parallelism its keys and values span every rank's tokens.
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                 const AttentionShape& s) {
    backend().attention_forward(out, lse, qkv, s);
  }
};

// What a block sees of its model during training: the run's shapes, gradients and backward.
class LayerOps : public ForwardOps {
 public:
  virtual const ModelRuntime& runtime() const = 0;
  virtual Tensor grad(int index) const = 0;
  // din = dout @ W (skipped when din is undefined); dW += dout^T @ in (dW = ... for the step's
  // first contribution); dbias += colsum(dout). Under tensor parallelism a column-parallel
  // din is summed over the ranks (reduce-scattered with sequence parallelism), and sequence
  // shards (in of a column-parallel, dout of a row-parallel linear) are gathered first.
  virtual void linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
                               int weight, int bias) = 0;
  // (N, C): the gradient of a norm's output, shared by every block's backward.
  virtual const Tensor& norm_grad() const = 0;
  // Expert parallelism (model/expert_exchange.h); null when every expert runs here.
  virtual ExpertExchange* expert_exchange() const = 0;
  // d(objective)/d(the per-token loss sum) of this pass (forward_backward's grad_scale): a
  // loss a block adds per micro-batch (MoE aux losses) scales its gradient by this times the
  // tokens, the micro-batch mean's share of the step's mean.
  virtual float loss_grad_scale() const = 0;
  // The backward of expert_linear: din = dout @ w[e] per group (when defined), and dw (local
  // experts, out, in) += dout_g^T @ in_g (the experts' gradients always accumulate).
  virtual void expert_linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
                                      int weight, const Tensor& w, const Tensor& dw,
                                      const ExpertGroups& groups) = 0;
  // True while a full recompute re-runs the layer's forward: what a block counts once per
  // micro-batch (the MoE load statistics) is not counted again.
  virtual bool recomputing() const = 0;
  // The backward of attention_forward (Backend::attention_backward).
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                  const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
    backend().attention_backward(dqkv, dout, out, lse, qkv, s);
  }
};

class Block {
 public:
  virtual ~Block() = default;
  // The trace ranges of its forward and backward (string literals).
  virtual const char* range_name() const = 0;
  virtual const char* backward_range_name() const = 0;
  // Adds its parameters, in layout order, to the layer's unit and keeps their indices.
  virtual void declare_params(ParamLayoutBuilder& builder) = 0;
  // The parameters its GEMMs multiply, in the order they run (the FP8 linear layers).
  virtual std::vector<int> linear_weights() const = 0;
  // The expert stacks its grouped GEMMs multiply (expert_linear), by parameter index, with
  // their FP8 shapes (all but the name): the FP8 expert linears of an fp8 run.
  virtual std::vector<std::pair<int, Fp8LinearShape>> expert_linears(const ModelRuntime& rt) const {
    (void)rt;
    return {};
  }
  // Its activations (within the layer's set) and its backward's scratch (backward set). What
  // lives on the residual stream (its norm's output and statistics, like x and out) has
  // rt.sequence_tokens() rows, the rest rt.tokens(): with sequence parallelism the model's
  // linear layers gather the one into the other (LayerOps::linear).
  virtual void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) = 0;
  virtual void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) = 0;

  // forward = forward_inner then forward_output. forward_inner is everything but the output
  // projection, which writes out = x + projection: a fully recomputed layer reruns the inner
  // part of its last block only, its output being stored.
  virtual void forward_inner(LayerOps& ops, const Tensor& x) = 0;
  virtual void forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) = 0;
  // On entry dresid holds d(loss)/d(out); on exit d(loss)/d(x): the residual path plus the
  // block's. Weight gradients accumulate.
  virtual void backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) = 0;

  // ---- generation with a cache (model/generator.h) ----
  // Values per position it keeps for later tokens (an attention block's keys and values).
  virtual int64_t cache_width() const { return 0; }
  // Scratch bytes its forward_cached takes for n tokens of `dtype`.
  virtual size_t cached_scratch_bytes(int64_t n, DType dtype) const = 0;
  // The block on n new tokens x (n, C) of one sequence at positions [pos, pos + n):
  // out = x + f(norm(x)). `cache` (S, cache_width()) holds positions [0, pos) on entry and
  // [0, pos + n) on exit. Either a prompt (pos 0, any n) or one token (n 1) at a time.
  virtual void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x,
                              const Tensor& out, const Tensor& cache, int64_t pos) = 0;

  // Model FLOPs (model_spec.h): weights its GEMMs multiply per token, and attention's
  // score and value FLOPs per token of a training step (forward and backward).
  virtual int64_t matmul_params() const = 0;
  virtual double attention_flops_per_token(int64_t seq_length) const {
    (void)seq_length;
    return 0;
  }

  // ---- statistics kept across a step (MoE load balance, Model::moe_stats) ----
  // fp32 values it sums over a step's forward passes; 0: none.
  virtual int64_t stats_width() const { return 0; }
  // Where they live (stats_width() values, zeroed by the model between steps).
  virtual void bind_stats(const Tensor& stats) { (void)stats; }

  // ---- state kept across steps outside the parameters (the MoE expert bias) ----
  // fp32 values, zero at the start of training and kept in checkpoints; 0: none.
  virtual int64_t state_width() const { return 0; }
  // Where they live, and the name a checkpoint stores them under ("mlp.router.expert_bias",
  // prefixed with the layer's).
  virtual void bind_state(const Tensor& state) { (void)state; }
  virtual const char* state_name() const { return ""; }
  // After a step, once the statistics hold the whole step (every micro-batch and rank).
  virtual void update_state(Backend& backend) { (void)backend; }
};

// Brackets ops in a trace range (NVTX on CUDA).
class ScopedRange {
 public:
  ScopedRange(Backend& b, const char* name) : b_(b) { b_.range_push(name); }
  ~ScopedRange() { b_.range_pop(); }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;

 private:
  Backend& b_;
};

}  // namespace tessera
