#pragma once
// SwiGLU's element math, shared by the bf16 kernels (swiglu.cu) and the fused FP8 cast of
// its gradient (fp8_cast.cu), so that both compute the same fp32 values.
#include <cuda_runtime.h>

namespace tessera::cuda {

__device__ __forceinline__ float swiglu_sigmoid(float x) {
  return 1.0f / (1.0f + __expf(-x));
}

// d(gate) = dout * up * silu'(gate), silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
__device__ __forceinline__ float swiglu_dgate(float dout, float gate, float up) {
  const float sig = swiglu_sigmoid(gate);
  return dout * up * sig * (1.0f + gate * (1.0f - sig));
}

// d(up) = dout * silu(gate).
__device__ __forceinline__ float swiglu_dup(float dout, float gate) {
  return dout * gate * swiglu_sigmoid(gate);
}

}  // namespace tessera::cuda
