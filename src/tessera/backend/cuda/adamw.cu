#include "tessera/backend/cuda/adamw.cuh"

#include <algorithm>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"
#include "tessera/core/split_master.h"

namespace tessera::cuda {
namespace {

// One block of 256 threads per chunk of 64K elements: 16 steps of 4 elements per thread over
// the state streams (read master, grad, m, v; write master, m, v; write the bf16 copy): 30
// bytes per parameter with fp32 state, 16 with bf16 gradients and moments and no master copy.
// Chunks let one launch cover tensors of every size (a 525M-entry embedding and 4096-entry norm
// weights) with full blocks.
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

// A split master (core/split_master.h) is TM = TP = uint16_t: master the low halves, params
// the bf16 bits of the high halves.
template <class TM>
inline constexpr bool kSplitMaster = std::is_same_v<TM, uint16_t>;

// Elements [i, i + VEC) of the master (params, null unless there is a copy, is read when split).
template <class TM, class TP, int VEC>
__device__ __forceinline__ void load_master(const TM* master, const TP* params, int64_t i,
                                            float (&out)[VEC]) {
  if constexpr (kSplitMaster<TM>) {
    const Pack<uint16_t, VEC> high = load_pack<uint16_t, VEC>(params + i),
                              low = load_pack<uint16_t, VEC>(master + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = __uint_as_float(split_master_join(high.v[k], low.v[k]));
  } else {
    load_floats<TM, VEC>(master + i, out);
  }
}

// Stores elements [i, i + VEC) of the master, and of the compute-dtype copy when params is not
// null.
template <class TM, class TP, int VEC>
__device__ __forceinline__ void store_master(TM* master, TP* params, int64_t i,
                                             const float (&in)[VEC]) {
  if constexpr (kSplitMaster<TM>) {
    Pack<uint16_t, VEC> high, low;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const uint32_t bits = __float_as_uint(in[k]);
      high.v[k] = split_master_high(bits);
      low.v[k] = split_master_low(bits);
    }
    store_pack<uint16_t, VEC>(params + i, high);
    store_pack<uint16_t, VEC>(master + i, low);
  } else {
    store_floats<TM, VEC>(master + i, in);
    if (params != nullptr) store_floats<TP, VEC>(params + i, in);
  }
}

// VEC = 4 when every base pointer allows it; elements before the first 4-aligned index of a
// chunk and after the last full pack go through the scalar path. Storage types: TM the master
// (fp32, the bf16 parameters themselves, or a split master's low halves), TP the compute-dtype
// copy (written when params is not null), TG the gradient, TS1 / TS2 the moments. Whatever they
// are, the update runs on fp32 values and each bf16 store rounds to nearest even (the host
// reference's rounding), but a split master's high halves, which round ties away from zero.
template <class TM, class TP, class TG, class TS1, class TS2, int VEC>
__global__ void adamw_kernel(TM* master, TP* params, TS1* exp_avg, TS2* exp_avg_sq, const TG* grad,
                             const float* grad_norm_sq, const AdamWChunk* chunks, AdamWScalars s) {
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
    float p[1], m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
    load_master<TM, TP, 1>(master, params, i, p);
    update(p[0], m, v, to_float(grad[i]));
    store_master<TM, TP, 1>(master, params, i, p);
    exp_avg[i] = from_float<TS1>(m);
    exp_avg_sq[i] = from_float<TS2>(v);
  };
  for (int64_t i = begin + threadIdx.x; i < vec_begin; i += kThreads) scalar(i);
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) scalar(i);
  for (int64_t i = vec_begin + static_cast<int64_t>(threadIdx.x) * VEC; i < vec_end;
       i += kThreads * VEC) {
    float p[VEC], m[VEC], v[VEC], g[VEC];
    load_master<TM, TP, VEC>(master, params, i, p);
    load_floats<TS1, VEC>(exp_avg + i, m);
    load_floats<TS2, VEC>(exp_avg_sq + i, v);
    load_floats<TG, VEC>(grad + i, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) update(p[k], m[k], v[k], g[k]);
    store_master<TM, TP, VEC>(master, params, i, p);
    store_floats<TS1, VEC>(exp_avg + i, m);
    store_floats<TS2, VEC>(exp_avg_sq + i, v);
  }
}

