#include "tessera/train/lr_schedule.h"

#include <cmath>

namespace tessera {

double learning_rate(const TrainingConfig& t, int64_t iteration) {
  const LrSchedulePhases p = lr_schedule_phases(t);
  const double step = static_cast<double>(iteration) *
                      (p.in_samples ? static_cast<double>(t.global_batch_size) : 1.0);
  if (p.warmup > 0 && step <= p.warmup) return t.lr * step / p.warmup;
  if (t.lr_decay_style == LrDecayStyle::Constant) return t.lr;
  if (step > p.decay_end) return t.min_lr;
  double coeff = 1.0;
  if (t.lr_decay_style == LrDecayStyle::Wsd) {
    const double anneal_start = p.decay_end - p.wsd_decay;
    if (step > anneal_start) {
      const double r = (step - anneal_start) / p.wsd_decay;
      switch (t.lr_wsd_decay_style) {
        case WsdDecayStyle::Exponential:
          coeff = 2.0 * std::pow(0.5, r) - 1.0;
          break;
        case WsdDecayStyle::Linear:
          coeff = 1.0 - r;
          break;
        case WsdDecayStyle::Cosine:
          coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
          break;
        case WsdDecayStyle::MinusSqrt:
          coeff = 1.0 - std::sqrt(r);
          break;
      }
    }
  } else {
    const double span = p.decay_end - p.warmup;
    const double ratio = span > 0 ? (step - p.warmup) / span : 1.0;
    coeff = t.lr_decay_style == LrDecayStyle::Cosine ? 0.5 * (std::cos(M_PI * ratio) + 1.0)
                                                     : 1.0 - ratio;
  }
  return t.min_lr + coeff * (t.lr - t.min_lr);
}

}  // namespace tessera
