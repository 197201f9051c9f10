#pragma once
// The Llama-family decoder (Llama 2/3/3.1, Qwen 2.5, Mistral), written once against the op
// API. Forward and backward are explicit (no autograd): each layer's stored activations
// live in one planned arena sized for (micro_batch, seq) at construction, so the memory a
// run needs is known before it starts and nothing is allocated inside a step.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"
#include "tessera/ops/backend.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

struct ModelRuntime {
  int64_t micro_batch = 1;
  int64_t seq_length = 128;
  DType compute_dtype = DType::F32;
  RecomputeGranularity recompute = RecomputeGranularity::None;
  int64_t recompute_num_layers = 0;  // with Full: first N layers; 0 = all
  int64_t cross_entropy_chunk_tokens = 8192;
  // The parameter and gradient buffers are allocated for the parameter count rounded up to
  // this multiple, so data parallelism can split them into equal per-rank shards.
  int64_t flat_buffer_multiple = 1;
  // FSDP: parameters and gradients live outside the model, sharded over ranks. The model then
  // allocates no flat buffers; its unit observer binds each unit's tensors (bind_unit_params,
  // bind_unit_grads) before the model reads or writes them, and starts each unit's gradients
  // from what they already hold, so every weight-gradient GEMM accumulates.
  bool sharded_params = false;
  Fp8Options fp8;  // FP8 linear layers (off by default)
};

// Bytes the model needs on its device, by purpose (the out-of-memory message and the
// memory planner report these).
struct ModelMemory {
  size_t weights = 0;      // compute-dtype parameters
  size_t gradients = 0;    // fp32 gradients
  size_t activations = 0;  // stored activations, backward scratch, logits chunk, batch
  size_t fp8 = 0;          // FP8 scaling state, weight cache and cast buffers (fp8 runs)
};

// What the model reports, as a pass goes, to whoever manages its parameters across ranks
// (dist/): when it reads each unit's parameters (ParamLayout::units) and writes its
// gradients, so they can be gathered just in time and reduced as soon as they are final.
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

class LlamaModel {
 public:
  LlamaModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime);

  // What construction allocates, computable without a backend.
  static ModelMemory plan_memory(const ModelSpec& spec, const ModelRuntime& runtime);

  const ModelSpec& spec() const { return spec_; }
  const ModelRuntime& runtime() const { return runtime_; }
  const ParamLayout& layout() const { return layout_; }
  Backend& backend() const { return backend_; }

  // (P) compute dtype and fp32, flat; undefined with runtime().sharded_params.
  Tensor params() const { return params_; }
  Tensor grads() const { return grads_; }
  Tensor param(int index) const;
  Tensor grad(int index) const;
  // sharded_params: where unit u's parameters (compute dtype) or gradients (fp32) are now, at
  // least units[u].count() elements laid out as in the flat buffer from units[u].begin.
  void bind_unit_params(int unit, const Tensor& params);
  void bind_unit_grads(int unit, const Tensor& grads);

  // Starts a step's gradients: zeroes those that kernels accumulate into (embedding, norms,
  // biases); the linear weights' gradients are written, not added, by their first weight-
  // gradient GEMM of the step, which saves a pass over most of the buffer.
  void zero_grads();
  // Data parallelism follows every pass through it (null: none).
  void set_unit_observer(ParamUnitObserver* observer) { observer_ = observer; }
  // Host int32 arrays of micro_batch * seq_length ids; negative targets are ignored.
  void set_batch(const int32_t* tokens, const int32_t* targets);
  // Forward and backward of the current batch. Gradients accumulate into grads(); the
  // summed token losses accumulate into loss_sum(). d(loss)/d(logits) is scaled by
  // grad_scale (1 / tokens per optimizer step for a mean loss).
  void forward_backward(float grad_scale);
  // Forward only (evaluation): summed token losses accumulate into loss_sum().
  void forward_loss();
  // Forward only, writing full logits (tokens, vocab) to `logits` (compute dtype or fp32).
  void forward_logits(const Tensor& logits);

  Tensor loss_sum() const { return a_.loss_sum; }  // (1) fp32 on the device
  void zero_loss_sum();

  // The FP8 linear layers, or null when runtime().fp8 is off.
  Fp8Linears* fp8() const { return fp8_.get(); }
  // The parameters changed outside forward/backward (optimizer step, loading): drops
  // everything derived from them (the FP8 weight cache).
  void params_updated();

 private:
  struct LayerActs {
    Tensor x_mid, ln1, rstd1, qkv, att, lse, ln2, rstd2, gate_up, h;
  };
  // Every activation tensor; all point into one arena allocation.
  struct Activations {
    std::vector<Tensor> resid;        // L+1 residual states (N, C)
    std::vector<LayerActs> stored;    // per layer; full-recompute layers alias `scratch`
    LayerActs scratch;                // recompute target of full-recompute layers
    Tensor norm_scratch;              // (N, max(C, F)) selective-recompute target
    Tensor final_norm, final_rstd, logits, losses, loss_sum;
    Tensor dresid, dnorm, grad_a, grad_b;  // backward scratch
    Tensor tokens, targets, freqs;
  };
  static size_t declare_activations(const ModelSpec& s, const ModelRuntime& rt, Activations& a,
                                    const DeviceBuffer* bind_to);

  bool recomputes_fully(int64_t layer) const;
  void layer_forward(int64_t l, const LayerActs& a);
  void layer_backward(int64_t l, const LayerActs& a);
  void recompute_layer(int64_t l, const LayerActs& a);
  void head_forward(bool with_grad, float grad_scale);
  void embed();
  // The observer's calls (no-ops without one). The tail's also cover the embedding table
  // when the head is tied to it.
  void params_needed(int unit, int next);
  void params_done(int unit);
  void grads_needed(int unit);
  void grads_ready(int unit);
  void tail_params_needed(int next);
  void tail_params_done();
  bool tied() const { return layout_.lm_head == layout_.embedding; }
  void linear(const Tensor& out, const Tensor& in, int weight, int bias, float beta,
              const Tensor& residual);
  void linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight,
                       int bias);
  AttentionShape attention_shape() const;

  Backend& backend_;
  ModelSpec spec_;
  ModelRuntime runtime_;
  ParamLayout layout_;
  DeviceBuffer param_buffer_, grad_buffer_, act_buffer_;
  Tensor params_, grads_;
  std::vector<Tensor> unit_params_, unit_grads_;  // per unit: views of params_/grads_, or bound
  Activations a_;
  ParamUnitObserver* observer_ = nullptr;
  std::unique_ptr<Fp8Linears> fp8_;
  std::vector<int> fp8_index_;  // per parameter: its FP8 linear, or -1
  // The ranges of grads_ that zero_grads() fills: everything but the weights that only
  // weight-gradient GEMMs write.
  std::vector<ParamRange> accumulated_grad_ranges_;
  // Per parameter: whether a weight-gradient GEMM wrote it since zero_grads() (the next one
  // accumulates).
  std::vector<char> grad_written_;
};

}  // namespace tessera
