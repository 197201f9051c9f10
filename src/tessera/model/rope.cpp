#include "tessera/model/rope.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

namespace {

// YaRN (Peng et al., DeepSeek-V2's and Megatron's _yarn_find_correction_range): the dimension
// pair whose frequency makes `rotations` turns over the original context, fractional.
double yarn_correction_dim(double rotations, int64_t dim, double base, double context) {
  return dim * std::log(context / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}

// The frequencies of every pair below dimension `low` keep their value (extrapolation),
// those above `high` are divided by the factor (interpolation), with a linear ramp between;
// low and high are rounded outwards and clamped to [0, dim - 1], as DeepSeek's code does.
void apply_yarn(std::vector<double>& inv, const ModelSpec& spec) {
  const YarnRope& y = spec.yarn;
  const int64_t dim = spec.head_dim, half = dim / 2;
  const double context = static_cast<double>(y.original_max_position_embeddings);
  double low = std::floor(yarn_correction_dim(y.beta_fast, dim, spec.rotary_base, context));
  double high = std::ceil(yarn_correction_dim(y.beta_slow, dim, spec.rotary_base, context));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // a step instead of a ramp
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // the extrapolated (unscaled) share
    inv[i] = inv[i] / y.factor * (1.0 - keep) + inv[i] * keep;
  }
}

}  // namespace

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_table_scale(const YarnRope& y) {
  if (!y.enabled) return 1.0;
  return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
}

double mla_softmax_scale(const ModelSpec& spec) {
  const double base = 1.0 / std::sqrt(static_cast<double>(spec.mla.qk_dim()));
  if (!spec.yarn.enabled) return base;
  const double m = yarn_mscale(spec.yarn.factor, spec.yarn.mscale_all_dim);
  return base * m * m;
}

std::vector<double> rope_inverse_frequencies(const ModelSpec& spec) {
  const int64_t half = spec.head_dim / 2;
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i)
    inv[i] = 1.0 / std::pow(spec.rotary_base, static_cast<double>(2 * i) / spec.head_dim);
  if (spec.yarn.enabled) {
    apply_yarn(inv, spec);
    return inv;
  }
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

std::vector<float> rope_table(const ModelSpec& whole, int64_t seq_length, double base) {
  ModelSpec spec = whole;
  if (base != 0) {
    spec.rotary_base = base;
    spec.rope_scaling.enabled = spec.yarn.enabled = false;
  }
  const std::vector<double> inv = rope_inverse_frequencies(spec);
  const double scale = yarn_table_scale(spec.yarn);
  const int64_t half = static_cast<int64_t>(inv.size());
  std::vector<float> table(seq_length * 2 * half);
  for (int64_t t = 0; t < seq_length; ++t) {
    float* row = table.data() + t * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv[i];
      row[i] = static_cast<float>(std::cos(angle) * scale);
      row[half + i] = static_cast<float>(std::sin(angle) * scale);
    }
  }
  return table;
}

const Tensor& RopeTables::at(double base) const {
  for (const auto& [b, t] : tables)
    if (b == base) return t;
  throw InternalError(
      fmt::format("no rotary table of base {} (a mixer read a base it did not "
                  "declare in rope_bases())",
                  base));
}

}  // namespace tessera
