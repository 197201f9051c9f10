#pragma once
// One decoder layer: its blocks in order (model/block.h) and the residual states between
// them, one parameter unit. The family decides the blocks (make_decoder_layer).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/model/block.h"

namespace tessera {

class DecoderLayer {
 public:
  DecoderLayer(int64_t index, std::vector<std::unique_ptr<Block>> blocks);
  int64_t index() const { return index_; }  // in the whole model

  // Starts the layer's unit ("model.layers.<index>.") and adds every block's parameters.
  void declare_params(ParamLayoutBuilder& builder);
  std::vector<int> linear_weights() const;
  std::vector<std::pair<int, Fp8LinearShape>> expert_linears(const ModelRuntime& rt) const;
  // The layer's activations; `role`: whether a full recompute re-runs it, and in which group
  // (activation_plan.h). `input`: the residual state the layer reads, declared here when it is
  // recomputed with the layer's group (the group's inner states), else null.
  void declare_activations(ActivationPlan& plan, const ModelSpec& spec, const ModelRuntime& rt,
                           const RecomputeRole& role, Tensor* input);
  void declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt);

  // out (N, C) = the layer applied to x (N, C).
  void forward(LayerOps& ops, const Tensor& x, const Tensor& out);
  // forward again before its backward, to refill a fully recomputed layer's activations; its
  // output `out` is stored, and rewritten with the same values only where a post-norm needs its
  // block's projection output again.
  void recompute(LayerOps& ops, const Tensor& x, const Tensor& out);
  // On entry dresid holds d(loss)/d(out); on exit d(loss)/d(x).
  void backward(LayerOps& ops, const Tensor& x, const Tensor& dresid);

  // Generation (model/generator.h): the layer on n new tokens x (n, C) at `at`
  // (Mixer::forward_cached), out (n, C). caches[i] is block i's cache (S, its cache_width()),
  // or (B, S, its cache_width()) for a batch.
  void forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x, const Tensor& out,
                      const std::vector<Tensor>& caches, const CachePosition& at);
  // Values per position each block caches, and the scratch bytes forward_cached takes for n
  // tokens.
  std::vector<int64_t> cache_widths() const;
  // Whether any block reads device results on the host while decoding (Mixer::decode_reads_host).
  bool decode_reads_host(const Backend& backend, int64_t tokens, DType dtype) const;
  size_t cached_scratch_bytes(int64_t n, int64_t hidden, DType dtype) const;

  // The rotary bases its mixers read (Mixer::rope_bases).
  std::vector<double> rope_bases() const;
  int64_t matmul_params() const;
  // Its blocks' linear layers, in the order the forward runs them (Mixer::linear_gemms).
  std::vector<LinearGemm> linear_gemms() const;
  // Its first block's attention shape (Mixer::attention_shape); none without attention.
  std::optional<AttentionShape> attention_shape(int64_t batch, int64_t seq) const;
  double attention_flops_per_token(int64_t seq_length) const;
  // The statistics its blocks keep (Block::stats_width), bound block after block.
  int64_t stats_width() const;
  void bind_stats(const Tensor& stats);
  // Its blocks' state kept across steps (Block::state_width): (block name, width) per block
  // that keeps any, in block order; binding and updating go block by block.
  std::vector<std::pair<std::string, int64_t>> state_layout() const;
  void bind_state(const std::vector<Tensor>& states);
  void update_state(Backend& backend);

 private:
  void run_blocks(LayerOps& ops, const Tensor& x, const Tensor& out, bool recompute);

  int64_t index_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<Tensor> between_;  // (N, C) residual state after each block but the last
};

// Every rotary base some layer reads, each once.
std::vector<double> rope_bases(const std::vector<std::unique_ptr<DecoderLayer>>& layers);

// Layer `layer` of `spec`'s model, made of its family's blocks; all of its layers.
std::unique_ptr<DecoderLayer> make_decoder_layer(const ModelSpec& spec, int64_t layer);
std::vector<std::unique_ptr<DecoderLayer>> make_decoder_layers(const ModelSpec& spec);

// The parameter layout of a decoder with these layers (param_layout.h), which keep the
// indices of their parameters in it: the embedding; per layer, each block's parameters in
// order; the final norm; the output head (if untied). With tensor parallelism `spec` and the
// layers are a rank's share (tensor_parallel_shard) and the layout holds the parts `split`
// names of every split parameter (and of the expert stacks). A pipeline stage holds some of the
// layers, and the embedding and the head (with the final norm) only where they are its own.
struct DecoderParts {
  bool embedding = true, head = true;
};
ParamLayout decoder_param_layout(const ModelSpec& spec,
                                 const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                 ParamSplit split = {}, DecoderParts parts = {});

}  // namespace tessera