__global__ void split_master_kernel(uint16_t* high, uint16_t* low, const float* master, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = __float_as_uint(master[i]);
    high[i] = split_master_high(bits);
    low[i] = split_master_low(bits);
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

void adamw_step(const AdamWBuffers& t, const float* grad_norm_sq, const AdamWChunk* chunks,
                int64_t chunk_count, const AdamWScalars& s, cudaStream_t stream) {
  NvtxRange range("adamw_step");
  if (chunk_count == 0) return;
  check_grid("adamw_step", chunk_count);
  // Storage types are dispatched one tensor at a time: master, copy, gradient, moments.
  auto launch = [&](auto tm, auto tp, auto tg, auto ts1, auto ts2) {
    using TM = decltype(tm);
    using TP = decltype(tp);
    using TG = decltype(tg);
    using TS1 = decltype(ts1);
    using TS2 = decltype(ts2);
    auto* master = static_cast<TM*>(t.master);
    auto* params = static_cast<TP*>(t.params);
    auto* m = static_cast<TS1*>(t.exp_avg);
    auto* v = static_cast<TS2*>(t.exp_avg_sq);
    const auto* g = static_cast<const TG*>(t.grad);
    // Four elements per access of every tensor (16 bytes fp32, 8 bytes bf16).
    const bool vec = is_aligned(master, 4 * sizeof(TM)) && is_aligned(m, 4 * sizeof(TS1)) &&
                     is_aligned(v, 4 * sizeof(TS2)) && is_aligned(g, 4 * sizeof(TG)) &&
                     is_aligned(params, 4 * sizeof(TP));
    if (vec) {
      adamw_kernel<TM, TP, TG, TS1, TS2, 4>
          <<<chunk_count, kThreads, 0, stream>>>(master, params, m, v, g, grad_norm_sq, chunks, s);
    } else {
      adamw_kernel<TM, TP, TG, TS1, TS2, 1>
          <<<chunk_count, kThreads, 0, stream>>>(master, params, m, v, g, grad_norm_sq, chunks, s);
    }
    TS_CUDA_CHECK_LAUNCH("adamw_kernel");
  };
  auto with_moments = [&](auto tm, auto tp, auto tg) {
    dispatch_float(t.exp_avg_dtype, "adamw_step exp_avg", [&](auto ts1) {
      dispatch_float(t.exp_avg_sq_dtype, "adamw_step exp_avg_sq",
                     [&](auto ts2) { launch(tm, tp, tg, ts1, ts2); });
    });
  };
  dispatch_float(t.grad_dtype, "adamw_step grad", [&](auto tg) {
    if (t.master_dtype == DType::U16) {
      TS_CHECK(t.params != nullptr && t.params_dtype == DType::BF16,
               "adamw_step: a split master needs bf16 parameters, its high halves");
      with_moments(uint16_t{}, uint16_t{}, tg);
    } else if (t.params == nullptr) {  // no copy: the master is fp32 master weights or the parameters
      dispatch_float(t.master_dtype, "adamw_step master",
                     [&](auto tm) { with_moments(tm, float{}, tg); });
    } else {
      TS_CHECK(t.master_dtype == DType::F32, "adamw_step: a parameter copy needs an fp32 master");
      dispatch_float(t.params_dtype, "adamw_step params",
                     [&](auto tp) { with_moments(float{}, tp, tg); });
    }
  });
}

void split_master(void* high, void* low, const float* master, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  split_master_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<uint16_t*>(high), static_cast<uint16_t*>(low), master, n);
  TS_CUDA_CHECK_LAUNCH("split_master_kernel");
}

}  // namespace tessera::cuda
