// DPO pairs with their prompt once (ModelRuntime::shared_prompt_side): one row of the prompt
// and both answers gives each answer's log-probability and the gradients of the pair's loss
// as the two sides run apart do, with and without document masks, the head on every row or
// on the loss rows.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "common/model_step.h"
#include "model/shared_prompt_runs.h"
#include "model/tiny_decoder.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/shared_prompt.h"

namespace tessera {
namespace {

TEST(SharedPromptRows, MapEachSideAsTwoSequences) {
  // Rows of 10: prompt [0, 3), chosen [3, 6), rejected [6, 8), padding [8, 10); sides of 7.
  const SharedPromptPair pair{3, 6, 8};
  const SharedPromptRows r = shared_prompt_rows({&pair, 1}, 10, 7);
  EXPECT_EQ(r.source, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 6, 7, 0, 0}));
  EXPECT_EQ(r.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(r.home_model, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(r.home_attention, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 10, 11}));
  // The prompt's copies: attention rows 0-2 (its home, model rows 0-2) and 7-9.
  EXPECT_EQ(r.prompts, (std::vector<SharedPromptRows::PromptCopies>{{0, 7, 3}}));
  EXPECT_EQ(r.padding, (std::vector<std::pair<int64_t, int64_t>>{{8, 10}}));
  EXPECT_EQ(r.sequence_rows, (std::vector<int64_t>{0, 6, 10}));
  const SharedPromptPair too_long{3, 6, 11};
  EXPECT_THROW(shared_prompt_rows({&too_long, 1}, 10, 7), InternalError);
}

TEST(Model, SharedPromptPairEqualsItsSidesApart) {
  const ModelSpec spec = tiny_decoder_spec(2);
  const int64_t side = 16, prompt = 6, real[2] = {13, 11};
  const Side sides[2] = {make_side(0, prompt, real[0], side), make_side(1, prompt, real[1], side)};
  for (const bool masks : {false, true})
    for (const bool head_on_loss_rows : {false, true}) {
      ModelRuntime rt;
      rt.micro_batch = 1;
      rt.seq_length = side;
      rt.reset_position_ids = true;
      rt.reset_attention_mask = masks;
      rt.keep_logit_grads = true;
      rt.head_on_loss_rows = head_on_loss_rows;
      const auto make = [] { return make_cpu_backend(); };
      const PairResult apart = run_apart(make, testing::init_test_model, spec, rt, sides);
      // The shared prompt's last row predicts both answers' first tokens: each side keeps its own.
      const PairResult shared = run_shared(make, testing::init_test_model, spec, rt, sides, prompt - 1, real, 24);
      for (int s = 0; s < 2; ++s)
        EXPECT_NEAR(shared.logps[s], apart.logps[s], 1e-5 * std::abs(apart.logps[s]))
            << "side " << s << ", masks " << masks << ", head on loss rows " << head_on_loss_rows;
      EXPECT_LT(relative_difference(shared.grads, apart.grads), 1e-5)
          << "masks " << masks << ", head on loss rows " << head_on_loss_rows;
    }
}

}  // namespace
}  // namespace tessera
