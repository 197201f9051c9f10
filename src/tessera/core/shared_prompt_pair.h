#pragma once
// A DPO pair laid out with its prompt once, as the data writes it (data/preference_dataset.h)
// and the model reads it (model/shared_prompt.h).
#include <cstdint>

namespace tessera {

// One DPO pair in its micro-batch row (ModelRuntime::shared_prompt_side): rows [0, prompt)
// hold the prompt both answers share, whose targets do not count; [prompt, chosen_end) the
// rest of the chosen side (positions prompt, prompt + 1, ...); [chosen_end, rejected_end) the
// rest of the rejected side (positions prompt, ...); the rest padding. Attention sees the
// chosen side as rows [0, chosen_end) and the rejected one as the prompt's rows followed by
// its own, each a sequence of shared_prompt_side tokens padded at its end.
struct SharedPromptPair {
  int32_t prompt = 0, chosen_end = 0, rejected_end = 0;
};

}  // namespace tessera
