#include "tessera/model/continuations.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "tessera/core/parallel_for.h"
#include "tessera/core/random.h"
#include "tessera/model/generator.h"

namespace tessera {

namespace {

// One continuation being decoded: which prompt and stream, and its draws on the host (top-k,
// top-p) when the device does not draw.
struct Job {
  size_t prompt = 0, index = 0;
  int32_t stream = 0;
  std::optional<Sampler> sampler;
};

// Whether a continuation that took `token` has ended; records how.
bool ends(Continuation& c, int32_t token, const ContinuationRequest& r) {
  if (r.is_end_token && r.is_end_token(token)) {
    c.end = Continuation::End::Token;
    return true;
  }
  if (r.stopped && r.stopped(c.ids)) {
    c.end = Continuation::End::Stop;
    return true;
  }
  if (static_cast<int64_t>(c.ids.size()) >= r.max_new_tokens) {
    c.end = Continuation::End::Length;
    return true;
  }
  return false;
}

}  // namespace

// Each round: free slots take the next waiting continuations (a prompt's first prefilled, the
// rest of its continuations admitted in the same round copying that slot); every busy slot
// draws its next token; the ended ones free their slots; the others step together. With no one
// waiting, the highest busy slot moves down into the lowest free one, so that a step computes
// only as many rows as there are busy slots.
std::vector<std::vector<Continuation>> continue_prompts(Generator& generator,
                                                        const std::vector<PromptContinuations>& prompts,
                                                        const ContinuationRequest& r) {
  std::vector<std::vector<Continuation>> out(prompts.size());
  std::vector<Job> waiting;
  for (size_t p = 0; p < prompts.size(); ++p) {
    out[p].resize(prompts[p].streams.size());
    for (size_t i = 0; i < prompts[p].streams.size(); ++i) waiting.push_back({p, i, prompts[p].streams[i], {}});
  }
  const SamplingOptions& sampling = r.sampling;
  const bool on_device = sampling.top_k == 0 && sampling.top_p >= 1.0;
  const int64_t V = generator.vocab_size();
  const auto slots = static_cast<size_t>(generator.max_batch());
  std::vector<std::optional<Job>> busy(slots);
  size_t next_waiting = 0;
  const auto continuation = [&](const Job& j) -> Continuation& { return out[j.prompt][j.index]; };
  const auto rows = [&] {
    size_t n = slots;
    while (n > 0 && !busy[n - 1]) --n;
    return n;
  };
  for (;;) {
    std::optional<size_t> admitted;  // this round's last admitted slot, still at its prompt's end
    for (size_t s = 0; s < slots && next_waiting < waiting.size(); ++s) {
      if (busy[s]) continue;
      Job job = std::move(waiting[next_waiting++]);
      if (admitted && busy[*admitted]->prompt == job.prompt)
        generator.copy_slot(static_cast<int64_t>(*admitted), static_cast<int64_t>(s));
      else
        generator.prefill_slot(static_cast<int64_t>(s), prompts[job.prompt].prompt);
      if (!on_device) {
        SamplingOptions o = sampling;
        o.seed = random_bits(sampling.seed, static_cast<uint64_t>(job.stream));
        job.sampler.emplace(o);
      }
      busy[s] = std::move(job);
      admitted = s;
    }
    const size_t n = rows();
    if (n == 0) break;
    std::vector<int32_t> tokens(n, -1);
    std::vector<double> logps(n), entropy(n);
    if (on_device) {
      std::vector<int32_t> streams(n, 0), steps(n, 0);
      for (size_t s = 0; s < n; ++s)
        if (busy[s]) streams[s] = busy[s]->stream, steps[s] = static_cast<int32_t>(continuation(*busy[s]).ids.size());
      const Generator::Draw d = generator.draw(streams, steps, r.vocab, sampling.temperature, sampling.min_p, sampling.seed);
      for (size_t s = 0; s < n; ++s) tokens[s] = d.tokens[s], logps[s] = d.logps[s], entropy[s] = d.entropy[s];
    } else {
      // Each slot's pass over its logits, on threads.
      const std::vector<float> logits = generator.logits(static_cast<int64_t>(n));
      parallel_for(n, [&](size_t s) {
        if (!busy[s]) return;
        const std::span<const float> l(logits.data() + static_cast<int64_t>(s) * V, static_cast<size_t>(V));
        const float top = *std::max_element(l.begin(), l.end());
        double z = 0, weighted = 0;
        for (float x : l) {
          const double e = std::exp(static_cast<double>(x - top));
          z += e;
          weighted += e * (x - top);
        }
        tokens[s] = busy[s]->sampler->next(l, r.vocab);
        logps[s] = static_cast<double>(l[static_cast<size_t>(tokens[s])] - top) - std::log(z);
        entropy[s] = std::log(z) - weighted / z;
      });
    }
    for (size_t s = 0; s < n; ++s) {
      if (!busy[s]) {
        tokens[s] = -1;
        continue;
      }
      Continuation& c = continuation(*busy[s]);
      c.ids.push_back(tokens[s]);
      c.logps.push_back(static_cast<float>(logps[s]));
      c.entropy_sum += entropy[s];
      if (ends(c, tokens[s], r)) busy[s].reset(), tokens[s] = -1;
    }
    if (next_waiting == waiting.size()) {
      // Nobody waits: move the highest busy slots down into the free ones below them.
      for (size_t low = 0, high = rows(); low + 1 < high; high = rows()) {
        while (low < high && busy[low]) ++low;
        if (low + 1 >= high) break;
        generator.copy_slot(static_cast<int64_t>(high - 1), static_cast<int64_t>(low));
        busy[low] = std::move(busy[high - 1]);
        busy[high - 1].reset();
        tokens[low] = tokens[high - 1];
        tokens[high - 1] = -1;
      }
    }
    const size_t m = rows();
    if (m == 0) continue;  // every continuation ended: the next round admits or finishes
    tokens.resize(m);
    generator.step_slots(tokens);
  }
  return out;
}

}  // namespace tessera
