#pragma once
// What the trainer, the optimizer, data parallelism and checkpoints need of a model: a flat
// parameter layout cut into units, forward/backward passes over a micro-batch, and hooks that
// let code outside the model manage parameters across ranks. Model code is single-device and
// rank-free; parallel layouts are applied from outside (distributed/parallelize.h).
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/core/shared_prompt_pair.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"
#include "tessera/model/step_hook.h"
#include "tessera/ops/backend.h"

namespace tessera {

// A run of consecutive decoder layers [first, first + count): a pipeline stage's model chunk.
struct LayerRange {
  int64_t first = 0, count = 0;
  int64_t end() const { return first + count; }
};

// What a full recompute does with one layer of a model chunk (Megatron's recompute_method,
// which it applies to each chunk of a pipeline stage): whether the backward re-runs it, and the
// group it re-runs with. A group keeps only its first layer's input; before the backward of its
// last layer every layer of the group runs forward again, the inner residual states included.
struct RecomputeRole {
  bool recomputed = false;
  bool group_start = true;  // its input is stored, not recomputed
  bool group_end = true;    // the group re-runs before this layer's backward
};

struct ModelRuntime {
  int64_t micro_batch = 1;
  int64_t seq_length = 128;  // tokens of each sequence on this rank (its share under context
                             // parallelism)
  DType compute_dtype = DType::F32;
  // The gradient buffer's dtype (main_grads_dtype): fp32, or bf16, which every op that adds
  // into a gradient rounds its fp32 sum to (ops/backend.h).
  DType grad_dtype = DType::F32;
  RecomputeGranularity recompute = RecomputeGranularity::None;
  // With Full, Megatron's method over each model chunk (recompute_role, below).
  RecomputeMethod recompute_method = RecomputeMethod::None;
  int64_t recompute_num_layers = 0;
  int64_t cross_entropy_chunk_tokens = 8192;
  // Packed documents (set_batch's positions): the rotary embedding at each token's position in
  // its document, and attention within each document.
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool packed_documents() const { return reset_position_ids || reset_attention_mask; }
  bool fp8_attention = false;  // fp8_dot_product_attention: AttentionShape::fp8 in training
  // The parameter and gradient buffers are allocated for the parameter count rounded up to
  // this multiple, so data parallelism can split them into equal per-rank shards.
  int64_t flat_buffer_multiple = 1;
  // FSDP: parameters and gradients live outside the model, sharded over ranks. The model then
  // allocates no flat buffers; its unit observer binds each unit's tensors (bind_unit_params,
  // bind_unit_grads) before the model reads or writes them, and starts each unit's gradients
  // from what they already hold, so every weight-gradient GEMM accumulates (but after
  // start_unit_grads).
  bool sharded_params = false;
  // With sharded_params and the FP8 weight cache: once a unit's FP8 weights are cached for the
  // step, its passes read them there and its other parameters (norms, biases: vectors) from
  // copies the model keeps, so the unit need not be gathered again until the weights change
  // (unit_read_from_copies). Units whose matrices are all FP8 weights, but the embedding's.
  bool fp8_unit_copies = false;
  // Tensor parallelism (Megatron's): the model holds part tensor_parallel_rank of
  // tensor_parallel_size of every parameter its blocks declare Column, Row or Vocab
  // (param_layout.h), so its layers compute that share of the heads, MLP width and vocabulary.
  // A row-parallel projection leaves partial sums that the group adds up, so only the rank that
  // owns a row of the sum adds the residual into it (the residual is added exactly once).
  int tensor_parallel_size = 1;
  int tensor_parallel_rank = 0;
  // With tensor parallelism: the residual stream (residual states, norms) holds
  // tokens() / tensor_parallel_size rows on each rank, gathered before the column-parallel
  // linears and reduce-scattered after the row-parallel ones.
  bool sequence_parallel = false;
  // Context parallelism (Megatron's): each sequence is cut into 2 x context_parallel_size
  // chunks and this rank holds chunks context_parallel_rank and 2 x size - 1 - rank (causal
  // load balancing), seq_length tokens of each sequence; its attention sees every rank's keys.
  int context_parallel_size = 1;
  int context_parallel_rank = 0;
  // Pipeline parallelism: the model chunks (runs of consecutive layers) this rank holds, in
  // layer order; the chunk starting at layer 0 also holds the embedding, the one ending at the
  // last layer the final norm and output head. Empty: every layer, in one chunk.
  std::vector<LayerRange> pipeline_chunks;
  // Micro-batches whose activations the rank holds at once (a pipeline stage's in-flight ones,
  // or DPO's two answers).
  int pipeline_slots = 1;
  // forward_loss keeps every position's d(loss)/d(logits) at unit scale (stored per slot),
  // so that loss_backward scales them instead of running the output head's forward again
  // (DPO: one tokens x vocabulary tensor per answer).
  bool keep_logit_grads = false;
  // The output head (its logits GEMMs, cross-entropy and their backward) runs only on the rows
  // whose targets count (set_batch's non-negative targets) when some do not: a fine-tuning
  // batch's prompts and padding, DPO's and GRPO's prompts. The rows are gathered into a chunk
  // of their own and the head's results scattered back (zeros elsewhere), so losses and
  // gradients are those of the whole head. The row count is padded (with rows that do not
  // count) to the backend's varying_gemm_rows_multiple (256 on CUDA). Costs two
  // (chunk, hidden) buffers.
  bool head_on_loss_rows = false;
  Fp8Options fp8;  // FP8 linear layers (off by default)
  // MoE layers route tokens round-robin instead of by score (benchmarks, docs/moe.md).
  bool moe_force_balance = false;
  // Ranks an MoE layer's experts are spread over (expert_model_parallel_size): the received
  // rows of this rank's experts are planned for the worst case, every routed row of every
  // rank of the group (model/expert_exchange.h).
  int expert_parallel_size = 1;
  // This rank's place in that group: its layout holds experts [rank x E / size, (rank + 1) x
  // E / size) of every expert stack (param_layout.h, TensorParallelStyle::Expert).
  int expert_parallel_rank = 0;
  // DPO pairs with their prompt once (set_shared_prompt_pairs): each micro-batch row of
  // seq_length holds one pair, its prompt's rows followed by both answers'; attention runs
  // over the pairs' two sides apart, 2 x micro_batch sequences of this many tokens, as two
  // sequences of the pair would. 0: off, attention runs over the rows as they are.
  int64_t shared_prompt_side = 0;

