#pragma once
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

#include "tessera/model/model_spec.h"

namespace tessera {

// Inverse frequencies (head_dim/2) in double: plain RoPE, with Llama 3.1 scaling when enabled,
// or DeepSeek's YaRN (spec.yarn).
std::vector<double> rope_inverse_frequencies(const ModelSpec& spec);
// The (seq, head_dim) fp32 table the rope ops take: per position, cos of every frequency,
// then sin of every frequency, both times YaRN's cos/sin factor (yarn_table_scale). `base`
// other than 0 gives a layer's own base (local attention layers), unscaled.
std::vector<float> rope_table(const ModelSpec& spec, int64_t seq_length, double base = 0);

// A model's rotary tables on its backend, one per base its layers read (0: the spec's own).
struct RopeTables {
  std::vector<std::pair<double, Tensor>> tables;
  // Throws InternalError naming the base when no layer declared it.
  const Tensor& at(double base) const;
};

// YaRN's mscale(s, m) = 0.1 m ln(s) + 1, or 1 for s <= 1 (DeepSeek's yarn_get_mscale).
double yarn_mscale(double scale, double mscale);
// What the cos/sin table is multiplied by: mscale(factor, mscale) / mscale(factor,
// mscale_all_dim); 1 without YaRN.
double yarn_table_scale(const YarnRope& y);
// The attention softmax scale of an MLA model: 1/sqrt(qk_dim), times
// mscale(factor, mscale_all_dim)^2 with YaRN (DeepSeek's, and Megatron's MLA).
double mla_softmax_scale(const ModelSpec& spec);

}  // namespace tessera
