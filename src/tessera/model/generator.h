#pragma once
// Autoregressive generation with a KV cache: a model's weights on a backend, a prompt fed in
// one pass (prefill), then one token at a time, each attending to the keys and values the
// layers cached for every earlier position, so a new token costs one token's work, not the
// whole sequence's. One sequence at a time; sampling (model/sampling.h) picks each next token
// from the logits. The layers and blocks are the family's (model/decoder_layer.h), run
// through Block::forward_cached.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tessera/model/block.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/model/rope.h"
#include "tessera/model/scratch_arena.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class Generator final : private ForwardOps {
 public:
  // Room for `max_positions` positions: the prompt and the tokens generated after it.
  Generator(Backend& backend, const ModelSpec& spec, DType compute_dtype, int64_t max_positions);
  // Generation from weights that live elsewhere, read in place (a training model's: GRPO
  // samples from the policy it trains, with no copy): `params`, compute dtype, laid out as
  // `params_layout`, which must place every parameter where this generator's layout does.
  Generator(Backend& backend, const ModelSpec& spec, const Tensor& params,
            const ParamLayout& params_layout, int64_t max_positions);
  ~Generator() override;

  const ParamLayout& layout() const { return layout_; }
  // Sets every parameter from fp32 host values (converted to the compute dtype), and the
  // blocks' state kept outside the parameters (the expert bias, by checkpoint name) from
  // state(name): empty leaves it at zero. Not for weights read in place.
  void load(const std::function<std::vector<float>(const ParamInfo&)>& weights,
            const std::function<std::vector<float>(const std::string&)>& state = nullptr);

  // The blocks' state from a model's (Model::persistent_state, by name), on the device.
  void copy_state(const std::vector<std::pair<std::string, Tensor>>& state);

  // Starts a sequence with `prompt` (positions 0 .. n-1); returns the fp32 logits
  // (vocab_size) of its last position, the distribution of the next token.
  std::vector<float> prefill(const std::vector<int32_t>& prompt);
  // Appends `token` at the next position; returns the logits of the token after it.
  std::vector<float> step(int32_t token);
  int64_t position() const { return position_; }
  int64_t max_positions() const { return max_positions_; }

 private:
  // What both constructors share, once params_ is set.
  void allocate_state();
  std::vector<float> run(const int32_t* tokens, int64_t n);

  // ForwardOps
  Backend& backend() const override { return backend_; }
  const ModelSpec& spec() const override { return spec_; }
  Tensor param(int index) const override;
  void linear(const Tensor& out, const Tensor& in, int weight, int bias,
              const Tensor& residual) override;
  const Tensor& rope_table(double base) const override { return rope_.at(base); }

  Backend& backend_;
  ModelSpec spec_;
  DType dtype_;
  int64_t max_positions_;
  int64_t position_ = 0;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  ParamLayout layout_;
  bool params_in_place_ = false;
  DeviceBuffer param_buffer_, cache_buffer_, state_buffer_, block_state_buffer_;
  std::vector<std::pair<std::string, Tensor>> block_state_;  // Block::bind_state's, by name
  Tensor params_;
  std::vector<std::vector<Tensor>> caches_;  // [layer][block]: (max_positions, cache width)
  Tensor tokens_, state_a_, state_b_, final_norm_, final_rstd_, logits_, logits_f32_;
  RopeTables rope_;
  ScratchArena scratch_;
};

}  // namespace tessera
