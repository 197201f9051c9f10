#pragma once
// Fused AdamW over the flat fp32 parameter buffer: one launch per optimizer step.
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/backend/cpu/reference.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// A piece of at most adamw_chunk_elements() parameters inside one segment; the launch has one
// block per chunk. Built on the host from the op's segments (adamw_chunks) and kept on the
// device between steps.
struct AdamWChunk {
  int64_t offset = 0;  // first element, relative to master[0]
  int32_t count = 0;
  int32_t decay = 0;  // 1: weight decay applies
};

int64_t adamw_chunk_elements();

// Cuts the segments into chunks, in segment order.
std::vector<AdamWChunk> adamw_chunks(std::span<const ParamSegment> segments);

// Per-step constants: the fp32 ones exactly as the CPU reference derives them (its clip
// factor is not used: the kernel derives it from the device's gradient norm), and the
// clipping threshold (0: no clipping).
struct AdamWScalars {
  ref::AdamWScalarsOf<float> c;
  double max_grad_norm = 0;
};

// torch.optim.AdamW on every chunk: reads grad_norm_sq (1, fp32, device) and, when it is not
// finite, writes nothing; otherwise clips the gradient by max_grad_norm / (norm + 1e-6) when
// that is below 1 and updates master, exp_avg, exp_avg_sq (fp32) and params (in
// params_dtype; null when master is the parameters).
void adamw_step(float* master, void* params, DType params_dtype, float* exp_avg, float* exp_avg_sq,
                const float* grad, const float* grad_norm_sq, const AdamWChunk* chunks,
                int64_t chunk_count, const AdamWScalars& s, cudaStream_t stream);

}  // namespace tessera::cuda
