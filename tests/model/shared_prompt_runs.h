#pragma once
// A DPO pair run two ways, for the CPU and GPU tests of shared prompts
// (ModelRuntime::shared_prompt_side): its sides as two sequences, and one row with the prompt
// once.
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"

namespace tessera {

// One side of the pair: `real` tokens, the prompt's `prompt` first (the same on both sides),
// padded to `side` tokens; targets only on the answer.
struct Side {
  std::vector<int32_t> tokens, targets, positions;
};

inline Side make_side(int which, int64_t prompt, int64_t real, int64_t side) {
  Side s;
  for (int64_t k = 0; k < side; ++k) {
    const bool is_real = k < real;
    s.tokens.push_back(!is_real ? 0 : static_cast<int32_t>(random_below(k < prompt ? 7 : 8 + which, k, 64)));
    s.positions.push_back(static_cast<int32_t>(is_real ? k : k - real));
  }
  for (int64_t k = 0; k < side; ++k)
    s.targets.push_back(k + 1 < real && k + 1 >= prompt ? s.tokens[k + 1] : -1);
  return s;
}

struct PairResult {
  double logps[2] = {0, 0};
  std::vector<float> grads;
};

inline std::vector<float> grads_of(Backend& backend, const Model& model) {
  std::vector<float> g(static_cast<size_t>(model.layout().total));
  backend.download(g.data(), model.grads());
  return g;
}

inline double summed(const std::vector<float>& losses, int64_t begin, int64_t end) {
  return -std::accumulate(losses.begin() + begin, losses.begin() + end, 0.0);
}

inline constexpr float kScales[2] = {0.37f, -0.21f};

// A backend and a model's weights on it: the same on every run of a comparison.
using MakeBackend = std::function<std::unique_ptr<Backend>()>;
using InitWeights = std::function<void(Backend&, const ModelSpec&, DecoderModel&)>;

// The pair's sides as two sequences (DPO's batched layout): each side's summed log-probability,
// and the gradients of the sides' token losses scaled by kScales.
inline PairResult run_apart(const MakeBackend& make, const InitWeights& init, const ModelSpec& spec,
                            ModelRuntime rt, const Side (&sides)[2]) {
  rt.pipeline_slots = 2;
  auto backend = make();
  DecoderModel model(*backend, spec, rt);
  init(*backend, spec, model);
  model.zero_grads();
  PairResult r;
  for (int side = 0; side < 2; ++side) {
    model.use_slot(side);
    model.set_batch(sides[side].tokens.data(), sides[side].targets.data(), sides[side].positions.data());
    model.zero_loss_sum();
    model.forward_loss();
    std::vector<float> losses(static_cast<size_t>(rt.tokens()));
    backend->download(losses.data(), model.token_losses());
    r.logps[side] = summed(losses, 0, rt.tokens());
  }
  for (int side = 0; side < 2; ++side) {
    model.use_slot(side);
    model.loss_backward({&kScales[side], 1}, 0.0f);
  }
  r.grads = grads_of(*backend, model);
  return r;
}

// The same pair in one row of `row` tokens with its first `prompt` rows shared.
inline PairResult run_shared(const MakeBackend& make, const InitWeights& init, const ModelSpec& spec,
                             ModelRuntime rt, const Side (&sides)[2], int64_t prompt,
                             const int64_t (&real)[2], int64_t row) {
  rt.shared_prompt_side = rt.seq_length;
  rt.seq_length = row;
  auto backend = make();
  DecoderModel model(*backend, spec, rt);
  init(*backend, spec, model);
  model.zero_grads();
  // The pair's row as PreferenceSource::sample_shared lays it out.
  const int64_t used = real[0] + real[1] - prompt;
  std::vector<int32_t> tokens(row, 0), targets(row, -1), positions(row);
  for (int64_t i = 0; i < row; ++i) {
    const int side = i < real[0] ? 0 : 1;
    const int64_t k = i < real[0] ? i : prompt + i - real[0];
    if (i < used) {
      tokens[i] = sides[side].tokens[k], targets[i] = sides[side].targets[k], positions[i] = sides[side].positions[k];
    } else {
      positions[i] = static_cast<int32_t>(i - used);
    }
  }
  const SharedPromptPair pair{static_cast<int32_t>(prompt), static_cast<int32_t>(real[0]),
                              static_cast<int32_t>(used)};
  model.set_shared_prompt_pairs({&pair, 1});
  model.set_batch(tokens.data(), targets.data(), positions.data());
  model.zero_loss_sum();
  model.forward_loss();
  std::vector<float> losses(static_cast<size_t>(row));
  backend->download(losses.data(), model.token_losses());
  PairResult r;
  r.logps[0] = summed(losses, 0, real[0]);
  r.logps[1] = summed(losses, real[0], row);
  model.loss_backward(kScales, 0.0f);
  r.grads = grads_of(*backend, model);
  return r;
}

}  // namespace tessera
