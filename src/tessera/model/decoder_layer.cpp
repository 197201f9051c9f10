#include "tessera/model/decoder_layer.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera {

DecoderLayer::DecoderLayer(int64_t index, std::vector<std::unique_ptr<Block>> blocks)
    : index_(index), blocks_(std::move(blocks)), between_(blocks_.size() - 1) {}

void DecoderLayer::declare_params(ParamLayoutBuilder& builder) {
  builder.begin_unit(fmt::format("model.layers.{}.", index_), static_cast<int>(index_));
  for (auto& b : blocks_) b->declare_params(builder);
}

std::vector<int> DecoderLayer::linear_weights() const {
  std::vector<int> weights;
  for (const auto& b : blocks_)
    for (int w : b->mixer().linear_weights()) weights.push_back(w);
  return weights;
}

std::vector<std::pair<int, Fp8LinearShape>> DecoderLayer::expert_linears(
    const ModelRuntime& rt) const {
  std::vector<std::pair<int, Fp8LinearShape>> stacks;
  for (const auto& b : blocks_)
    for (auto& s : b->mixer().expert_linears(rt)) stacks.push_back(std::move(s));
  return stacks;
}

void DecoderLayer::declare_activations(ActivationPlan& plan, const ModelSpec& spec,
                                       const ModelRuntime& rt, const RecomputeRole& role,
                                       Tensor* input) {
  plan.begin_layer(role.recomputed, !role.group_start);
  if (input) plan.add(input, rt.compute_dtype, {rt.sequence_tokens(), spec.hidden});
  for (Tensor& t : between_) plan.add(&t, rt.compute_dtype, {rt.sequence_tokens(), spec.hidden});
  for (auto& b : blocks_) b->declare_activations(plan, rt);
  plan.end_layer();
}

void DecoderLayer::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  for (auto& b : blocks_) {
    plan.begin_backward_scratch();
    b->declare_backward_scratch(plan, rt);
    plan.end_backward_scratch();
  }
}

// The recompute pass of a fully recomputed layer skips its last block's output projection,
// whose result (the layer's output) is stored, unless a post-norm needs the projection's own
// output in the backward: then it reruns into the stored output, rewriting the same values.
void DecoderLayer::run_blocks(LayerOps& ops, const Tensor& x, const Tensor& out, bool recompute) {
  Tensor in = x;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const bool last = i + 1 == blocks_.size();
    ScopedRange r(ops.backend(), blocks_[i]->range_name());
    blocks_[i]->forward_inner(ops, in);
    if (last && recompute && !blocks_[i]->norms().post) break;
    const Tensor& next = last ? out : between_[i];
    blocks_[i]->forward_output(ops, in, next);
    in = next;
  }
}

void DecoderLayer::forward(LayerOps& ops, const Tensor& x, const Tensor& out) {
  run_blocks(ops, x, out, false);
}

void DecoderLayer::recompute(LayerOps& ops, const Tensor& x, const Tensor& out) {
  run_blocks(ops, x, out, true);
}

void DecoderLayer::backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) {
  for (size_t i = blocks_.size(); i-- > 0;) {
    ScopedRange r(ops.backend(), blocks_[i]->backward_range_name());
    blocks_[i]->backward(ops, i == 0 ? x : between_[i - 1], dresid);
  }
}

void DecoderLayer::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x,
                                  const Tensor& out, const std::vector<Tensor>& caches,
                                  const CachePosition& at) {
  const size_t start = scratch.mark();
  std::vector<Tensor> states = {x};
  for (size_t i = 0; i + 1 < blocks_.size(); ++i) states.push_back(scratch.take(x.dtype, x.shape));
  states.push_back(out);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const size_t block_start = scratch.mark();
    blocks_[i]->forward_cached(ops, scratch, states[i], states[i + 1], caches[i], at);
    scratch.release(block_start);
  }
  scratch.release(start);
}

std::vector<int64_t> DecoderLayer::cache_widths() const {
  std::vector<int64_t> widths;
  for (const auto& b : blocks_) widths.push_back(b->mixer().cache_width());
  return widths;
}

bool DecoderLayer::decode_reads_host(const Backend& backend, int64_t tokens, DType dtype) const {
  return std::any_of(blocks_.begin(), blocks_.end(), [&](const auto& b) {
    return b->mixer().decode_reads_host(backend, tokens, dtype);
  });
}

