#include "tessera/backend/cuda/adamw.cuh"

#include <algorithm>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// One block of 256 threads per chunk of 64K elements: 16 float4 steps per thread over four
// fp32 streams (read master, grad, m, v; write master, m, v; write the bf16 copy): 30 bytes
// per parameter, the ideal for this op. Chunks let one launch cover tensors of every size
// (a 525M-entry embedding and 4096-entry norm weights) with full blocks.
constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t{1} << 16;

// The element math of ref::adamw_update in fp32 with explicit round-to-nearest intrinsics:
// no FMA contraction and IEEE sqrt and divide, so the device computes the same floats as
// the CPU reference (whose x86-64 build does not contract either), bit for bit. fp32, as
// torch's fused AdamW: the same steps in double (a divide and a sqrt are iterative there)
// cost ~40 fp64 instructions per element, enough to hold the kernel at ~70% of its
// memory bound on Hopper.
struct Update {
  float g_scale;
  ref::AdamWScalarsOf<float> s;
  float decay;

  __device__ __forceinline__ void operator()(float& master, float& m, float& v, float grad) const {
    const float g = __fmul_rn(grad, g_scale);
    m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, g));
    v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.sqrt_bias_correction2), s.eps);
    master = __fsub_rn(__fmul_rn(master, decay), __fdiv_rn(__fmul_rn(s.step_size, m), denom));
  }
};

// VEC = 4 (float4 accesses) when every base pointer allows it; elements before the first
// 4-aligned index of a chunk and after the last full pack go through the scalar path.
template <class TP, int VEC>
__global__ void adamw_kernel(float* master, TP* params, float* exp_avg, float* exp_avg_sq,
                             const float* grad, const float* grad_norm_sq, const AdamWChunk* chunks,
                             AdamWScalars s) {
  const float norm_sq = *grad_norm_sq;
  if (!isfinite(norm_sq)) return;  // skipped step: nothing changes
  double g_scale = 1.0;
  if (s.max_grad_norm > 0) {
    g_scale = fmin(s.max_grad_norm / (sqrt(static_cast<double>(norm_sq)) + 1e-6), 1.0);
  }
  const AdamWChunk chunk = chunks[blockIdx.x];
  const Update update{static_cast<float>(g_scale), s.c, chunk.decay ? s.c.decay_factor : 1.0f};

  const int64_t begin = chunk.offset, end = chunk.offset + chunk.count;
  const int64_t vec_begin = std::min(end, (begin + VEC - 1) / VEC * VEC);
  const int64_t vec_end = std::max(vec_begin, end / VEC * VEC);
  auto scalar = [&](int64_t i) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    update(p, m, v, grad[i]);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (params != nullptr) params[i] = from_float<TP>(p);
  };
  for (int64_t i = begin + threadIdx.x; i < vec_begin; i += kThreads) scalar(i);
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) scalar(i);
  for (int64_t i = vec_begin + static_cast<int64_t>(threadIdx.x) * VEC; i < vec_end;
       i += kThreads * VEC) {
    Pack<float, VEC> p = load_pack<float, VEC>(master + i);
    Pack<float, VEC> m = load_pack<float, VEC>(exp_avg + i);
    Pack<float, VEC> v = load_pack<float, VEC>(exp_avg_sq + i);
    const Pack<float, VEC> g = load_pack<float, VEC>(grad + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) update(p.v[k], m.v[k], v.v[k], g.v[k]);
    store_pack<float, VEC>(master + i, p);
    store_pack<float, VEC>(exp_avg + i, m);
    store_pack<float, VEC>(exp_avg_sq + i, v);
    if (params != nullptr) {
      Pack<TP, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<TP>(p.v[k]);
      store_pack<TP, VEC>(params + i, out);
    }
  }
}

}  // namespace

int64_t adamw_chunk_elements() {
  return kChunk;
}

std::vector<AdamWChunk> adamw_chunks(std::span<const ParamSegment> segments) {
  std::vector<AdamWChunk> chunks;
  for (const ParamSegment& seg : segments) {
    for (int64_t begin = 0; begin < seg.count; begin += kChunk) {
      chunks.push_back({seg.offset + begin,
                        static_cast<int32_t>(std::min(kChunk, seg.count - begin)),
                        seg.decay ? 1 : 0});
    }
  }
  return chunks;
}

void adamw_step(float* master, void* params, DType params_dtype, float* exp_avg, float* exp_avg_sq,
                const float* grad, const float* grad_norm_sq, const AdamWChunk* chunks,
                int64_t chunk_count, const AdamWScalars& s, cudaStream_t stream) {
  NvtxRange range("adamw_step");
  if (chunk_count == 0) return;
  check_grid("adamw_step", chunk_count);
  auto launch = [&](auto tag) {
    using TP = decltype(tag);
    auto* p = static_cast<TP*>(params);
    // The bf16 copy is written 4 elements (8 bytes) at a time.
    const bool vec = is_aligned(master, 16) && is_aligned(exp_avg, 16) &&
                     is_aligned(exp_avg_sq, 16) && is_aligned(grad, 16) &&
                     is_aligned(params, 4 * sizeof(TP));
    if (vec) {
      adamw_kernel<TP, 4><<<chunk_count, kThreads, 0, stream>>>(master, p, exp_avg, exp_avg_sq,
                                                                grad, grad_norm_sq, chunks, s);
    } else {
      adamw_kernel<TP, 1><<<chunk_count, kThreads, 0, stream>>>(master, p, exp_avg, exp_avg_sq,
                                                                grad, grad_norm_sq, chunks, s);
    }
    TS_CUDA_CHECK_LAUNCH("adamw_kernel");
  };
  if (params == nullptr) {
    launch(float{});
  } else {
    dispatch_float(params_dtype, "adamw_step", launch);
  }
}

}  // namespace tessera::cuda
