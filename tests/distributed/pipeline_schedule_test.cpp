// The pipeline's plan: Megatron's layer assignment and pass order (1F1B and interleaved 1F1B,
// as megatron/core/pipeline_parallel/schedules.py orders them), transfers that pair up within
// one step on both ranks, inputs that arrive before the pass that reads them, and the
// activation slots each stage holds (1F1B: P - s on stage s).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tessera/distributed/pipeline_schedule.h"

namespace tessera::dist {
namespace {

std::string order_text(const PipelineSchedule& s, int rank) {
  std::string out;
  for (const PipelinePass& p : s.order(rank)) out += (out.empty() ? "" : " ") + p.str();
  return out;
}

std::vector<std::pair<int64_t, int64_t>> ranges(const std::vector<LayerRange>& r) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const LayerRange& x : r) out.push_back({x.first, x.end()});
  return out;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

TEST(PipelineLayers, MegatronsAssignment) {
  // Even: 8 layers over 4 stages.
  EXPECT_EQ(ranges(pipeline_layers(8, 4, 1, 0, 0, 2)), (Ranges{{4, 6}}));
  // Interleaved: chunk c of rank s is virtual stage c x P + s.
  EXPECT_EQ(ranges(pipeline_layers(8, 2, 2, 0, 0, 0)), (Ranges{{0, 2}, {4, 6}}));
  EXPECT_EQ(ranges(pipeline_layers(8, 2, 2, 0, 0, 1)), (Ranges{{2, 4}, {6, 8}}));
  EXPECT_EQ(ranges(pipeline_layers(16, 4, 4, 0, 0, 3)),
            (Ranges{{3, 4}, {7, 8}, {11, 12}, {15, 16}}));
  // Uneven: the first and last stages as set, the rest evenly.
  EXPECT_EQ(ranges(pipeline_layers(10, 4, 1, 1, 3, 0)), (Ranges{{0, 1}}));
  EXPECT_EQ(ranges(pipeline_layers(10, 4, 1, 1, 3, 1)), (Ranges{{1, 4}}));
  EXPECT_EQ(ranges(pipeline_layers(10, 4, 1, 1, 3, 2)), (Ranges{{4, 7}}));
  EXPECT_EQ(ranges(pipeline_layers(10, 4, 1, 1, 3, 3)), (Ranges{{7, 10}}));
  EXPECT_EQ(ranges(pipeline_layers(7, 3, 1, 0, 1, 1)), (Ranges{{3, 6}}));
}

TEST(PipelineSchedule, OneFOneBOrder) {
  const PipelineSchedule s(4, 1, 6, true);
  EXPECT_EQ(order_text(s, 0), "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5");
  EXPECT_EQ(order_text(s, 2), "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 F0.4 B0.3 F0.5 B0.4 B0.5");
  EXPECT_EQ(order_text(s, 3), "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 F0.4 B0.4 F0.5 B0.5");
  // Fewer micro-batches than stages: all forwards, then all backwards.
  EXPECT_EQ(order_text(PipelineSchedule(4, 1, 2, true), 0), "F0.0 F0.1 B0.0 B0.1");
}

TEST(PipelineSchedule, InterleavedOrder) {
  // P 2, V 2, M 4. Rank 0 warms up with (P - 0 - 1) x 2 + (V - 1) x P = 4 forwards; chunks
  // take groups of P micro-batches, backwards from the last chunk.
  const PipelineSchedule s(2, 2, 4, true);
  EXPECT_EQ(order_text(s, 0),
            "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3");
  EXPECT_EQ(order_text(s, 1),
            "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
  // As many micro-batches as stages: Megatron runs every forward first.
  EXPECT_EQ(order_text(PipelineSchedule(2, 2, 2, true), 1),
            "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1");
}

// Every send pairs with a receive in the same step on its peer, and every pass's input (an
// activation from the previous virtual stage, a gradient from the next) has arrived in an
// earlier step; every pass of the order runs exactly once.
void expect_consistent(const PipelineSchedule& s, bool with_backward) {
  const int pp = s.pipeline_size(), last = pp * s.chunks() - 1;
  const size_t steps = s.steps(0).size();
  // (rank, gradient, chunk, micro-batch) -> step it arrived in.
  std::map<std::tuple<int, bool, int, int64_t>, size_t> arrived;
  for (size_t t = 0; t < steps; ++t) {
    for (int r = 0; r < pp; ++r) {
      ASSERT_EQ(s.steps(r).size(), steps);
      const PipelineStep& step = s.steps(r)[t];
      if (step.pass) {
        const PipelinePass& p = *step.pass;
        const int vs = p.chunk * pp + r;
        const bool forward = p.kind == PipelinePass::Kind::Forward;
        if ((forward && vs > 0) || (!forward && vs < last)) {
          const auto it = arrived.find({r, !forward, p.chunk, p.micro_batch});
          ASSERT_NE(it, arrived.end()) << p.str() << " on rank " << r << " before its input";
          EXPECT_LT(it->second, t) << p.str() << " on rank " << r;
        }
      }
      for (const PipelineTransfer& x : step.transfers) {
        if (!x.send) {
          arrived[{r, x.gradient, x.chunk, x.micro_batch}] = t;
          continue;
        }
        // The peer receives the same micro-batch's data from this rank in this step.
        int matches = 0;
        for (const PipelineTransfer& y : s.steps(x.peer)[t].transfers)
          matches +=
              !y.send && y.peer == r && y.gradient == x.gradient && y.micro_batch == x.micro_batch;
        EXPECT_EQ(matches, 1) << "rank " << r << " step " << t;
      }
    }
  }
  for (int r = 0; r < pp; ++r) {
    std::vector<std::string> ran, ordered;
    for (const PipelineStep& step : s.steps(r))
      if (step.pass) ran.push_back(step.pass->str());
    for (const PipelinePass& p : s.order(r)) ordered.push_back(p.str());
    EXPECT_EQ(ran, ordered) << "rank " << r;
    EXPECT_EQ(ordered.size(),
              static_cast<size_t>(s.micro_batches() * s.chunks() * (with_backward ? 2 : 1)));
  }
}

TEST(PipelineSchedule, TransfersPairUpAndInputsArriveFirst) {
  for (const auto& [pp, v, m] : std::vector<std::tuple<int, int, int64_t>>{{2, 1, 1},
                                                                           {2, 1, 5},
                                                                           {4, 1, 8},
                                                                           {4, 1, 3},
                                                                           {2, 2, 4},
                                                                           {4, 2, 8},
                                                                           {3, 3, 6},
                                                                           {4, 2, 4}}) {
    SCOPED_TRACE(testing::Message() << "P " << pp << " V " << v << " M " << m);
    expect_consistent(PipelineSchedule(pp, v, m, true), true);
    expect_consistent(PipelineSchedule(pp, v, m, false), false);
  }
}

TEST(PipelineSchedule, SlotsAreTheStagesInFlightMicroBatches) {
  // 1F1B: stage s holds P - s micro-batches (its warm-up forwards and one more).
  const PipelineSchedule s(4, 1, 8, true);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(s.slots(r), 4 - r) << "stage " << r;
  // Micro-batches that share a slot are never held at once: slot(m) = m mod (P - s) here.
  for (int64_t m = 0; m < 8; ++m) EXPECT_EQ(s.slot(1, m), m % 3) << m;
  // Evaluation passes each micro-batch through in order: one slot each.
  const PipelineSchedule e(4, 1, 8, false);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(e.slots(r), 1);
}

}  // namespace
}  // namespace tessera::dist
