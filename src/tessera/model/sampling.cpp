#include "tessera/model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessera/core/error.h"

namespace tessera {

int32_t Sampler::next(std::span<const float> logits, int64_t vocab) {
  TS_CHECK(vocab > 0 && vocab <= static_cast<int64_t>(logits.size()), "sampling {} of {} logits",
           vocab, logits.size());
  if (o_.temperature <= 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + vocab) -
                                logits.begin());
  }
  if (o_.top_k == 0 && o_.top_p >= 1.0) return sample_unsorted(logits, vocab);
  // Candidates by decreasing logit (ties by id), cut to top_k.
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  const size_t keep = o_.top_k > 0 ? std::min<size_t>(o_.top_k, ids.size()) : ids.size();
  const auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  ids.resize(keep);
  // Softmax of logit / temperature over the candidates, in double.
  std::vector<double> p(keep);
  const double top = logits[ids[0]] / o_.temperature;
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += p[i] = std::exp(logits[ids[i]] / o_.temperature - top);
  // The nucleus: the most likely tokens until their probability reaches top_p (at least one).
  size_t n = keep;
  if (o_.top_p < 1.0) {
    double mass = 0;
    for (n = 0; n < keep;) {
      mass += p[n++] / sum;
      if (mass >= o_.top_p) break;
    }
  }
  // Min-p: what is left at least min_p times as likely as the top token (p[0], the largest).
  if (o_.min_p > 0)
    while (n > 1 && p[n - 1] < o_.min_p * p[0]) --n;
  std::discrete_distribution<size_t> pick(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(n));
  return ids[pick(rng_)];
}

// Without top-k or top-p the candidates need no order: one pass over the ids (a sort of a
// 128k vocabulary costs more than a small model's decoding step). Min-p only needs the top.
int32_t Sampler::sample_unsorted(std::span<const float> logits, int64_t vocab) {
  const double top = *std::max_element(logits.begin(), logits.begin() + vocab) / o_.temperature;
  std::vector<double> p(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    const double q = std::exp(logits[static_cast<size_t>(i)] / o_.temperature - top);
    p[static_cast<size_t>(i)] = q < o_.min_p ? 0.0 : q;  // the top token's q is 1
  }
  std::discrete_distribution<size_t> pick(p.begin(), p.end());
  return static_cast<int32_t>(pick(rng_));
}

}  // namespace tessera
