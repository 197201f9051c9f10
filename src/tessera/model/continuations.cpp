#include "tessera/model/continuations.h"

#include <algorithm>
#include <cmath>

#include "tessera/core/parallel_for.h"
#include "tessera/core/random.h"
#include "tessera/model/generator.h"

namespace tessera {

namespace {

// The continuations of one fork: streams.size() <= generator.max_batch().
std::vector<Continuation> continue_together(Generator& generator,
                                            const std::vector<int32_t>& prompt,
                                            const ContinuationRequest& r,
                                            const std::vector<int32_t>& streams) {
  const size_t count = streams.size();
  std::vector<Continuation> out(count);
  std::vector<char> done(count, 0);  // written by the threads, one element each
  std::vector<int32_t> next(count);
  const int64_t V = generator.vocab_size();
  const SamplingOptions& sampling = r.sampling;
  const bool on_device = sampling.top_k == 0 && sampling.top_p >= 1.0;
  std::vector<Sampler> samplers;
  if (!on_device)
    for (int32_t s : streams) {
      SamplingOptions o = sampling;
      o.seed = random_bits(sampling.seed, static_cast<uint64_t>(s));
      samplers.emplace_back(o);
    }
  generator.prefill_on_device(prompt);
  generator.fork(static_cast<int64_t>(count));
  const auto take = [&](size_t b, int32_t token, double logp, double entropy) {
    Continuation& c = out[b];
    if (done[b]) {
      next[b] = c.ids.back();
      return;
    }
    c.entropy_sum += entropy;
    c.logps.push_back(static_cast<float>(logp));
    c.ids.push_back(token);
    next[b] = token;
    if (r.is_end_token && r.is_end_token(token)) {
      c.end = Continuation::End::Token;
      done[b] = 1;
    } else if (r.stopped && r.stopped(c.ids)) {
      c.end = Continuation::End::Stop;
      done[b] = 1;
    }
  };
  for (int64_t i = 0; i < r.max_new_tokens; ++i) {
    if (on_device) {
      const Generator::Draw d =
          generator.draw(streams, r.vocab, sampling.temperature, sampling.min_p, sampling.seed, i);
      for (size_t b = 0; b < count; ++b) take(b, d.tokens[b], d.logps[b], d.entropy[b]);
    } else {
      // Each sequence's pass over its logits, on threads.
      const std::vector<float> logits = generator.logits();
      parallel_for(count, [&](size_t b) {
        if (done[b]) return take(b, 0, 0, 0);
        const std::span<const float> l(logits.data() + static_cast<int64_t>(b) * V,
                                       static_cast<size_t>(V));
        const float top = *std::max_element(l.begin(), l.end());
        double z = 0, weighted = 0;
        for (float x : l) {
          const double e = std::exp(static_cast<double>(x - top));
          z += e;
          weighted += e * (x - top);
        }
        const int32_t token = samplers[b].next(l, r.vocab);
        take(b, token, static_cast<double>(l[static_cast<size_t>(token)] - top) - std::log(z),
             std::log(z) - weighted / z);
      });
    }
    if (std::all_of(done.begin(), done.end(), [](char d) { return d != 0; })) break;
    if (i + 1 == r.max_new_tokens) break;
    generator.step_on_device(next);
  }
  return out;
}

}  // namespace

// A generator that holds fewer sequences than there are streams (multi-latent attention
// decodes one at a time) takes them in forks of what it holds, the prompt prefilled for each.
std::vector<Continuation> continue_prompt(Generator& generator, const std::vector<int32_t>& prompt,
                                          const ContinuationRequest& r) {
  std::vector<Continuation> out;
  const size_t step = static_cast<size_t>(generator.max_batch());
  for (size_t first = 0; first < r.streams.size(); first += step) {
    const std::vector<int32_t> streams(
        r.streams.begin() + static_cast<std::ptrdiff_t>(first),
        r.streams.begin() + static_cast<std::ptrdiff_t>(std::min(first + step, r.streams.size())));
    for (Continuation& c : continue_together(generator, prompt, r, streams))
      out.push_back(std::move(c));
  }
  return out;
}

}  // namespace tessera
