#pragma once
// Autoregressive generation with a KV cache: a model's weights on a backend, a prompt fed in
// one pass (prefill), then one token at a time, each attending to the keys and values the
// layers cached for every earlier position, so a new token costs one token's work, not the
// whole sequence's. The generator holds up to `max_batch` sequences, each in a slot of its own
// (continuous batching, model/continuations.h): a slot's row of positions in the cache of every
// layer, its position, and its last logits. A step decodes one token of each slot in one pass,
// every weight read once for the batch, each slot at its own position: a sequence that ends
// frees its slot for the next prompt while the others go on. The cache holds max_batch x
// max_positions positions per layer, one contiguous row per slot, so sequences of any lengths
// share it without fragmenting it. Sampling (model/sampling.h, or draw() on the device) picks
// each next token from the logits. The layers and blocks are the family's
// (model/decoder_layer.h), run through Block::forward_cached.
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "tessera/model/block.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/model/parallel_layers.h"
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
  // cache_region (U8 device memory, at least cache_bytes() long; undefined: none): where the
  // KV cache lives instead of memory of its own, memory another owner lends while it
  // generates (GRPO's AdamW moments, moved to the host meanwhile); every prefill and step may
  // overwrite it.
  Generator(Backend& backend, const ModelSpec& spec, const Tensor& params,
            const ParamLayout& params_layout, int64_t max_positions, int64_t max_batch = 1,
            const Tensor& cache_region = {});
  ~Generator() override;

  // Adapters beside weights read in place (LoRA's: its frozen base is the weights), added in
  // every linear they adapt (not owned; null: none). Their term runs on the adapter's own
  // scratch, which must hold the rows of a prefill and of a step.
  void use_adapters(LinearAdapters* adapters) { adapters_ = adapters; }

  // Bytes a generator allocates beside its weights (the KV cache, its states and scratch): the
  // memory planner's generation row.
  static size_t buffer_bytes(const ModelSpec& spec, DType dtype, int64_t max_positions, int64_t max_batch);
  // The KV cache's part of them.
  static size_t cache_bytes(const ModelSpec& spec, DType dtype, int64_t max_positions, int64_t max_batch);

  const ParamLayout& layout() const { return layout_; }
  // Sets every parameter from fp32 host values (converted to the compute dtype), and the
  // blocks' state kept outside the parameters (the expert bias, by checkpoint name) from
  // state(name): empty leaves it at zero. Not for weights read in place.
  void load(const std::function<std::vector<float>(const ParamInfo&)>& weights,
            const std::function<std::vector<float>(const std::string&)>& state = nullptr);

  // Random weights as training initialises them (model/init.h), for benchmarks. Not for
  // weights read in place.
  void init_random(uint64_t seed);

  // The blocks' state from a model's (Model::persistent_state, by name), on the device.
  void copy_state(const std::vector<std::pair<std::string, Tensor>>& state);
  // That state itself, by name: what a copy of a model's weights receives beside them.
  const std::vector<std::pair<std::string, Tensor>>& state() const { return block_state_; }

  // One sequence in slot 0: starts it with `prompt` (positions 0 .. n-1) and returns the fp32
  // logits (vocab_size) of its last position, the distribution of the next token.
  std::vector<float> prefill(const std::vector<int32_t>& prompt);
  // Appends `token` at slot 0's next position; returns the logits of the token after it.
  std::vector<float> step(int32_t token);

  // Starts slot `slot`'s sequence with `prompt`; its next token's logits are row `slot` of the
  // logits. The other slots are untouched.
  void prefill_slot(int64_t slot, std::span<const int32_t> prompt);
  // Slot `to` continues as a copy of slot `from`: its cached positions, position and logits
  // (a prompt prefilled once for several continuations).
  void copy_slot(int64_t from, int64_t to);
  // One token for each of the first tokens.size() slots, each at its slot's next position; a
  // negative token leaves its slot idle (a free slot below busy ones: computed, not kept, its
  // position unchanged). Each slot's next logits are its row. On a backend that captures work
  // (CUDA graphs) a step of a family that reads nothing back while decoding is captured after
  // its first run and replayed after, one launch for all its kernels: it then runs a few more
  // rows, free slots above the busy ones (1, 2, 4, 8, then multiples of 8), so that a handful
  // of captured steps serves every number of busy slots.
  void step_slots(const std::vector<int32_t>& tokens);
  // Runs every step op by op (vLLM's enforce_eager): to measure what capture gains.
  void set_eager(bool eager) { eager_ = eager; }
  // Whether steps are captured (on a backend that captures, for a family that allows it, not
  // eager).
  bool captures_steps() const { return captures_steps_ && !eager_; }
  // The rows a step of `busy` slots runs.
  int64_t step_rows(int64_t busy) const;
  // The first `rows` slots' logits on the host, fp32: each slot's next-token distribution,
  // slot after slot (rows x vocab_size).
  std::vector<float> logits(int64_t rows);
  // Each of the first streams.size() slots' next token drawn on the device from its logits
  // (Backend::sample_tokens: temperature with min-p, greedy at temperature 0, over ids below
  // vocab), with its log-probability and its distribution's entropy (at temperature 1).
  // streams[b] names slot b's random stream, steps[b] the token's index in it.
  struct Draw {
    std::vector<int32_t> tokens;
    std::vector<float> logps, entropy;
  };
  Draw draw(const std::vector<int32_t>& streams, const std::vector<int32_t>& steps, int64_t vocab,
            double temperature, double min_p, uint64_t seed);
  // The position slot `slot`'s next token takes (its sequence's length so far).
  int64_t position(int64_t slot = 0) const { return positions_[static_cast<size_t>(slot)]; }
  // The width of each sequence's logits (the model's padded vocabulary).
  int64_t vocab_size() const { return spec_.vocab_size; }
  // The sequences it holds at once.
  int64_t max_batch() const { return max_batch_; }
  int64_t max_positions() const { return max_positions_; }

 private:
  // What both constructors share, once params_ is set.
  void allocate_state(const Tensor& cache_region = {});
  // Its buffers' bytes, by buffer (buffer_bytes and allocate_state).
  struct Sizes {
    size_t cache = 0;
    std::array<size_t, 9> state{};
    size_t table = 0, rows = 0, tables = 0;  // a rotary table, its rows at a step's positions
    size_t block_state_floats = 0;
    size_t scratch = 0;
    size_t bytes() const;
  };
  static Sizes sizes(const ModelSpec& spec, const std::vector<std::unique_ptr<DecoderLayer>>& layers, DType dtype,
                     int64_t max_positions, int64_t max_batch);
  // The layers over n tokens in state_a_ whose embeddings are in x, then the final norm and head
  // over the `last` rows from `from` into the logits' rows from `to`.
  void run_layers(Tensor x, Tensor y, const std::function<std::vector<Tensor>(size_t)>& caches,
                  const CachePosition& at, int64_t from, int64_t last, int64_t to);
  // n token ids checked against the vocabulary and uploaded from `tokens` into tokens_ (with
  // the `more` int32s after them).
  void upload_ids(const int32_t* tokens, int64_t n, int64_t more = 0);
  // The first n ids of tokens_ embedded into state_a_'s first n rows.
  Tensor embed(int64_t n);
  // Each block's cache rows from slot `first`: `count` slots (count, S, width) for a batch, or
  // with count 0 the one slot (S, width) of a one-sequence pass.
  std::vector<Tensor> caches_of(size_t layer, int64_t first, int64_t count) const;

  // ForwardOps
  Backend& backend() const override { return backend_; }
  const ModelSpec& spec() const override { return spec_; }
  Tensor param(int index) const override;
  void linear(const Tensor& out, const LinearOperand& in, int weight, int bias,
              const Tensor& residual) override;
  const Tensor& rope_table(double base) const override { return rope_.at(base); }

  Backend& backend_;
  ModelSpec spec_;
  DType dtype_;
  int64_t max_positions_, max_batch_;
  std::vector<int64_t> positions_;  // each slot's next position
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  ParamLayout layout_;
  bool params_in_place_ = false;
  LinearAdapters* adapters_ = nullptr;
  DeviceBuffer param_buffer_, cache_buffer_, state_buffer_, block_state_buffer_;
  std::vector<std::pair<std::string, Tensor>> block_state_;  // Block::bind_state's, by name
  Tensor params_;
  std::vector<std::vector<Tensor>> caches_;  // [layer][block]: (max_batch, max_positions, cache width)
  // tokens_: a prompt's ids, or a step's ids then its slots' positions (one upload).
  Tensor tokens_, state_a_, state_b_, final_norm_, final_rstd_, logits_, logits_f32_;
  // draw()'s: the streams then the steps (2 x max_batch) int32, and its tokens,
  // log-probabilities and entropies side by side (3 x max_batch; the tokens int32 in fp32's
  // place).
  Tensor draw_streams_, draw_out_;
  RopeTables rope_;
  // A step's rotary rows (max_batch, head_dim) per base: rope_'s rows at the slots' positions.
  RopeTables step_rope_;
  // Steps captured by their rows (CUDA graphs), after a first run of each op by op.
  bool captures_steps_ = false, eager_ = false;  // captures_steps_: where it can
  std::map<int64_t, std::unique_ptr<CapturedWork>> captured_steps_;
  std::set<int64_t> steps_run_;
  ScratchArena scratch_;
};

}  // namespace tessera
