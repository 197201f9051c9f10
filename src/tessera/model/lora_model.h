#pragma once
// LoRA (Hu et al., peft's LoraModel): a frozen base model whose chosen projections W get a
// trainable low-rank update, W + (alpha / r) B A, with A (r, in) and B (out, r). The model the
// trainer, the optimizer, data parallelism and checkpoints see is the adapters alone: their
// flat layout (one unit per base unit, so a layer's adapters are reduced as soon as its
// backward ends), parameters and gradients. Optimizer state exists only for them.
//
// How it runs the base: the base DecoderModel keeps no parameter or gradient buffers of its
// own (ModelRuntime::sharded_params, as under FSDP) and reports every unit it reads or writes.
// Before a unit is read, its weights are bound to a scratch holding W + (alpha / r) B A for
// each adapted projection (a GEMM of out x r x in, small beside the layer's); the unit's
// gradients are bound to a scratch, and once the layer's backward has written dW there the
// adapters' gradients follow from it: dB += (alpha / r) dW A^T, dA += (alpha / r) B^T dW.
// The frozen weights themselves get no gradient buffer and no optimizer state, only one
// unit-sized scratch each for the merged weights and dW.
//
// Fused projections (q, k, v; gate, up) take one adapter per Hugging Face piece, each on its
// rows of the fused weight, so adapters are named and shaped as peft's are.
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/lora_targets.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/lora_layout.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class LoraModel : public Model {
 public:
  // The base is built for `runtime` with its own buffers replaced by the scratch binding
  // above; `runtime` must be a single model replica (no tensor, pipeline, context or expert
  // parallelism, no FP8, not sharded).
  LoraModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime, LoraOptions options);
  ~LoraModel() override;
  // What construction allocates: the frozen weights, the adapters and their gradients, a
  // layer's merged weights and dW, and the base's activations.
  static ModelMemory plan_memory(const ModelSpec& spec, const ModelRuntime& runtime, const LoraOptions& options);

  // The frozen base weights (compute dtype, the base layout), for initialisation and loading.
  const ParamLayout& base_layout() const { return base_->layout(); }
  Tensor base_params() const { return frozen_; }
  const LoraOptions& options() const { return options_; }
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
  void set_unit_observer(ParamUnitObserver* observer) override { outer_ = observer; }
  void set_expert_exchange(ExpertExchange* exchange) override { base_->set_expert_exchange(exchange); }
  void set_tensor_parallel_group(ParallelGroup* group) override { base_->set_tensor_parallel_group(group); }
  void set_context_parallel_group(ParallelGroup* group) override { base_->set_context_parallel_group(group); }

  void zero_grads() override;
  void set_batch(const int32_t* tokens, const int32_t* targets, const int32_t* positions = nullptr) override {
    base_->set_batch(tokens, targets, positions);
  }
  void forward_backward(float grad_scale) override { base_->forward_backward(grad_scale); }
  void forward_loss() override { base_->forward_loss(); }
  void forward_logits(const Tensor& logits) override { base_->forward_logits(logits); }
  int chunks() const override { return base_->chunks(); }
  void use_slot(int slot) override { base_->use_slot(slot); }
  void forward_chunk(int chunk, bool with_grad, float grad_scale) override {
    base_->forward_chunk(chunk, with_grad, grad_scale);
  }
  void backward_chunk(int chunk) override { base_->backward_chunk(chunk); }
  Tensor chunk_input(int chunk, int slot) const override { return base_->chunk_input(chunk, slot); }
  Tensor chunk_output(int chunk, int slot) const override { return base_->chunk_output(chunk, slot); }
  Tensor chunk_grad(int chunk, int slot) const override { return base_->chunk_grad(chunk, slot); }
  Tensor loss_sum() const override { return base_->loss_sum(); }
  void zero_loss_sum() override { base_->zero_loss_sum(); }
  Tensor moe_stats() const override { return base_->moe_stats(); }
  const std::vector<int64_t>& moe_layers() const override { return base_->moe_layers(); }
  std::vector<std::pair<std::string, Tensor>> persistent_state() const override { return {}; }
  void update_persistent_state() override {}
  Fp8Linears* fp8() const override { return nullptr; }
  // Merged weights are rebuilt at every read of a unit: nothing derived is kept.
  void params_updated() override {}

 private:
  class BaseObserver;
  void bind_params(int unit);
  void bind_grads(int unit);
  void adapter_grads(int unit);

  Backend& backend_;
  ModelRuntime runtime_;
  LoraOptions options_;
  std::unique_ptr<DecoderModel> base_;
  std::unique_ptr<BaseObserver> base_observer_;
  ParamUnitObserver* outer_ = nullptr;
  ParamLayout layout_;
  std::vector<LoraAdapted> adapted_;
  std::vector<std::vector<int>> adapted_in_unit_;  // indices into adapted_, per unit
  DeviceBuffer frozen_buffer_, merged_buffer_, base_grad_buffer_, param_buffer_, grad_buffer_;
  Tensor frozen_, merged_, base_grads_, params_, grads_;
};

}  // namespace tessera