  // The role of the layer at `position` of a model chunk of `count` layers: with Full, block
  // re-runs the first recompute_num_layers layers one by one (0: none); uniform re-runs groups
  // of recompute_num_layers consecutive layers (the chunk's last group may be shorter); without
  // a method, 0 is every layer on its own and N the block method.
  RecomputeRole recompute_role(int64_t position, int64_t count) const;

  int64_t tokens() const { return micro_batch * seq_length; }
  // The sequences attention runs over, and their length: the rows as they are, or with
  // shared_prompt_side each pair's two sides apart.
  int64_t attention_batch() const { return shared_prompt_side > 0 ? 2 * micro_batch : micro_batch; }
  int64_t attention_seq() const { return shared_prompt_side > 0 ? shared_prompt_side : seq_length; }
  // Rows of the residual-stream activations on this rank: its share of the tokens under
  // sequence parallelism, else all of them.
  int64_t sequence_tokens() const {
    return sequence_parallel ? tokens() / tensor_parallel_size : tokens();
  }
};

// Bytes the model needs on its device, by purpose (the out-of-memory message and the
// memory planner report these).
struct ModelMemory {
  size_t weights = 0;      // compute-dtype parameters
  size_t gradients = 0;    // gradients (ModelRuntime::grad_dtype)
  size_t activations = 0;  // stored activations, backward scratch, logits chunk, batch
  size_t fp8 = 0;          // FP8 scaling state, weight cache and cast buffers (fp8 runs)
  size_t block_state = 0;  // the blocks' fp32 statistics and state (MoE balance, expert bias)
  bool fp8_expert_stacks = false;  // FP8 linears include expert stacks (grouped FP8 GEMMs)
};

// What the model reports, as a pass goes, to whoever manages its parameters across ranks
// (distributed/): when it reads each unit's parameters (ParamLayout::units) and writes its
// gradients, so they can be gathered just in time and reduced as soon as they are final.
class ExpertExchange;  // model/expert_exchange.h

class ParamUnitObserver {
 public:
  virtual ~ParamUnitObserver() = default;
  // The pass is about to read unit u's parameters; it reads unit `next` after them (-1: none).
  virtual void params_needed(int unit, int next) { (void)unit, (void)next; }
  // Every read of unit u's parameters until the next params_needed(u) is queued.
  virtual void params_done(int unit) { (void)unit; }
  // Once per micro-batch, before the backward first writes unit u's gradients.
  virtual void grads_needed(int unit) { (void)unit; }
  // Unit u's gradients of this micro-batch are final (offsets >= its begin get no more).
  virtual void grads_ready(int unit) { (void)unit; }
};

// The collectives that tensor and context parallelism insert into a model's passes (Megatron's
// mappings), over the ranks that split its parameters (tensor parallel) or its sequences
// (context parallel). The model calls them where its parameters' TensorParallelStyle leaves
// partial sums or sequence shards (block.h, linear) and around attention; distributed/
// implements them on a communicator, in the order the model calls them, which is the same on
// every rank of the group. Rows split in rank order.
class ParallelGroup {
 public:
  virtual ~ParallelGroup() = default;
  // In place: t becomes the sum over the group (fp32 or the compute dtype).
  virtual void all_reduce(const Tensor& t) = 0;
  // out (size x n rows) = every rank's in (n rows), rank r's at rows [r n, (r + 1) n).
  virtual void all_gather(const Tensor& out, const Tensor& in) = 0;
  // out (n rows) = the sum over the group of rows [rank n, (rank + 1) n) of in (size x n rows).
  virtual void reduce_scatter(const Tensor& out, const Tensor& in) = 0;
};

// Where a model's frozen weights are when they are sharded over ranks (LoRA's base under FSDP,
// Model::frozen_layout): the model asks for each unit just before it reads it.
class FrozenUnitSource {
 public:
  virtual ~FrozenUnitSource() = default;
  // Unit u of the frozen layout whole (compute dtype, laid out as in the flat layout from
  // units[u].begin), readable by compute queued from now on until unit_done(u); the pass reads
  // unit `next` after it (-1: none).
  virtual Tensor unit_needed(int unit, int next) = 0;
  virtual void unit_done(int unit) = 0;
  // The flat ranges of the frozen layout this rank holds and where: what its weights are
  // loaded into.
  virtual std::vector<FlatSlice> held() const = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelSpec& spec() const = 0;
  virtual const ModelRuntime& runtime() const = 0;
  virtual const ParamLayout& layout() const = 0;
  virtual Backend& backend() const = 0;

