#pragma once
// Grouped bf16 and FP8 GEMMs over row groups whose offsets are read on the device (sm_90a): the
// MoE experts' forward, data gradient and weight gradient (backend.h's grouped_matmul,
// grouped_matmul_wgrad and their FP8 forms, with one weight a group) as one persistent kernel
// each, so that no step waits for the host to learn how many rows each expert received.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "tessera/backend/cuda/vendor.h"

namespace tessera::cuda {

// Whether the kernels run on `device` (compiled for sm_90a, an sm_90 GPU).
bool grouped_matmul_hopper_runs_on(int device);
// Whether the kernels take these operands on `device`: compiled for sm_90a, an sm_90 GPU, at
// most 1024 groups, rows whose strides TMA takes (widths of elements of element_bytes that are
// multiples of 16 bytes) and 16-byte aligned bases.
bool grouped_matmul_hopper_takes(int device, int64_t groups, int element_bytes,
                                 std::initializer_list<int64_t> widths,
                                 std::initializer_list<const void*> bases);

// out[rows_g] (M_g, N) = a[rows_g] (M_g, K) @ op(b[g]), op(x) = x^T when trans_b (b (G, N, K))
// else x (b (G, K, N)); rows_g = [offsets[g], offsets[g+1]) read on the device (0 at g = 0,
// non-decreasing, offsets[G] <= R); rows of out from offsets[G] on are set to zero.
void grouped_matmul_hopper(bf16* out, const bf16* a, const bf16* b, const int32_t* offsets,
                           int64_t G, int64_t R, int64_t N, int64_t K, bool trans_b,
                           cudaStream_t stream);

// out[g] (M, N) = beta * out[g] + a[rows_g]^T (M, M_g) @ b[rows_g] (M_g, N) for every group g
// (a group without rows gives beta * out[g]); out fp32, or bf16 rounded once from the fp32 sum.
void grouped_matmul_wgrad_hopper(void* out, bool out_fp32, const bf16* a, const bf16* b,
                                 const int32_t* offsets, int64_t G, int64_t R, int64_t M, int64_t N,
                                 float beta, cudaStream_t stream);

// FP8 (b's codes e4m3, a's e4m3 or e5m2): out[rows_g] (M_g, N) bf16 = (a[rows_g] (M_g, K) *
// a_scale_inv[0]) @ (b[g] (N, K) * b_scale_inv[g])^T, fp32 sums (split_accumulation: each
// 128-deep slice summed apart, as cuBLASLt without fast accumulation); offsets as
// grouped_matmul_hopper's.
void grouped_matmul_fp8_hopper(bf16* out, const void* a, bool a_e5m2, const void* b,
                               const float* a_scale_inv, const float* b_scale_inv,
                               const int32_t* offsets, int64_t G, int64_t R, int64_t N, int64_t K,
                               bool split_accumulation, cudaStream_t stream);

// out[g] (M, N) = beta * out[g] + (a_t[:, rows_g] * a_scale_inv[0]) @ (b_t[:, rows_g] *
// b_scale_inv[0])^T for every group, a_t (M, R) and b_t (N, R) codes (b_t's e4m3), R a multiple
// of 16 and every group's rows whole 16s; out fp32, or bf16 rounded once.
void grouped_matmul_fp8_wgrad_hopper(void* out, bool out_fp32, const void* a_t, bool a_e5m2,
                                     const void* b_t, const float* a_scale_inv,
                                     const float* b_scale_inv, const int32_t* offsets, int64_t G,
                                     int64_t R, int64_t M, int64_t N, float beta,
                                     bool split_accumulation, cudaStream_t stream);

}  // namespace tessera::cuda
