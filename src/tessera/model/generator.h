#pragma once
// Autoregressive generation with a KV cache: a model's weights on a backend, a prompt fed in
// one pass (prefill), then one token at a time, each attending to the keys and values the
// layers cached for every earlier position, so a new token costs one token's work, not the
// whole sequence's. A prompt may fork into up to `max_batch` sequences that continue it
// together (GRPO's group of completions of one prompt, or several samples): the prompt's cache
// is copied to each, and each step decodes one token of every sequence in one pass, every
// weight read once for the batch. The cache holds max_batch x max_positions positions per
// layer, one contiguous row of positions per sequence: all sequences of a batch are at the
// same position, so none fragments it. Sampling (model/sampling.h) picks each next token from
// the logits. The layers and blocks are the family's (model/decoder_layer.h), run through
// Block::forward_cached.
#include <array>
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
  Generator(Backend& backend, const ModelSpec& spec, DType compute_dtype, int64_t max_positions,
            int64_t max_batch = 1);
  // Generation from weights that live elsewhere, read in place (a training model's: GRPO
  // samples from the policy it trains, with no copy): `params`, compute dtype, laid out as
  // `params_layout`, which must place every parameter where this generator's layout does.
  Generator(Backend& backend, const ModelSpec& spec, const Tensor& params,
            const ParamLayout& params_layout, int64_t max_positions, int64_t max_batch = 1);
  ~Generator() override;

  // Bytes a generator allocates beside its weights (the KV cache, its states and scratch): the
  // memory planner's generation row.
  static size_t buffer_bytes(const ModelSpec& spec, DType dtype, int64_t max_positions, int64_t max_batch);

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
  // Whether the family's blocks decode batches (multi-latent attention does not yet): else
  // max_batch is 1.
  bool decodes_batches() const { return decodes_batches(layers_); }
  // After prefill: the prompt continues as `count` sequences (count <= max_batch), each with
  // the prompt's cache and its last logits (what draw() draws their first tokens from).
  void fork(int64_t count);
  // One token for each of the fork's sequences (tokens.size() == count), all at position();
  // returns their next tokens' logits, sequence after sequence (count x vocab_size).
  std::vector<float> step(const std::vector<int32_t>& tokens);
  // As prefill and step, leaving the logits on the device for draw() rather than returning
  // them (a vocabulary of logits per sequence and token need not cross to the host).
  void prefill_on_device(const std::vector<int32_t>& prompt);
  void step_on_device(const std::vector<int32_t>& tokens);
  // The last pass's logits on the host, fp32: each sequence's next-token distribution,
  // sequence after sequence (batch() x vocab_size).
  std::vector<float> logits();
  // Each sequence's next token drawn on the device from the last pass's logits
  // (Backend::sample_tokens: temperature with min-p, greedy at temperature 0, over ids below
  // vocab), with its log-probability and its distribution's entropy (at temperature 1).
  // streams[b] names sequence b's random stream, step the token's index in it.
  struct Draw {
    std::vector<int32_t> tokens;
    std::vector<float> logps, entropy;
  };
  Draw draw(const std::vector<int32_t>& streams, int64_t vocab, double temperature, double min_p, uint64_t seed,
            int64_t step);
  int64_t position() const { return position_; }
  // The width of each sequence's logits (the model's padded vocabulary).
  int64_t vocab_size() const { return spec_.vocab_size; }
  int64_t batch() const { return batch_; }
  // The sequences a fork may hold (1 for a family that does not decode batches).
  int64_t max_batch() const { return max_batch_; }
  int64_t max_positions() const { return max_positions_; }

 private:
  // What both constructors share, once params_ is set.
  void allocate_state();
  // Its buffers' bytes, by buffer (buffer_bytes and allocate_state).
  struct Sizes {
    size_t cache = 0;
    std::array<size_t, 9> state{};
    size_t table = 0, tables = 0;
    size_t block_state_floats = 0;
    size_t scratch = 0;
    size_t bytes() const;
  };
  static Sizes sizes(const ModelSpec& spec, const std::vector<std::unique_ptr<DecoderLayer>>& layers, DType dtype,
                     int64_t max_positions, int64_t max_batch);
  // n tokens: a prompt or one token of the sequence (batch_ 1), or one token of each of the
  // batch_ sequences; the logits of the last position of each sequence, in logits_.
  void run(const int32_t* tokens, int64_t n);
  static bool decodes_batches(const std::vector<std::unique_ptr<DecoderLayer>>& layers);
  // Each block's cache as the first `sequences` sequences' (the one-sequence layout for 1).
  std::vector<Tensor> caches_of(size_t layer, int64_t sequences) const;

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
  int64_t max_positions_, max_batch_;
  int64_t position_ = 0, batch_ = 1;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  ParamLayout layout_;
  bool params_in_place_ = false;
  DeviceBuffer param_buffer_, cache_buffer_, state_buffer_, block_state_buffer_;
  std::vector<std::pair<std::string, Tensor>> block_state_;  // Block::bind_state's, by name
  Tensor params_;
  std::vector<std::vector<Tensor>> caches_;  // [layer][block]: (max_batch, max_positions, cache width)
  Tensor tokens_, state_a_, state_b_, final_norm_, final_rstd_, logits_, logits_f32_;
  // draw()'s: the streams (max_batch) int32, and its tokens, log-probabilities and entropies
  // side by side (3 x max_batch; the tokens int32 in fp32's place); the streams last uploaded.
  Tensor draw_streams_, draw_out_;
  std::vector<int32_t> uploaded_streams_;
  RopeTables rope_;
  ScratchArena scratch_;
};

}  // namespace tessera
