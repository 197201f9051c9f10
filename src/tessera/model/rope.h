#pragma once
#include <vector>

#include "tessera/model/model_spec.h"

namespace tessera {

// Inverse frequencies (head_dim/2) with Llama 3.1 scaling when enabled, in double.
std::vector<double> rope_inverse_frequencies(const ModelSpec& spec);
// The (seq, head_dim) fp32 table the rope ops take: per position, cos of every frequency,
// then sin of every frequency.
std::vector<float> rope_table(const ModelSpec& spec, int64_t seq_length);

}  // namespace tessera