  // (P) compute dtype and grad dtype, flat; undefined with runtime().sharded_params.
  virtual Tensor params() const = 0;
  virtual Tensor grads() const = 0;
  virtual Tensor param(int index) const = 0;
  virtual Tensor grad(int index) const = 0;
  // sharded_params: where unit u's parameters (compute dtype) or gradients (grad dtype) are now, at
  // least units[u].count() elements laid out as in the flat buffer from units[u].begin.
  virtual void bind_unit_params(int unit, const Tensor& params) = 0;
  virtual void bind_unit_grads(int unit, const Tensor& grads) = 0;
  // sharded_params, after bind_unit_grads: unit u's bound gradients hold nothing yet this step
  // (the first micro-batch's). The model zeroes what its passes add into (norms, biases, the
  // gaps between tensors) and lets the weight-gradient GEMMs write the rest, instead of
  // accumulating into a whole unit zeroed first.
  virtual void start_unit_grads(int unit) = 0;
  // runtime().fp8_unit_copies: whether a pass reading unit u now would read none of its bound
  // parameters (its FP8 weights cached, copies of the rest current), so it need not be bound.
  virtual bool unit_read_from_copies(int unit) const {
    (void)unit;
    return false;
  }
  // Parallelism follows every pass through it (null: none).
  virtual void set_unit_observer(ParamUnitObserver* observer) = 0;
  // Expert parallelism: MoE layers send their rows to the experts' ranks through it. Its size
  // must be runtime().expert_parallel_size; without one (null, the default, or detached) only
  // a model planned for one expert-parallel rank runs its MoE layers.
  virtual void set_expert_exchange(ExpertExchange* exchange) = 0;
  // The group of runtime().tensor_parallel_size ranks (not owned); needed before the first
  // pass when that is above 1.
  virtual void set_tensor_parallel_group(ParallelGroup* group) = 0;
  // The group of runtime().context_parallel_size ranks, likewise.
  virtual void set_context_parallel_group(ParallelGroup* group) = 0;

