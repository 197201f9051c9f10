#pragma once
// Attention for the CPU backend, per (batch, query head), as blocks of query rows whose
// scores, probabilities and gradients are computed with BLAS matrix products. The same
// math as ref::attention_head_forward/backward (which the tests hold it to), at BLAS speed:
// the per-element reference runs at ~10 GFLOP/s, this at BLAS rates, which makes the default
// CPU training job several times faster.
#include <cstdint>
#include <vector>

#include "tessera/ops/backend.h"

namespace tessera::cpu {

// Writes out rows and lse of query head h of batch b. scratch is resized as needed.
void attention_head_forward_blocked(float* out, float* lse, const float* qkv, const AttentionShape& s,
                                    int64_t b, int64_t h, std::vector<float>& scratch);

// Overwrites the dq rows of head h in dqkv; adds the head's key and value gradients into dk
// and dv, whose rows are dk_stride and dv_stride elements apart.
void attention_head_backward_blocked(float* dqkv, float* dk, float* dv, int64_t dk_stride,
                                     int64_t dv_stride, const float* dout, const float* out,
                                     const float* lse, const float* qkv, const AttentionShape& s,
                                     int64_t b, int64_t h, std::vector<float>& scratch);

}  // namespace tessera::cpu
