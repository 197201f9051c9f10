#pragma once
// The MoE balance a trained model's step hook read from its last step (MoeBalanceHook), as
// the trainer reports it; empty for a dense model.
#include <vector>

#include "tessera/model/model.h"
#include "tessera/model/moe_balance.h"

namespace tessera::testing {

inline std::vector<MoeLayerBalance> moe_balance_of(const Model& model) {
  for (StepHook* hook : model.step_hooks())
    if (const auto* moe = dynamic_cast<const MoeBalanceHook*>(hook)) return moe->last_step();
  return {};
}

}  // namespace tessera::testing
