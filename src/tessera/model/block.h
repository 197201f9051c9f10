#pragma once
// A decoder layer is a sequence of blocks, each a residual sub-layer around a mixer (an
// attention or an MLP: model/blocks/), with its norms in slots:
//   pre-norm (Llama, Qwen, DeepSeek):   out = x + f(norm(x))
//   post-norm (OLMo 2):                 out = x + norm(f(x))
//   sandwich (Gemma):                   out = x + post_norm(f(pre_norm(x)))
// A mixer declares its parameters, activations and backward scratch, and runs its forward and
// backward through LayerOps, which the model implements: parameter access, linear layers (bf16
// or FP8, split over ranks as their styles say) and the shared tensors of a pass. A new kind of
// mixer is a new file under blocks/; a family (model/model_family.h) says which mixers and
// norms its layers have.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/model/activation_plan.h"
#include "tessera/model/expert_exchange.h"
#include "tessera/model/linear_operand.h"
#include "tessera/model/model.h"
#include "tessera/model/param_layout.h"
#include "tessera/model/rope.h"
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
  // With in.cast, the input's FP8 codes are in the layer's linear_input_cast target.
  virtual void linear(const Tensor& out, const LinearOperand& in, int weight, int bias,
                      const Tensor& residual = {}) = 0;
  // (positions, rotary dims) fp32: the rope ops' cos/sin table of rotary base `base` (0: the
  // model's rotary_base with its scaling; a mixer's rope_bases() says which it reads); row t
  // is the position of the sequence's token t on this rank (position t, but under context
  // parallelism).
  virtual const Tensor& rope_table(double base = 0) const = 0;
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
  // Whether expert_linear (and its backward) of `weight` on the rows of `in` runs best from
  // the device's group offsets alone (Backend::grouped_matmul_reads_device_offsets): the block
  // then passes no host offsets and never waits for the routing.
  virtual bool expert_linear_reads_device_offsets(int weight, const Tensor& in) const {
    return backend().grouped_matmul_reads_device_offsets(in.dtype, in.dim(0), param(weight).dim(0));
  }
  // Causal (windowed) attention over a packed QKV activation (Backend::attention_forward);
  // under context parallelism its keys and values span every rank's tokens. With codes.out
  // defined (a LayerOps::linear_input_cast target) out's FP8 codes and amax are written too,
  // by the attention kernel where it can (Backend::attention_forward_cast).
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                 const AttentionShape& s, const Fp8CastArgs& codes) {
    if (codes.out.defined()) return backend().attention_forward_cast(out, lse, qkv, s, codes);
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
  // With dout.cast, dout's FP8 codes (both layouts) are in linear_output_grad_cast's target;
  // with in.codes_t (where linear_keeps_input_codes) the input's transposed codes.
  virtual void linear_backward(const Tensor& din, const LinearOperand& dout,
                               const LinearOperand& in, int weight, int bias) = 0;
  // Where `weight`'s linear reads the FP8 codes of an input of `rows` rows that its producer
  // writes on the way (then pass LinearOperand::with_codes to linear): Fp8Linears::input_cast.
  // Undefined out where the layer casts its input itself (bf16, blockwise or just-in-time
  // scaling, or an input gathered over the sequence shards first).
  virtual Fp8CastArgs linear_input_cast(int weight, int64_t rows) const = 0;
  // Whether `weight`'s backward can take, in place of its input of `rows` rows, the input's
  // transposed FP8 codes (in, rows) that its producer wrote in the forward with
  // linear_input_cast's scale and amax (codes.out_t beside codes.out) and kept
  // (LinearOperand::transposed_codes): where linear_input_cast is defined and no adapter reads
  // the input.
  virtual bool linear_keeps_input_codes(int weight, int64_t rows) const = 0;
  // Where `weight`'s linear reads the FP8 codes (both layouts) of an output gradient of `rows`
  // rows that its producer writes on the way (then pass LinearOperand::with_codes to
  // linear_backward, without a bias): Fp8Linears::output_grad_cast. Undefined out where the
  // layer casts the gradient itself (as for linear_input_cast, and where adapters read it).
  virtual Fp8CastArgs linear_output_grad_cast(int weight, int64_t rows) const = 0;
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
  // The activation slot (0 .. runtime().pipeline_slots - 1) of the pass: what a block keeps
  // of a forward outside its stored activations (on the host) is kept per slot, for the
  // backward of the same slot.
  virtual int activation_slot() const = 0;
  // The backward of attention_forward (Backend::attention_backward).
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                  const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
    backend().attention_backward(dqkv, dout, out, lse, qkv, s);
  }
};

