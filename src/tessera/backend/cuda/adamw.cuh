#pragma once
// Fused AdamW over the flat parameter buffer: one launch per optimizer step, for every storage
// dtype of its state (fp32 or bf16).
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/backend/cpu/reference.h"
#include "tessera/backend/cuda/vendor.h"
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

// The tensors of one step and their storage dtypes (fp32 or bf16). master: the fp32 master
// weights, a split master's low halves (uint16, params its bf16 high halves), or, with bf16
// main parameters, the parameters themselves (params then null).
// params: the compute-dtype copy written from the master, or null.
struct AdamWBuffers {
  void* master = nullptr;
  DType master_dtype = DType::F32;
  void* params = nullptr;
  DType params_dtype = DType::F32;
  const void* grad = nullptr;
  DType grad_dtype = DType::F32;
  void* exp_avg = nullptr;
  DType exp_avg_dtype = DType::F32;
  void* exp_avg_sq = nullptr;
  DType exp_avg_sq_dtype = DType::F32;
};

// torch.optim.AdamW on every chunk: reads grad_norm_sq (1, fp32, device) and, when it is not
// finite, writes nothing; otherwise clips the gradient by max_grad_norm / (norm + 1e-6) when
// that is below 1 and updates master, the moments and params. The arithmetic is fp32 for
// every storage dtype.
void adamw_step(const AdamWBuffers& t, const float* grad_norm_sq, const AdamWChunk* chunks,
                int64_t chunk_count, const AdamWScalars& s, cudaStream_t stream);

// high (bf16 bits) and low (uint16) of n fp32 master weights (core/split_master.h).
void split_master(void* high, void* low, const float* master, int64_t n, cudaStream_t stream);

}  // namespace tessera::cuda
