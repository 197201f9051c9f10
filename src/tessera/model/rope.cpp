#include "tessera/model/rope.h"

#include <cmath>

namespace tessera {

std::vector<double> rope_inverse_frequencies(const ModelSpec& spec) {
  const int64_t half = spec.head_dim / 2;
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i)
    inv[i] = 1.0 / std::pow(spec.rotary_base, static_cast<double>(2 * i) / spec.head_dim);
  const RopeScaling& r = spec.rope_scaling;
  if (!r.enabled) return inv;
  // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
  // between interpolated smoothly.
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / r.low_freq_factor;
  const double high_freq_wavelen = old_len / r.high_freq_factor;
  for (auto& f : inv) {
    const double wavelen = 2.0 * M_PI / f;
    if (wavelen < high_freq_wavelen) continue;
    if (wavelen > low_freq_wavelen) {
      f /= r.factor;
    } else {
      const double smooth =
          (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      f = (1.0 - smooth) * f / r.factor + smooth * f;
    }
  }
  return inv;
}

std::vector<float> rope_table(const ModelSpec& spec, int64_t seq_length) {
  const std::vector<double> inv = rope_inverse_frequencies(spec);
  const int64_t half = static_cast<int64_t>(inv.size());
  std::vector<float> table(seq_length * 2 * half);
  for (int64_t t = 0; t < seq_length; ++t) {
    float* row = table.data() + t * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv[i];
      row[i] = static_cast<float>(std::cos(angle));
      row[half + i] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

}  // namespace tessera
