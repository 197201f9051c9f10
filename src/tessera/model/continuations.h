#pragma once
// Continuations of prompts decoded with continuous batching (Generator's slots): the engine
// behind GRPO's groups of completions, its held-out evaluation and `tessera generate`. Each
// continuation takes a slot; the continuations of one prompt share its prefill (the first slot's
// copied to the others); a continuation that ends frees its slot, which the next waiting
// continuation takes at once while the others go on decoding. Each continuation draws from its
// own random stream of the seed, token by token, so it does not depend on what is decoded
// beside it, nor on the number of slots. A continuation ends after an end token, after the
// token that completes a stop string, or at max_new_tokens. Temperature and min-p draw on the
// device (Generator::draw), so only the tokens reach the host; top-k and top-p sort each
// vocabulary of logits on the host, on threads (Sampler).
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tessera/model/sampling.h"

namespace tessera {

class Generator;

struct Continuation {
  enum class End { Token, Stop, Length };
  std::vector<int32_t> ids;  // with the end token or the stop string's last token
  // Each id's log-probability under the model's own distribution (temperature 1, every
  // column of the vocabulary), as a training forward pass computes it.
  std::vector<float> logps;
  double entropy_sum = 0;  // of the model's own next-token distribution (temperature 1)
  End end = End::Length;
};

// A prompt and its continuations' random streams (of the request's seed), one per continuation.
struct PromptContinuations {
  std::span<const int32_t> prompt;
  std::vector<int32_t> streams;
};

struct ContinuationRequest {
  SamplingOptions sampling;  // its seed is the run's, whose streams each prompt names
  int64_t max_new_tokens = 1;
  int64_t vocab = 0;  // ids drawn are below it
  std::function<bool(int32_t)> is_end_token;
  // Whether a continuation's ids, checked after each token, now end at a stop string; null:
  // none.
  std::function<bool(std::span<const int32_t>)> stopped;
};

// Every prompt's continuations, [prompt][stream], decoded in the generator's slots; the
// generator must have room for each prompt plus max_new_tokens positions. Prompts are taken in
// order, as slots free up.
std::vector<std::vector<Continuation>> continue_prompts(Generator& generator,
                                                        const std::vector<PromptContinuations>& prompts,
                                                        const ContinuationRequest& request);

}  // namespace tessera
