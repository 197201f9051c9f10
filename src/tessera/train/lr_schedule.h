#pragma once
#include <cstdint>

#include "tessera/config/config.h"

namespace tessera {

// Megatron's learning-rate schedule (OptimizerParamScheduler): linear warm-up to lr, then
// cosine / linear decay to min_lr at the decay end (constant: stays at lr; WSD: lr held until
// the last lr_wsd_decay_iters of the decay, then annealed in lr_wsd_decay_style), min_lr
// after. Megatron counts the schedule in samples; a run whose schedule keys are all in
// iterations counts in iterations, which is the same schedule (every iteration is
// global_batch_size samples). Sample-based keys (lr_warmup_samples, lr_decay_samples,
// lr_wsd_decay_samples, train_samples as the decay's default end) and lr_warmup_fraction
// follow Megatron's definitions. `iteration` is 1-based: iteration 1 of a 10-step warm-up runs
// at lr/10.
double learning_rate(const TrainingConfig& t, int64_t iteration);

}  // namespace tessera
