#include "tessera/distributed/pipeline_schedule.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
namespace {

using Kind = PipelinePass::Kind;

// Megatron's order of the passes of one rank (schedules.py): 1F1B runs P - s - 1 warm-up
// forwards, then alternates one forward and one backward, then the remaining backwards.
// Interleaved, the same over the rank's virtual micro-batches k = 0 .. M x V - 1, which take
// chunks in groups of P micro-batches (forwards chunk 0, 1, ..., backwards the other way).
std::vector<PipelinePass> megatron_order(int pp, int v, int64_t M, int s) {
  const int64_t total = M * v;
  auto pass = [&](int64_t k, bool forward) {
    const int64_t in_group = k % (int64_t{pp} * v);
    int chunk = static_cast<int>(in_group / pp);
    if (!forward) chunk = v - 1 - chunk;
    const int64_t m = (k / (int64_t{pp} * v)) * pp + k % pp;
    return PipelinePass{forward ? Kind::Forward : Kind::Backward, chunk, m};
  };
  int64_t warmup;
  if (v == 1)
    warmup = std::min<int64_t>(pp - s - 1, M);
  else if (M == pp)
    warmup = total;  // Megatron: all forwards first when there is one group
  else
    warmup = std::min<int64_t>(int64_t{pp - s - 1} * 2 + int64_t{v - 1} * pp, total);
  std::vector<PipelinePass> order;
  // With one chunk the k-th pass is micro-batch k of chunk 0 (pass() maps it so too).
  for (int64_t k = 0; k < warmup; ++k) order.push_back(pass(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(pass(warmup + k, true));
    order.push_back(pass(k, false));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(pass(k, false));
  return order;
}

// Evaluation: every micro-batch through the rank's chunks in order.
std::vector<PipelinePass> forward_order(int v, int64_t M) {
  std::vector<PipelinePass> order;
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < v; ++c) order.push_back({Kind::Forward, c, m});
  return order;
}

}  // namespace

std::string PipelinePass::str() const {
  return fmt::format("{}{}.{}", kind == Kind::Forward ? "F" : "B", chunk, micro_batch);
}

std::vector<LayerRange> pipeline_layers(int64_t num_layers, int pp, int chunks,
                                        int64_t first_stage_layers, int64_t last_stage_layers,
                                        int rank) {
  TS_CHECK(pp >= 1 && chunks >= 1 && rank >= 0 && rank < pp, "pipeline rank {} of {}, {} chunks",
           rank, pp, chunks);
  if (chunks > 1 || (first_stage_layers == 0 && last_stage_layers == 0)) {
    const int64_t stages = int64_t{pp} * chunks;
    TS_CHECK(num_layers % stages == 0, "{} layers over {} virtual pipeline stages", num_layers,
             stages);
    const int64_t per = num_layers / stages;
    std::vector<LayerRange> out;
    for (int c = 0; c < chunks; ++c) out.push_back({(int64_t{c} * pp + rank) * per, per});
    return out;
  }
  // Uneven: the first and last stages as set, the others an equal share of the rest.
  const int64_t first = first_stage_layers, last = last_stage_layers;
  const int middle = pp - (first > 0) - (last > 0);
  const int64_t rest = num_layers - first - last;
  TS_CHECK(middle == 0 ? rest == 0 : rest > 0 && rest % middle == 0,
           "{} layers with {} on the first and {} on the last of {} stages", num_layers, first,
           last, pp);
  const int64_t per = middle > 0 ? rest / middle : 0;
  if (rank == 0 && first > 0) return {{0, first}};
  if (rank == pp - 1 && last > 0) return {{num_layers - last, last}};
  const int64_t index = rank - (first > 0 ? 1 : 0);
  return {{first + index * per, per}};
}

PipelineSchedule::PipelineSchedule(int pp, int chunks, int64_t micro_batches, bool with_backward)
    : pp_(pp), chunks_(chunks), micro_batches_(micro_batches) {
  TS_CHECK(pp >= 2 && chunks >= 1 && micro_batches >= 1,
           "a pipeline of {} stages, {} chunks, {} "
           "micro-batches",
           pp, chunks, micro_batches);
  TS_CHECK(!with_backward || chunks == 1 || micro_batches % pp == 0,
           "interleaved pipeline: {} micro-batches are not a multiple of {} stages", micro_batches,
           pp);
  const int last_stage = pp * chunks - 1;
  for (int s = 0; s < pp; ++s)
    order_.push_back(with_backward ? megatron_order(pp, chunks, micro_batches, s)
                                   : forward_order(chunks, micro_batches));

  // Place every rank's passes in steps, in its order, each after the step that produced its
  // input (which reaches it in that step's batch). done[s] maps a pass to its step.
  using Key = std::tuple<Kind, int, int64_t>;
  std::vector<std::map<Key, int64_t>> done(pp);
  std::vector<size_t> next(pp, 0);
  struct Placed {
    int rank;
    PipelinePass pass;
  };
  std::vector<std::vector<Placed>> by_step;
  // The pass whose output a pass needs from another rank, if any: a forward needs the previous
  // virtual stage's forward, a backward the next one's backward (the last virtual stage's
  // backward follows its own forward on the same rank, which the order keeps).
  auto producer = [&](int s, const PipelinePass& p) -> std::optional<std::pair<int, Key>> {
    const int vs = p.chunk * pp + s;
    if (p.kind == Kind::Forward) {
      if (vs == 0) return std::nullopt;
      const int prev = vs - 1;
      return std::pair{prev % pp, Key{Kind::Forward, prev / pp, p.micro_batch}};
    }
    if (vs == last_stage) return std::nullopt;
    const int following = vs + 1;
    return std::pair{following % pp, Key{Kind::Backward, following / pp, p.micro_batch}};
  };
  size_t remaining = 0;
  for (const auto& o : order_) remaining += o.size();
  for (int64_t t = 0; remaining > 0; ++t) {
    by_step.emplace_back();
    for (int s = 0; s < pp; ++s) {
      if (next[s] == order_[s].size()) continue;
      const PipelinePass& p = order_[s][next[s]];
      if (const auto from = producer(s, p)) {
        const auto it = done[from->first].find(from->second);
        if (it == done[from->first].end() || it->second >= t) continue;
      }
      by_step.back().push_back({s, p});
      done[s][{p.kind, p.chunk, p.micro_batch}] = t;
      ++next[s];
      --remaining;
    }
    TS_CHECK(!by_step.back().empty(), "pipeline schedule stalls at step {}", t);
  }

  // Steps with their transfers: a pass's output goes to the rank of the virtual stage after it
  // (a forward's activation) or before it (a backward's input gradient). An activation moves
  // in the step before the pass that reads it, so that the receiver holds it no longer than
  // needed (the sender keeps it until its backward anyway); a gradient moves at once, which
  // frees the sender's slot (the receiver holds the micro-batch until its backward anyway).
  const int64_t steps = static_cast<int64_t>(by_step.size());
  steps_.assign(pp, std::vector<PipelineStep>(steps));
  // Per rank and micro-batch, the first and last moment it holds data of it: step t's pass is
  // at 3t, its sends at 3t + 1, its receives at 3t + 2. A micro-batch whose last use is a send
  // may pass its slot to one whose first is a receive in the same batch: what is sent (an
  // output or an input gradient) and what is received (an input, an output gradient) are
  // different tensors of the slot.
  std::vector<std::map<int64_t, std::pair<int64_t, int64_t>>> held(pp);
  auto hold = [&](int s, int64_t m, int64_t moment) {
    auto [it, fresh] = held[s].try_emplace(m, moment, moment);
    if (!fresh) {
      it->second.first = std::min(it->second.first, moment);
      it->second.second = std::max(it->second.second, moment);
    }
  };
  for (int64_t t = 0; t < steps; ++t) {
    for (const Placed& placed : by_step[t]) {
      const int s = placed.rank;
      const PipelinePass& p = placed.pass;
      steps_[s][t].pass = p;
      hold(s, p.micro_batch, 3 * t);
      const int vs = p.chunk * pp + s;
      const bool forward = p.kind == Kind::Forward;
      if ((forward && vs == last_stage) || (!forward && vs == 0)) continue;
      const int to = forward ? vs + 1 : vs - 1;
      const int peer = to % pp;
      const int64_t at = forward ? done[peer].at({Kind::Forward, to / pp, p.micro_batch}) - 1 : t;
      steps_[s][at].transfers.push_back({true, peer, !forward, p.chunk, p.micro_batch});
      steps_[peer][at].transfers.push_back({false, s, !forward, to / pp, p.micro_batch});
      hold(s, p.micro_batch, 3 * at + 1);
      hold(peer, p.micro_batch, 3 * at + 2);
    }
  }

  // Slots: micro-batches in order of their first moment, each into a slot whose holder's last
  // moment is past (interval colouring, optimal in this order).
  slot_.assign(pp, std::vector<int>(micro_batches, -1));
  slots_.assign(pp, 0);
  for (int s = 0; s < pp; ++s) {
    std::vector<std::pair<int64_t, int64_t>> by_start;  // (first moment, micro-batch)
    for (const auto& [m, span] : held[s]) by_start.push_back({span.first, m});
    std::sort(by_start.begin(), by_start.end());
    std::vector<int64_t> busy_until;  // per slot
    for (const auto& [start, m] : by_start) {
      size_t free = 0;
      while (free < busy_until.size() && busy_until[free] >= start) ++free;
      if (free == busy_until.size()) busy_until.push_back(0);
      busy_until[free] = held[s][m].second;
      slot_[s][m] = static_cast<int>(free);
    }
    slots_[s] = std::max<int>(1, static_cast<int>(busy_until.size()));
  }
}

}  // namespace tessera::dist
