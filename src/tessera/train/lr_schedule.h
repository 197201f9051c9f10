#pragma once
#include <cstdint>

#include "tessera/config/config.h"

namespace tessera {

// Megatron's learning-rate schedule: linear warm-up to lr over lr_warmup_iters, then
// cosine/linear decay to min_lr at lr_decay_iters (constant: stays at lr), min_lr after.
// `iteration` is 1-based: iteration 1 of a 10-step warm-up runs at lr/10.
double learning_rate(const TrainingConfig& t, int64_t iteration);

}  // namespace tessera
