#include "tessera/config/config.h"

namespace tessera {

LrSchedulePhases lr_schedule_phases(const TrainingConfig& t) {
  LrSchedulePhases p;
  p.in_samples = t.lr_warmup_samples > 0 || t.lr_decay_samples > 0 || t.lr_wsd_decay_samples > 0;
  const double gbs = static_cast<double>(t.global_batch_size);
  // An iteration-based value in the schedule's unit.
  const auto steps = [&](int64_t iterations) {
    return static_cast<double>(iterations) * (p.in_samples ? gbs : 1.0);
  };
  if (t.lr_decay_samples > 0) {
    p.decay_end = static_cast<double>(t.lr_decay_samples);
  } else if (t.lr_decay_iters > 0) {
    p.decay_end = steps(t.lr_decay_iters);
  } else {
    // Megatron's default: the run's length, in samples for a sample-based run.
    p.decay_end = p.in_samples && t.train_samples > 0 ? static_cast<double>(t.train_samples)
                                                      : steps(t.train_iters);
  }
  if (t.lr_warmup_fraction >= 0) {
    p.warmup = t.lr_warmup_fraction * p.decay_end;
  } else if (t.lr_warmup_samples > 0) {
    p.warmup = static_cast<double>(t.lr_warmup_samples);
  } else {
    p.warmup = steps(t.lr_warmup_iters);
  }
  p.wsd_decay = t.lr_wsd_decay_samples > 0 ? static_cast<double>(t.lr_wsd_decay_samples)
                                           : steps(t.lr_wsd_decay_iters);
  return p;
}

}  // namespace tessera