size_t DecoderLayer::cached_scratch_bytes(int64_t n, int64_t hidden, DType dtype) const {
  size_t largest = 0;
  for (const auto& b : blocks_) largest = std::max(largest, b->cached_scratch_bytes(n, dtype));
  const size_t states = (blocks_.size() - 1) * ScratchArena::aligned(n * hidden * dtype_size(dtype));
  return states + largest;
}

std::vector<double> DecoderLayer::rope_bases() const {
  std::vector<double> bases;
  for (const auto& b : blocks_)
    for (double base : b->mixer().rope_bases())
      if (std::find(bases.begin(), bases.end(), base) == bases.end()) bases.push_back(base);
  return bases;
}

std::vector<double> rope_bases(const std::vector<std::unique_ptr<DecoderLayer>>& layers) {
  std::vector<double> bases;
  for (const auto& layer : layers)
    for (double base : layer->rope_bases())
      if (std::find(bases.begin(), bases.end(), base) == bases.end()) bases.push_back(base);
  return bases;
}

int64_t DecoderLayer::matmul_params() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b->mixer().matmul_params();
  return n;
}

std::vector<LinearGemm> DecoderLayer::linear_gemms() const {
  std::vector<LinearGemm> g;
  for (const auto& b : blocks_)
    for (LinearGemm& one : b->mixer().linear_gemms()) g.push_back(std::move(one));
  return g;
}

std::optional<AttentionShape> DecoderLayer::attention_shape(int64_t batch, int64_t seq) const {
  for (const auto& b : blocks_)
    if (auto a = b->mixer().attention_shape(batch, seq)) return a;
  return std::nullopt;
}

double DecoderLayer::attention_flops_per_token(int64_t seq_length) const {
  double f = 0;
  for (const auto& b : blocks_) f += b->mixer().attention_flops_per_token(seq_length);
  return f;
}

int64_t DecoderLayer::stats_width() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b->mixer().stats_width();
  return n;
}

void DecoderLayer::bind_stats(const Tensor& stats) {
  int64_t at = 0;
  for (auto& b : blocks_) {
    const int64_t n = b->mixer().stats_width();
    if (n == 0) continue;
    b->mixer().bind_stats(stats.flat_range(at, n));
    at += n;
  }
}

std::vector<std::pair<std::string, int64_t>> DecoderLayer::state_layout() const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& b : blocks_)
    if (b->mixer().state_width() > 0)
      out.emplace_back(fmt::format("model.layers.{}.{}", index_, b->mixer().state_name()),
                       b->mixer().state_width());
  return out;
}

void DecoderLayer::bind_state(const std::vector<Tensor>& states) {
  size_t i = 0;
  for (auto& b : blocks_)
    if (b->mixer().state_width() > 0) b->mixer().bind_state(states.at(i++));
}

void DecoderLayer::update_state(Backend& backend) {
  for (auto& b : blocks_) b->mixer().update_state(backend);
}

std::unique_ptr<DecoderLayer> make_decoder_layer(const ModelSpec& spec, int64_t layer) {
  return std::make_unique<DecoderLayer>(layer, model_family(spec.family).layer_blocks(spec, layer));
}

std::vector<std::unique_ptr<DecoderLayer>> make_decoder_layers(const ModelSpec& spec) {
  std::vector<std::unique_ptr<DecoderLayer>> layers;
  for (int64_t l = 0; l < spec.num_layers; ++l) layers.push_back(make_decoder_layer(spec, l));
  return layers;
}

ParamLayout decoder_param_layout(const ModelSpec& s,
                                 const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                 ParamSplit split, DecoderParts parts) {
  TS_CHECK(!s.tied_embeddings || parts.embedding || !parts.head,
           "a head tied to an embedding the layout does not hold");
  ParamLayout l;
  ParamLayoutBuilder b(l, split);
  if (parts.embedding) {
    b.begin_unit("model.", -1);
    l.embedding = b.add("embed_tokens.weight", {s.vocab_size, s.hidden}, ParamInit::Normal, true,
                        TensorParallelStyle::Vocab);
  }
  for (const auto& layer : layers) layer->declare_params(b);
  if (parts.head) {
    b.begin_unit("", -1);
    l.final_norm = b.add("model.norm.weight", {s.hidden}, ParamInit::Ones, false);
    l.lm_head = s.tied_embeddings ? l.embedding
                                  : b.add("lm_head.weight", {s.vocab_size, s.hidden},
                                          ParamInit::Normal, true, TensorParallelStyle::Vocab);
  }
  return l;
}

}  // namespace tessera
