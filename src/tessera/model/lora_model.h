#pragma once
// LoRA (Hu et al., peft's LoraModel): a frozen base model whose chosen projections W get a
// trainable low-rank term, y = x W^T + (alpha / r) (x A^T) B^T, with A (r, in) and B (out, r).
// The model the trainer, the optimizer, data parallelism and checkpoints see is the adapters
// alone: their flat layout (model/lora_layout.h), parameters and gradients. Optimizer state
// exists only for them.
//
// How it runs the base: the base DecoderModel keeps no parameter or gradient buffers of its
// own (ModelRuntime::sharded_params, as under FSDP); each unit it reads is bound to its slice
// of the frozen weights (or, with runtime.sharded_params, to where the FrozenUnitSource that
// shards them over data-parallel ranks gathered it: FSDP of the base, distributed/
// fully_sharded.h), and each unit it writes gradients for to one scratch the size of the
// largest unit, which nothing reads: the base's norms and embedding are frozen too. The
// adapted linears run their adapters through LinearAdapters: no weight-gradient GEMM for W;
// the adapters' terms and gradients are GEMMs with an inner dimension of r.
//
// Fused projections (q, k, v; gate, up) take one adapter per Hugging Face piece, each on its
// rows of the fused weight, so adapters are named and shaped as peft's are. One GEMM serves
// all pieces of a fused weight: their A stacked (R = pieces x r rows) and their B set on the
// diagonal of a (rows, R) matrix that is zero elsewhere, assembled once after each change of the
// adapters (params_updated), so that a generator's decode steps add only the two GEMMs.
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/lora_targets.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/lora_layout.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class LoraModel : public Model, private LinearAdapters {
 public:
  // `runtime`: a whole model replica, its tensor-parallel part or context-parallel share (no
  // pipeline or expert parallelism); with sharded_params the frozen base is not held here but
  // comes from set_frozen_units. Under FP8 the frozen base runs its FP8 GEMMs (without weight
  // gradients) and the adapters stay in the compute dtype.
  LoraModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime, LoraOptions options);
  ~LoraModel() override;
  // What construction allocates: the frozen weights (unless sharded), the adapters and their gradients, the
  // gradient scratch of a unit and the adapters' GEMM scratch, and the base's activations.
  static ModelMemory plan_memory(const ModelSpec& spec, const ModelRuntime& runtime, const LoraOptions& options);

  // The frozen base weights this rank holds (compute dtype, ranges of the base layout), for
  // initialisation and loading: all of them, or with sharded_params the frozen source's share.
  const ParamLayout& base_layout() const { return base_->layout(); }
  std::vector<FlatSlice> base_slices() const;
  const ParamLayout* frozen_layout() const override { return &base_->layout(); }
  void set_frozen_units(FrozenUnitSource* source) override { frozen_source_ = source; }
  const LoraOptions& options() const { return options_; }
  // The adapters' term for a generator reading the base in place (Generator::use_adapters),
  // on rows of up to runtime().tokens() tokens.
  LinearAdapters& adapters() { return *this; }
  const std::vector<LoraAdapted>& adapted() const { return adapted_; }

  const ModelSpec& spec() const override { return base_->spec(); }
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
  void set_unit_observer(ParamUnitObserver* observer) override { outer_ = observer; }
  void set_expert_exchange(ExpertExchange* exchange) override { base_->set_expert_exchange(exchange); }
  void set_tensor_parallel_group(ParallelGroup* group) override {
    tensor_parallel_ = group;
    base_->set_tensor_parallel_group(group);
  }
  // Adapter `index`, whole (its full shape, compute dtype), in host memory: a split one is
  // gathered over the tensor-parallel group, so every rank of the group calls this.
  std::vector<uint8_t> whole_adapter(int index);
  void set_context_parallel_group(ParallelGroup* group) override { base_->set_context_parallel_group(group); }

  void zero_grads() override;
  void set_batch(const int32_t* tokens, const int32_t* targets, const int32_t* positions = nullptr) override {
    base_->set_batch(tokens, targets, positions);
  }
  void set_shared_prompt_pairs(std::span<const SharedPromptPair> pairs) override {
    base_->set_shared_prompt_pairs(pairs);
  }
  void forward_backward(float grad_scale) override { base_->forward_backward(grad_scale); }
  void forward_loss() override { base_->forward_loss(); }
  void loss_backward(std::span<const float> sequence_scales, float aux_grad_scale) override {
    base_->loss_backward(sequence_scales, aux_grad_scale);
  }
  void token_loss_backward(const Tensor& dlogps, float aux_grad_scale) override {
    base_->token_loss_backward(dlogps, aux_grad_scale);
  }
  Tensor token_losses() const override { return base_->token_losses(); }
  void forward_logits(const Tensor& logits) override { base_->forward_logits(logits); }
  int chunks() const override { return base_->chunks(); }
  void use_slot(int slot) override { base_->use_slot(slot); }
  void forward_chunk(int chunk, bool with_grad, float grad_scale) override {
    base_->forward_chunk(chunk, with_grad, grad_scale);
  }
  void backward_chunk(int chunk) override { base_->backward_chunk(chunk); }
  void kept_head_backward(int chunk, std::span<const float> sequence_scales) override {
    base_->kept_head_backward(chunk, sequence_scales);
  }
  Tensor chunk_input(int chunk, int slot) const override { return base_->chunk_input(chunk, slot); }
  Tensor chunk_output(int chunk, int slot) const override { return base_->chunk_output(chunk, slot); }
  Tensor chunk_grad(int chunk, int slot) const override { return base_->chunk_grad(chunk, slot); }
  Tensor loss_sum() const override { return base_->loss_sum(); }
  void zero_loss_sum() override { base_->zero_loss_sum(); }
  // The base's FP8 scaling; its MoE balance, reported (its expert bias stays frozen with it).
  std::vector<StepHook*> step_hooks() const override;
  std::vector<std::pair<std::string, Tensor>> persistent_state() const override { return {}; }
  // The fused weights' stacked A and diagonal B are assembled again at their next pass.
  void params_updated() override;

 private:
  class BaseObserver;
  // The adapted pieces of one base weight, in row order; with several, their A stacked (R, cols)
  // and B on the diagonal (rows, R), kept until the adapters change.
  struct Group {
    std::vector<int> pieces;  // indices into adapted_
    int64_t rows = 0, cols = 0;
    Tensor a, b;
    bool assembled = false;
  };
  bool adapts(int weight) const override { return group_of_[weight] >= 0; }
  void forward(const Tensor& out, const Tensor& in, int weight) override;
  void backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight) override;
  // The group's A stacked (R, cols) and B on the diagonal (rows, R): the adapters themselves
  // for a weight of one piece, else the group's, assembled when stale.
  Tensor stacked_a(Group& g);
  Tensor diagonal_b(Group& g);
  void assemble(Group& g);
  void bind_params(int unit, int next);
  void params_done(int unit);
  void bind_grads(int unit);

  Backend& backend_;
  ModelRuntime runtime_;
  LoraOptions options_;
  std::unique_ptr<DecoderModel> base_;
  std::unique_ptr<MoeBalanceHook> moe_balance_;  // with MoE layers in the base
  std::unique_ptr<BaseObserver> base_observer_;
  ParamUnitObserver* outer_ = nullptr;
  FrozenUnitSource* frozen_source_ = nullptr;  // with runtime_.sharded_params
  ParallelGroup* tensor_parallel_ = nullptr;  // null: a group of one
  ParamLayout layout_;
  std::vector<LoraAdapted> adapted_;
  std::vector<Group> groups_;
  std::vector<int> group_of_;  // per base weight: its group, or -1
  DeviceBuffer frozen_buffer_, base_grad_buffer_, param_buffer_, grad_buffer_, scratch_buffer_, fused_buffer_;
  Tensor frozen_, base_grads_, params_, grads_;
  // GEMM scratch: x A^T and dy B (compute dtype); dy^T (x A^T) and (dy B)^T x before they are
  // split over the pieces (gradient dtype).
  Tensor xa_, dyb_, db_cat_, da_cat_, piece_;
};

}  // namespace tessera
