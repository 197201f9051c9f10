#pragma once
// Generation's draw of each row's next token on the device (Backend::sample_tokens).
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// logits (B, V) in dtype (fp32 or bf16); streams (B) int32. tokens (B) int32: the argmax over
// ids < vocab of logit / temperature + gumbel_noise (core/random.h), or of the logit at
// temperature 0, ids below min_p times the top's probability left out; logps and entropy (B)
// fp32 of softmax(logits) at temperature 1 over all V columns.
// scratch: sample_tokens_scratch_bytes(B, V) bytes (each row's chunks' partial results).
size_t sample_tokens_scratch_bytes(int64_t B, int64_t V);
void sample_tokens(int32_t* tokens, float* logps, float* entropy, const void* logits,
                   const int32_t* streams, const int32_t* steps, int64_t B, int64_t V, int64_t vocab,
                   float temperature, float min_p, uint64_t seed, DType dtype, void* scratch,
                   size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
