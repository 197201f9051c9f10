#pragma once
// Continuations of one prompt decoded together (Generator::fork): the engine behind GRPO's
// groups of completions and `tessera generate --num_samples`. Each continuation draws from its
// own random stream of the seed, so a continuation does not depend on how many are decoded
// beside it. A continuation ends after an end token, after the token that completes a stop
// string, or at max_new_tokens; a finished one takes its last token again, outside its ids,
// until every one has finished. Temperature and min-p draw on the device (Generator::draw), so
// only the tokens reach the host; top-k and top-p sort each vocabulary of logits on the host,
// on threads (Sampler).
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

struct ContinuationRequest {
  SamplingOptions sampling;      // its seed is the run's, whose streams are below
  std::vector<int32_t> streams;  // one per continuation: its random stream of the seed
  int64_t max_new_tokens = 1;
  int64_t vocab = 0;  // ids drawn are below it
  std::function<bool(int32_t)> is_end_token;
  // Whether a continuation's ids, checked after each token, now end at a stop string; null:
  // none.
  std::function<bool(std::span<const int32_t>)> stopped;
};

// One continuation per stream of `prompt`; the generator must have room for the prompt plus
// max_new_tokens positions. Streams beyond the sequences it holds (Generator::max_batch) are
// decoded in further forks, each after its own prefill of the prompt.
std::vector<Continuation> continue_prompt(Generator& generator, const std::vector<int32_t>& prompt,
                                          const ContinuationRequest& request);

}  // namespace tessera
