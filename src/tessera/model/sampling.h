#pragma once
// Picking the next token from a model's logits: greedy (temperature 0), or sampling from the
// softmax at a temperature, restricted to the top_k most likely tokens and then to the
// smallest set whose probability reaches top_p (nucleus sampling), then to the tokens at least
// min_p times as likely as the most likely one (min-p sampling), as transformers' generate()
// applies them (temperature, then top-k, top-p, min-p).
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace tessera {

struct SamplingOptions {
  double temperature = 0;  // 0: greedy
  int64_t top_k = 0;       // 0: every token
  double top_p = 1.0;      // 1: every token
  double min_p = 0.0;      // 0: every token
  uint64_t seed = 1;
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : o_(options), rng_(options.seed) {}
  // The next token among ids [0, vocab) of `logits` (a padded vocabulary's extra rows are
  // never picked). Ties in greedy decoding go to the lowest id, as torch.argmax does.
  int32_t next(std::span<const float> logits, int64_t vocab);

 private:
  int32_t sample_unsorted(std::span<const float> logits, int64_t vocab);

  SamplingOptions o_;
  std::mt19937_64 rng_;
};

}  // namespace tessera