// One of a mixer's linear layers as a training step runs it (bench gemm times these; the model
// FLOPs count them): out (rows, out_features) = in (rows, in_features) @ W^T, `count` times a
// layer, over tokens x token_share rows each (1 for every token; a routed expert's share of
// the rows, top-k / experts, under balanced routing).
struct LinearGemm {
  // How an FP8 run multiplies it: as an FP8 linear, as an FP8 expert stack (whose blockwise
  // recipe keeps bf16), or always in the compute dtype (a router).
  enum class Fp8 { Linear, Expert, Never };
  std::string name;
  int64_t out_features = 0, in_features = 0;
  bool bias = false;      // its epilogue adds a bias
  bool residual = false;  // its epilogue adds the residual stream (an output projection)
  int64_t count = 1;
  int64_t share_num = 1, share_den = 1;  // token_share = share_num / share_den
  Fp8 fp8 = Fp8::Linear;
};

// An attention or MLP sub-layer between the residual stream's norms: from its input (the
// normed stream, or the stream itself without a pre-norm) through its output projection.
// Where generation's new tokens sit in their sequences' caches (Mixer::forward_cached).
struct CachePosition {
  // One sequence: the position of its first new token. A batch: the largest of its sequences'
  // positions, which bounds the work.
  int64_t pos = 0;
  // A batch only: each sequence's position (B) int32, on the device, and the rotary rows at
  // them: row b of rope->at(base) (rotary dims wide) is the table's row positions[b].
  Tensor positions;
  const RopeTables* rope = nullptr;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  // The trace ranges of its forward and backward (string literals).
  virtual const char* range_name() const = 0;
  virtual const char* backward_range_name() const = 0;
  // Its parameters' prefix within the layer ("self_attn.", "mlp."): its block's norms live
  // there too ("self_attn.norm.weight", "mlp.post_norm.weight").
  virtual const char* param_prefix() const = 0;
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
  // lives on the residual stream has rt.sequence_tokens() rows, the rest rt.tokens(): with
  // sequence parallelism the model's linear layers gather the one into the other.
  virtual void declare_activations(ActivationPlan& plan, const ModelRuntime& rt) = 0;
  virtual void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) = 0;

  // Everything but the output projection, from `in` (sequence_tokens(), C), which its block
  // keeps valid (or recomputable) until the backward. With in.cast, in's FP8 codes are in
  // input_linear()'s linear_input_cast target (its block's norm wrote them).
  virtual void forward_inner(LayerOps& ops, const LinearOperand& in) = 0;
  // The linear layer (its weight's index) that reads the mixer's input first in the forward,
  // before any other FP8 linear casts: its input cast can be folded into the block's norm.
  // -1 where none does (the input goes to several linears, or to a router or experts first).
  virtual int input_linear() const { return -1; }
  // out = the output projection (+ residual when defined: folded into the GEMM, one pass less).
  virtual void forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) = 0;
  // dout: d(loss)/d(its output); din (sequence_tokens(), C) is overwritten with d(loss)/d(in).
  // `in` may be recomputable: the mixer calls recompute_in() before its first read of it in
  // the backward (recomputed tensors share memory, so the order matters). Where the block's
  // pre-norm kept no output, in.codes_t holds its transposed FP8 codes for input_linear()
  // (LayerOps::linear_keeps_input_codes), written by recompute_in(). Weight gradients
  // accumulate.
  virtual void backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout,
                        const Tensor& din, const std::function<void()>& recompute_in) = 0;

  // ---- generation with a cache (model/generator.h) ----
  // Values per position it keeps for later tokens (an attention's keys and values).
  virtual int64_t cache_width() const { return 0; }
  // Whether its forward_cached on `tokens` new tokens of `dtype` reads device results on the
  // host (an MoE's routing, where its grouped GEMMs size themselves from the experts' row
  // counts there): a decode step through it cannot then be captured (Backend::capture).
  virtual bool decode_reads_host(const Backend& backend, int64_t tokens, DType dtype) const {
    (void)backend, (void)tokens, (void)dtype;
    return false;
  }
  // Scratch bytes its forward_cached takes for n tokens of `dtype`.
  virtual size_t cached_scratch_bytes(int64_t n, DType dtype) const = 0;
  // The mixer on n new tokens `in` (n, C) of one sequence at positions [at.pos, at.pos + n):
  // out = f(in) (+ residual when defined). `cache` (S, cache_width()) holds positions
  // [0, at.pos) on entry and [0, at.pos + n) on exit. Either a prompt (at.pos 0, any n) or one
  // token (n 1). Or a batch of sequences, one token of each, each at its own position
  // (at.positions): `cache` (B, S, cache_width()), `in` B rows (a mixer without a cache sees
  // only rows).
  virtual void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in,
                              const Tensor& out, const Tensor& residual, const Tensor& cache,
                              const CachePosition& at) = 0;

  // The rotary tables' bases it reads (ForwardOps::rope_table; 0: the model's own).
  virtual std::vector<double> rope_bases() const { return {}; }

  // The shape its attention runs on for `batch` sequences of `seq` tokens (the memory planner
  // sizes the attention kernels' buffers from it); none for a mixer without attention.
  virtual std::optional<AttentionShape> attention_shape(int64_t batch, int64_t seq) const {
    (void)batch, (void)seq;
    return std::nullopt;
  }
  // Its linear layers' GEMMs, in the order its forward runs them.
  virtual std::vector<LinearGemm> linear_gemms() const = 0;
  // Model FLOPs (model_spec.h): weights its GEMMs multiply per token (from linear_gemms), and
  // attention's score and value FLOPs per token of a training step (forward and backward).
  int64_t matmul_params() const;
  virtual double attention_flops_per_token(int64_t seq_length) const {
    (void)seq_length;
    return 0;
  }

  // ---- statistics kept across a step (MoE load balance, DecoderModel::moe_stats) ----
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

