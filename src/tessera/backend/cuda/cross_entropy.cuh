#pragma once
// Softmax cross-entropy over rows of logits, forward and backward fused.
#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/core/dtype.h"

namespace tessera::cuda {

// logits (N, V) in dtype; targets (N) int32, negative = ignored (loss 0, zero gradient row).
// losses (N) fp32 = logsumexp(logits[n]) - logits[n, target]. If dlogits is non-null (it may
// be logits itself) it receives grad_scale * (softmax(logits[n]) - onehot(target)) in dtype.
// A target >= V gives a NaN loss and a NaN gradient row (the CPU backend throws instead).
void cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                   int64_t N, int64_t V, float grad_scale, DType dtype, cudaStream_t stream);

}  // namespace tessera::cuda