  // Starts a step's gradients (and the step's FP8 non-finite check).
  virtual void zero_grads() = 0;
  // Host int32 arrays of micro_batch whole sequences (micro_batch x seq_length x
  // context_parallel_size ids; the model takes its tokens); negative targets are ignored.
  // positions: each token's position in its document (SampleSource::sample), needed with
  // reset_position_ids or reset_attention_mask and ignored without.
  virtual void set_batch(const int32_t* tokens, const int32_t* targets,
                         const int32_t* positions = nullptr) = 0;
  // With runtime().shared_prompt_side, before set_batch: where each pair's rows are.
  virtual void set_shared_prompt_pairs(std::span<const SharedPromptPair> pairs) = 0;
  // Forward and backward of the current batch. Gradients accumulate into grads(); the
  // summed token losses accumulate into loss_sum(). d(loss)/d(logits) is scaled by
  // grad_scale (1 / tokens per optimizer step for a mean loss).
  virtual void forward_backward(float grad_scale) = 0;
  // Forward only (evaluation): summed token losses accumulate into loss_sum().
  virtual void forward_loss() = 0;
  // The backward of the current slot's last forward_loss, with d(loss)/d(logits) of sequence b
  // (as kept_head_backward counts them) scaled by sequence_scales[b] (one value: all of them):
  // for a scale that depends on the loss itself (DPO's pull on each answer). The layers'
  // stored activations are reused; the logits' gradients too with runtime().keep_logit_grads,
  // else the loss head runs again (one scale only), adding its losses to loss_sum() once more.
  // The MoE layers' auxiliary losses get aux_grad_scale, as forward_backward's grad_scale (not
  // the loss's pull, which may be negative).
  virtual void loss_backward(std::span<const float> sequence_scales, float aux_grad_scale) = 0;
  // The backward of the current slot's last forward_loss for an objective of each position's
  // log-probability of its target (GRPO's per-token policy gradient): dlogps (tokens) fp32 on
  // the device holds d(objective)/d(logp) per position; ignored targets get no gradient. The
  // output head runs again without adding to loss_sum(); the MoE layers' auxiliary losses get
  // aux_grad_scale, as forward_backward's grad_scale. Not under tensor parallelism (each rank
  // holds part of the vocabulary).
  virtual void token_loss_backward(const Tensor& dlogps, float aux_grad_scale) = 0;
  // Each position's loss from the current slot's last forward: minus the log-probability of its
  // target, 0 where the target is ignored; (tokens) fp32 on the device.
  virtual Tensor token_losses() const = 0;
  // Forward only, writing full logits (tokens, vocab) to `logits` (compute dtype or fp32).
  virtual void forward_logits(const Tensor& logits) = 0;

  // ---- pipeline stages: the passes a pipeline schedule runs (distributed/pipeline_schedule.h)
  // The model's chunks (runtime().pipeline_chunks; 1 without pipeline parallelism).
  virtual int chunks() const = 0;
  // The micro-batch slot (0 .. runtime().pipeline_slots - 1) whose activations set_batch and
  // the chunk passes use from now on.
  virtual void use_slot(int slot) = 0;
  // Forward of chunk c on the slot's micro-batch: from its tokens (the chunk holding the
  // embedding) or chunk_input, to chunk_output; the chunk holding the head then adds the
  // losses to loss_sum() and, with_grad, runs the head's backward into chunk_grad (grad_scale
  // as in forward_backward).
  virtual void forward_chunk(int chunk, bool with_grad, float grad_scale) = 0;
  // Backward of chunk c: from d(output) in chunk_grad to d(input) in chunk_grad (the
  // embedding's gradient in the chunk holding it). Weight gradients accumulate.
  virtual void backward_chunk(int chunk) = 0;
  // With runtime().keep_logit_grads, after forward_chunk(c, false) of the chunk holding the head:
  // the head's backward from the kept logit gradients into chunk_grad, those of sequence b of
  // the micro-batch scaled by sequence_scales[b] (one value: all of them), for a loss whose
  // scale each sequence learns from its own forward (DPO's answers). The sequences are the
  // micro-batch's rows, or with runtime().shared_prompt_side each pair's chosen side (its
  // shared prompt's rows with it) and rejected side: runtime().attention_batch() of them.
  // backward_chunk(c) follows.
  virtual void kept_head_backward(int chunk, std::span<const float> sequence_scales) = 0;
  // A chunk's boundary tensors (sequence_tokens(), hidden) in `slot`: what a stage receives
  // into and sends from.
  virtual Tensor chunk_input(int chunk, int slot) const = 0;
  virtual Tensor chunk_output(int chunk, int slot) const = 0;
  virtual Tensor chunk_grad(int chunk, int slot) const = 0;
  virtual Tensor loss_sum() const = 0;  // (1) fp32 on the device
  // Zeroes loss_sum() and what the step hooks record in a step.
  virtual void zero_loss_sum() = 0;

  // What the model keeps beside its parameters that each training step reduces, updates,
  // checkpoints and reports (model/step_hook.h: FP8 scaling state, MoE balance), in the order
  // the trainer drives them; owned by the model.
  virtual std::vector<StepHook*> step_hooks() const = 0;
  // State kept across steps outside the parameters (the MoE expert bias), fp32 on the device
  // by checkpoint name; empty for most models. A step hook moves it.
  virtual std::vector<std::pair<std::string, Tensor>> persistent_state() const = 0;

  // The parameters changed outside forward/backward (optimizer step, loading): drops
  // everything derived from them (the FP8 weight cache).
  virtual void params_updated() = 0;

  // ---- frozen weights apart from the parameters (LoRA's base)
  // Their layout (a whole model's, or its tensor-parallel part's), or null when every weight
  // the model reads is a parameter.
  virtual const ParamLayout* frozen_layout() const { return nullptr; }
  // With runtime().sharded_params and a frozen layout: where its units come from (not owned;
  // null detaches), needed before the first pass. Data parallelism shards them.
  virtual void set_frozen_units(FrozenUnitSource* source) { (void)source; }
};

}  // namespace tessera