// Which RMSNorms a block has around its mixer (at least one).
struct NormSlots {
  bool pre = true;    // norm(x) feeds the mixer
  bool post = false;  // the mixer's output is normed before the residual add
};

// One residual sub-layer: its mixer between the norms its slots name. Without a post-norm the
// residual rides on the mixer's output projection; with one it is added after the norm.
class Block {
 public:
  Block(NormSlots norms, std::unique_ptr<Mixer> mixer, int64_t hidden, float norm_eps);

  const char* range_name() const { return mixer_->range_name(); }
  const char* backward_range_name() const { return mixer_->backward_range_name(); }
  const Mixer& mixer() const { return *mixer_; }
  Mixer& mixer() { return *mixer_; }
  const NormSlots& norms() const { return norms_; }

  // Its pre-norm's weight, the mixer's parameters, its post-norm's weight.
  void declare_params(ParamLayoutBuilder& builder);
  void declare_activations(ActivationPlan& plan, const ModelRuntime& rt);
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt);

  // forward = forward_inner then forward_output. forward_inner is everything but the output
  // projection (and the post-norm and residual after it): a fully recomputed layer reruns the
  // inner part of its last block only, its output being stored.
  void forward_inner(LayerOps& ops, const Tensor& x);
  void forward_output(LayerOps& ops, const Tensor& x, const Tensor& out);
  // On entry dresid holds d(loss)/d(out); on exit d(loss)/d(x): the residual path plus the
  // block's. Weight gradients accumulate.
  void backward(LayerOps& ops, const Tensor& x, const Tensor& dresid);
  // Generation: out = x + the block's branch on n new tokens (Mixer::forward_cached).
  size_t cached_scratch_bytes(int64_t n, DType dtype) const;
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x, const Tensor& out,
                      const Tensor& cache, const CachePosition& at);

 private:
  // The mixer's input: the pre-norm's output, or x itself.
  const Tensor& mixer_input(const Tensor& x) const { return norms_.pre ? ln_ : x; }
  // Whether the pre-norm's output is kept as the mixer's first linear's transposed FP8 codes
  // rather than written (forward_inner).
  bool ln_kept_as_codes(const LayerOps& ops, const Tensor& x) const;

  NormSlots norms_;
  std::unique_ptr<Mixer> mixer_;
  int64_t hidden_;
  float eps_;
  int pre_norm_ = -1, post_norm_ = -1;
  Tensor ln_, rstd_;      // the pre-norm's output (recomputable) and statistics
  Tensor y_, post_rstd_;  // with a post-norm: the mixer's output and its statistics
  Tensor dy_;             // backward scratch with a post-norm: d(mixer output)
};

// The usual block: a pre-norm, the mixer, the residual (NormSlots' defaults).
std::unique_ptr<Block> make_block(const ModelSpec& spec, std::unique_ptr<Mixer> mixer,
                                  NormSlots norms = {});

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
