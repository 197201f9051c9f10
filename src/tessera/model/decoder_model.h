#pragma once
// The decoder every family builds (model/model_family.h): a token embedding, decoder layers
// made of the family's blocks, a final RMSNorm and an output head with a chunked
// cross-entropy, written once against the op API. Forward and backward are explicit (no
// autograd): every activation lives in one planned arena (model/activation_plan.h) sized for
// (micro_batch, seq) at construction, so the memory a run needs is known before it starts and
// nothing is allocated inside a step. Its place among ranks is its runtime's: the parallel
// layers it runs its linears, embedding, cross-entropy and attention through
// (model/parallel_layers.h) do the collectives their split needs.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "tessera/model/block.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/model/model.h"
#include "tessera/model/moe_balance.h"
#include "tessera/model/parallel_layers.h"
#include "tessera/model/rope.h"
#include "tessera/model/shared_prompt.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class DecoderModel final : public Model, private LayerOps {
 public:
  DecoderModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime);
  ~DecoderModel() override;

  // What construction allocates, computable without a backend: the same declarations the
  // constructor allocates from.
  static ModelMemory plan_memory(const ModelSpec& spec, const ModelRuntime& runtime);
  // The parameter layout the model has on a rank with `runtime` (its tensor-parallel part).
  static ParamLayout plan_layout(const ModelSpec& spec, const ModelRuntime& runtime);

  const ModelSpec& spec() const override { return spec_; }
  const ModelRuntime& runtime() const override { return runtime_; }
  const ParamLayout& layout() const override { return layout_; }
  Backend& backend() const override { return backend_; }

  Tensor params() const override { return params_; }
  Tensor grads() const override { return grads_; }
  Tensor param(int index) const override;
  Tensor grad(int index) const override;
  void bind_unit_params(int unit, const Tensor& params) override;
  void bind_unit_grads(int unit, const Tensor& grads) override;
  void start_unit_grads(int unit) override;
  bool unit_read_from_copies(int unit) const override;
  void set_unit_observer(ParamUnitObserver* observer) override { observer_ = observer; }
  void set_expert_exchange(ExpertExchange* exchange) override;
  void set_tensor_parallel_group(ParallelGroup* group) override { tp_.group = group; }
  void set_context_parallel_group(ParallelGroup* group) override;

  // Zeroes the gradients kernels accumulate into (embedding, norms, biases); the linear
  // weights' gradients are written, not added, by their first weight-gradient GEMM of the
  // step, which saves a pass over most of the buffer.
  void zero_grads() override;
  void set_batch(const int32_t* tokens, const int32_t* targets,
                 const int32_t* positions = nullptr) override;
  void set_shared_prompt_pairs(std::span<const SharedPromptPair> pairs) override;
  void forward_backward(float grad_scale) override;
  void forward_loss() override;
  void loss_backward(std::span<const float> sequence_scales, float aux_grad_scale) override;
  void token_loss_backward(const Tensor& dlogps, float aux_grad_scale) override;
  Tensor token_losses() const override { return a_.losses; }
  void forward_logits(const Tensor& logits) override;
  Tensor loss_sum() const override { return a_.loss_sum; }
  void zero_loss_sum() override;
  std::vector<StepHook*> step_hooks() const override;
  std::vector<std::pair<std::string, Tensor>> persistent_state() const override { return state_; }
  // Load balance of the MoE layers (docs/moe.md), summed over the forward passes since
  // zero_loss_sum(): (moe layers, experts + 3) fp32 on the device, per MoE layer in layer
  // order the (token, slot) pairs routed to each expert, then the layer's aux loss and z-loss
  // (unweighted, summed over micro-batches) and the pairs dropped beyond the experts' capacity.
  // Undefined for a dense model. Its step hook (MoeBalanceHook) reduces and reports them.
  Tensor moe_stats() const { return moe_stats_; }
  // The decoder layer of each row of moe_stats().
  const std::vector<int64_t>& moe_layers() const { return moe_layers_; }
  // The FP8 linear layers, or null when runtime().fp8 is off.
  Fp8Linears* fp8() const { return fp8_.get(); }
  // LoRA: adapters on some linear weights, which are then frozen (not owned).
  void use_linear_adapters(LinearAdapters* adapters) { gemms_.use_adapters(adapters); }
  void params_updated() override;

  int chunks() const override { return static_cast<int>(chunks_.size()); }
  void use_slot(int slot) override;
  void forward_chunk(int chunk, bool with_grad, float grad_scale) override;
  void backward_chunk(int chunk) override;
  void kept_head_backward(int chunk, std::span<const float> sequence_scales) override;
  Tensor chunk_input(int chunk, int slot) const override;
  Tensor chunk_output(int chunk, int slot) const override;
  Tensor chunk_grad(int chunk, int slot) const override;

 private:
  void set_document_positions(const int32_t* positions);
  AttentionShape attention_shape(const AttentionShape& s) const;
  double document_pairs(int64_t window) const;
  // Model-level activations (the layers and blocks hold their own). Ns = sequence_tokens().
  struct Activations {
    // Per chunk: its layers' count + 1 residual states (Ns, C), from its input to its output.
    std::vector<std::vector<Tensor>> resid;
    // Per chunk: d(residual state) (Ns, C) as its backward goes, from d(output) to d(input).
    std::vector<Tensor> dresid;
    Tensor final_norm, final_rstd, logits, losses, loss_sum;
    // head_on_loss_rows: the rows whose targets count, then padding rows (N) int32, and their
    // targets (N) int32, per slot; a chunk of the head's input rows and of their gradient
    // (chunk, C), and a chunk's fp32 value per row (its losses, or its d(logps)).
    Tensor loss_rows, loss_targets, head_in, head_din, row_values;
    Tensor logit_grads;  // keep_logit_grads: (tokens, vocab) d(loss)/d(logits) at unit scale
    // token_loss_backward: a logits chunk's log-probabilities of the targets and logsumexps
    Tensor chunk_logps, chunk_lse;
    Tensor dnorm;  // d(a norm's output), (Ns, C)
    Tensor tokens, targets;
    Tensor document_starts;  // (N) int32 with reset_attention_mask
    RopeTables rope;  // one table per rotary base the layers read
    Tensor capped;    // with a logit soft-cap: a chunk's capped logits
    // Tensor parallelism: a logits chunk's cross-entropy stats (chunk, 2) and every rank's
    // (tp, chunk, 2).
    Tensor ce_stats, ce_all_stats;
    // Sequence parallelism, (N, C): a residual-stream tensor gathered from every rank, and the
    // partial sums a rank computes for all tokens before they are reduce-scattered.
    Tensor gathered, partial;
    // Context parallelism: this rank's keys and values (N, 2 KV D), every rank's (cp x N, ...)
    // and their gradients, and every rank's token positions (cp, seq_length) int32.
    Tensor cp_kv, cp_kv_all, cp_dkv_all, cp_positions;
    SharedPromptBuffers shared_prompt;  // with shared_prompt_side
  };
  // Declares the layers' and the model's activations into `plan`.
  static void declare_activations(const ModelSpec& spec, const ModelRuntime& rt,
                                  const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                  Activations& a, ActivationPlan& plan);
  // Re-runs the forward of the full-recompute group that ends at layer `last` of `chunk`.
  void recompute_group(int chunk, size_t last);
  // Allocates the blocks' statistics and binds each layer's row; likewise their state.
  void bind_stats();
  void bind_state();

  // LayerOps
  void linear(const Tensor& out, const LinearOperand& in, int weight, int bias,
              const Tensor& residual) override;
  void linear_backward(const Tensor& din, const LinearOperand& dout, const LinearOperand& in,
                       int weight, int bias) override;
  Fp8CastArgs linear_output_grad_cast(int weight, int64_t rows) const override;
  Fp8CastArgs linear_input_cast(int weight, int64_t rows) const override;
  bool linear_keeps_input_codes(int weight, int64_t rows) const override;
  const Tensor& rope_table(double base) const override { return a_.rope.at(base); }
  void expert_linear(const Tensor& out, const Tensor& in, int weight, const Tensor& w,
                     const ExpertGroups& groups) override;
  void expert_linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight,
                              const Tensor& w, const Tensor& dw,
                              const ExpertGroups& groups) override;
  // FP8 expert stacks ask for their FP8 GEMMs (Backend::grouped_matmul_fp8).
  bool expert_linear_reads_device_offsets(int weight, const Tensor& in) const override {
    if (!gemms_.is_fp8(weight)) return ForwardOps::expert_linear_reads_device_offsets(weight, in);
    return backend().grouped_matmul_reads_device_offsets(DType::E4M3, in.dim(0),
                                                         param(weight).dim(0));
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& s, const Fp8CastArgs& codes) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                          const Tensor& lse, const Tensor& qkv, const AttentionShape& s) override;
  const Tensor& norm_grad() const override { return a_.dnorm; }
  float loss_grad_scale() const override { return grad_scale_; }
  ExpertExchange* expert_exchange() const override { return expert_exchange_; }
  bool recomputing() const override { return recomputing_; }
  int activation_slot() const override { return slot_; }

  // The first vocabulary id of this rank's rows of the embedding and output head.
  int64_t first_vocab_id() const { return runtime_.tensor_parallel_rank * local_spec_.vocab_size; }

  void embed(const Tensor& x);
  void forward_layers(int chunk);
  void head_forward(int chunk, bool with_grad, float grad_scale);
  // The output head's backward for per-position gradients of the targets' log-probabilities.
  void head_backward_per_token(const Tensor& dlogps);
  // What the head's passes share: its parameters (and with gradients, its gradients and the
  // next layer's parameters) requested and the final norm computed; then, after them, the
  // norm's backward into the chunk's residual gradient and the units released. `normed` and
  // `dnormed`: the head's input rows and their gradient (every rank's sequence under
  // sequence parallelism).
  struct HeadRows {
    Tensor normed, dnormed;
  };
  HeadRows head_begin(int chunk, bool with_grad);
  void head_end(int chunk, bool with_grad);
  // One chunk of the head's rows: every position's, or with head_on_loss_rows the loss rows'
  // (then gathered from the head's input, and their losses and input gradient scattered back
  // after the body).
  struct HeadChunk {
    int64_t first = 0;  // its first row among the head's rows
    Tensor rows;        // the positions of its rows (loss rows only; else undefined)
    Tensor logits, normed, targets;  // (n, V), (n, C), (n)
    Tensor losses, dnormed;          // (n) fp32 and (n, C): where the body writes them
  };
  // The rows the head runs on in the current slot: all tokens, or the loss rows.
  int64_t head_rows() const;
  // The head chunk [c, c + n) of its rows: the normed rows gathered where they are loss rows.
  HeadChunk head_chunk(const HeadRows& head, int64_t c, int64_t n);
  // After a chunk's body: its losses and input gradient into every position's, where the
  // chunk holds loss rows.
  void head_chunk_done(const HeadRows& head, const HeadChunk& k, bool losses, bool dnormed);
  // The head's logits chunk by chunk, so that only chunk x vocabulary of them ever exist: each
  // chunk's GEMM into the logits buffer, then body(chunk), then its losses (with `losses`) and
  // input gradient (with `dnormed`) put back at their positions.
  void head_chunks(const HeadRows& head, bool losses, bool dnormed,
                   const std::function<void(const HeadChunk&)>& body);
  // set_batch's targets (this rank's tokens): with head_on_loss_rows, the slot's loss rows.
  void set_loss_rows(const int32_t* targets);
  bool holds_embedding(int chunk) const { return chunk == 0 && parts_.embedding; }
  bool holds_head(int chunk) const { return chunk == chunks() - 1 && parts_.head; }
  // The parameter unit of the rank's layer `layer` (an index into layers_).
  int layer_unit(size_t layer) const;
  Tensor at_slot(const Tensor& t, int slot) const;
  // The observer's calls (no-ops without one). The tail's also cover the embedding table
  // when the head is tied to it.
  void params_needed(int unit, int next);
  void params_done(int unit);
  void grads_needed(int unit);
  void grads_ready(int unit);
  void tail_params_needed(int next);
  void tail_params_done();
  bool tied() const { return layout_.embedding >= 0 && layout_.lm_head == layout_.embedding; }

  Backend& backend_;
  ModelSpec spec_;
  ModelRuntime runtime_;
  ModelSpec local_spec_;            // what this rank computes of spec_ (tensor_parallel_shard)
  std::vector<LayerRange> chunks_;  // the runs of layers held (pipeline chunks, or all)
  DecoderParts parts_;              // whether it holds the embedding and the head
  std::vector<std::unique_ptr<DecoderLayer>> layers_;  // the chunks' layers, in order
  std::vector<size_t> chunk_begin_;                    // each chunk's first in layers_
  ParamLayout layout_;
  DeviceBuffer param_buffer_, grad_buffer_, act_buffer_;
  std::unique_ptr<ActivationPlan> plan_;
  int slot_ = 0;  // the micro-batch slot the activations are bound to
  Tensor params_, grads_;
  std::vector<Tensor> unit_params_, unit_grads_;  // per unit: views of params_/grads_, or bound
  ParamUnitObserver* observer_ = nullptr;
  // runtime_.fp8_unit_copies: per unit, its parameters kept in copies (index, offset) and its
  // FP8 linears; per parameter its copy; per unit whether the copies hold the current weights
  // and whether the pass between params_needed and params_done reads them.
  std::vector<std::vector<std::pair<int, int64_t>>> unit_copies_;
  std::vector<std::vector<int>> unit_fp8_;
  DeviceBuffer copy_buffer_;
  std::vector<Tensor> param_copies_;
  std::vector<char> copies_current_, reading_copies_;
  ExpertExchange* expert_exchange_ = nullptr;
  std::vector<int32_t> context_positions_;  // of this rank's tokens in the whole sequence
  // reset_position_ids: each base's rotary table for positions 0 .. seq_length-1, whose rows
  // set_batch copies to every token's row of the model's table.
  std::vector<std::pair<double, std::vector<float>>> position_tables_;
  std::vector<int32_t> host_ids_;           // this rank's tokens of a micro-batch, on the host
  // head_on_loss_rows: per slot, the head's rows (loss rows and padding), or -1 for every
  // token; and the host's rows and targets before their upload.
  std::vector<int64_t> loss_row_count_;
  // Per slot, where each scaled sequence's rows begin (kept_head_backward's sequences:
  // attention_batch() + 1 values), among the tokens and among the head's rows (the loss rows
  // of sequence b are [begin[b], begin[b + 1]), the padding after the last).
  std::vector<std::vector<int64_t>> sequence_rows_, sequence_head_rows_;
  // shared_prompt_side: per slot, the pairs' layout on the host (their rows in a_.shared_prompt).
  std::vector<SharedPromptAttention::Layout> shared_prompt_layouts_;
  std::unique_ptr<SharedPromptAttention> shared_prompt_;
  std::vector<int32_t> host_loss_rows_, host_loss_targets_;
  // Packed documents, per slot: each token's position in its document (what its attention
  // sees), and the visible pairs by attention window, counted once per batch (every layer's
  // forward and backward asks).
  std::vector<std::vector<int32_t>> document_positions_;
  mutable std::vector<std::map<int64_t, double>> document_pairs_;

  Activations a_;
  float grad_scale_ = 0.0f;  // of the forward_backward in progress
  bool recomputing_ = false;  // inside recompute_group

  // The blocks' statistics (Block::stats_width): one row per layer that keeps any.
  DeviceBuffer stats_buffer_;
  Tensor moe_stats_;
  std::vector<int64_t> moe_layers_;
  std::unique_ptr<MoeBalanceHook> moe_balance_;  // with MoE layers
  // The blocks' state kept across steps (Block::state_width), zero from the start.
  DeviceBuffer state_buffer_;
  std::vector<std::pair<std::string, Tensor>> state_;

  std::unique_ptr<Fp8Linears> fp8_;
  // The ranges of grads_ that zero_grads() fills: everything but the weights that only
  // weight-gradient GEMMs write; and per unit, its own such ranges (from its start), which
  // start_unit_grads fills, and its GEMM-written weights.
  std::vector<ParamRange> accumulated_grad_ranges_;
  std::vector<std::vector<ParamRange>> unit_accumulated_ranges_;
  std::vector<std::vector<int>> unit_gemm_weights_;

  // The layers that run the model's GEMMs and collectives (model/parallel_layers.h).
  LinearGemms gemms_;
  TensorParallelGroup tp_;
  ColumnParallelLinear column_{tp_, gemms_};
  RowParallelLinear row_{tp_, gemms_};
  std::unique_ptr<VocabParallelEmbedding> embedding_;
  std::unique_ptr<VocabParallelCrossEntropy> cross_entropy_;
  std::unique_ptr<ContextParallelAttention> attention_;
};

}  // namespace tessera
