#include "tessera/train/lr_schedule.h"

#include <cmath>

namespace tessera {

double learning_rate(const TrainingConfig& t, int64_t iteration) {
  const int64_t warmup = t.lr_warmup_iters;
  const int64_t decay_end = t.lr_decay_iters ? t.lr_decay_iters : t.train_iters;
  if (warmup > 0 && iteration <= warmup)
    return t.lr * static_cast<double>(iteration) / static_cast<double>(warmup);
  if (t.lr_decay_style == LrDecayStyle::Constant) return t.lr;
  if (iteration > decay_end) return t.min_lr;
  const double span = static_cast<double>(decay_end - warmup);
  const double ratio = span > 0 ? static_cast<double>(iteration - warmup) / span : 1.0;
  const double coeff = t.lr_decay_style == LrDecayStyle::Cosine ? 0.5 * (std::cos(M_PI * ratio) + 1.0)
                                                                 : 1.0 - ratio;
  return t.min_lr + coeff * (t.lr - t.min_lr);
}

}  // namespace tessera
