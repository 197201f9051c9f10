#pragma once
// Hopper's asynchronous machinery (sm_90a) for the warp-specialised kernels (attention_hopper.cu,
// attention_hopper_backward.cu, grouped_matmul_hopper.cu): mbarriers, TMA tensor copies, named
// barriers, warpgroup MMAs (wgmma) with shared-memory descriptors, and the host's tensor maps
// (hopper_ptx.cu).
// Every shared-memory operand here is a 128-byte swizzled tile as TMA writes it: rows of 64
// bf16 (128 bytes), 16-byte chunk c of row r stored at chunk c ^ (r % 8), tiles starting on a
// 1024-byte boundary (the swizzle's period). Include from .cu files only.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "tessera/backend/cuda/vendor.h"

namespace tessera::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two fp32 values -> one bf16x2 register (round to nearest even), the lower column in the
// low half as the MMA fragments expect; cvt puts its first source in the upper half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

namespace hopper {

// Whether kernels of this family run on `device`: built for sm_90a (TESSERA_CUDA_SM90A; nvcc's
// host pass cannot see the device's features) and an sm_90 GPU.
bool runs_on(int device);
// A rank-3 tensor map of 1-byte (FP8 codes), bf16 or fp32 elements (element_bytes 1, 2, 4)
// with 128-byte swizzled boxes; dims innermost first, strides in bytes for dims 1 and 2, box
// rows of 128 bytes (the swizzle span: 128 codes, 64 bf16 or 32 fp32). Loads read
// out-of-range elements as zeros; reductions skip them. Throws InternalError when the driver
// refuses it.
CUtensorMap tensor_map(const void* base, int element_bytes, const uint64_t (&dims)[3],
                       const uint64_t (&strides)[2], const uint32_t (&box)[3]);
// bf16 rows of `width` elements as (planes, seq, width), in boxes of `rows` rows x 64
// elements; rows past seq read as zeros. Widths of multiples of 8 elements keep the strides
// multiples of 16 bytes, as TMA needs.
CUtensorMap row_map(const bf16* base, int64_t width, int64_t seq, int64_t planes, uint32_t rows);
// The same for FP8 codes: rows of `width` codes in boxes of `rows` rows x 128 codes; widths of
// multiples of 16 keep the strides TMA's.
CUtensorMap codes_map(const void* base, int64_t width, int64_t seq, int64_t planes, uint32_t rows);

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// A release: the caller's shared-memory writes are visible to whoever waits on the phase.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: a producer's first pass over a ring waits on the
// "previous" phase of the empty barriers and finds every stage free.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One box of a rank-3 tensor map at (c0, c1, c2) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                         int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// tma_load's box written at `dst` in every CTA of the cluster that `cta_mask` names (bit r:
// cluster rank r), each completing on its own barrier at `bar`.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                                   int c0, int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// An arrival on the barrier at `bar` (this CTA's offset) of cluster rank `cta`, with
// mbar_arrive's (CTA-scope) release: enough to say that the caller's reads of a stage are
// done, which is all a ring's empty barrier tells (a cluster-scope release costs a fence).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}

// Every thread of every CTA of the cluster (all threads call it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

// Adds a box of fp32 from shared memory into the tensor at (c0, c1, c2), asynchronously; the
// issuing thread commits it to its bulk group and may wait for the reads of shared memory.
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                               int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
      "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Stores a box from shared memory into the tensor at (c0, c1, c2), asynchronously, skipping
// the box's elements past the tensor's extent; committed and waited for as tma_reduce_add.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                          int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::
          "l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until this thread's committed bulk operations have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until this thread's committed bulk operations are complete (their global writes done).
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Orders this thread's generic shared-memory writes before later async-proxy reads (wgmma).
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, whole warps.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// This thread's arrival at barrier `id` without waiting for the others.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Shared-memory matrix descriptor of a 128-byte swizzled operand. K-major (rows along the
// reduction: Q, K in S = Q K^T): lbo unused, sbo = 1024 (8-row atoms). MN-major (the reduction
// runs down the rows, e.g. V in P V): lbo = the distance between 64-column blocks, sbo 1024.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator layout of wgmma m64nN (fp32), thread l of warp w of the warpgroup, g = l / 4,
// t = l % 4: rows 16 w + g and 16 w + g + 8; for each 8-column chunk c, d[4c], d[4c + 1] are
// columns 8c + 2t, 8c + 2t + 1 of the first row and d[4c + 2], d[4c + 3] those of the second:
// mma.sync's C layout chunk after chunk, which is also the A-from-registers layout, so a
// product goes into the next MMA without leaving registers.

#define TS_ACC8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define TS_ACC32 TS_ACC8(0), TS_ACC8(8), TS_ACC8(16), TS_ACC8(24)
#define TS_ACC64 TS_ACC32, TS_ACC8(32), TS_ACC8(40), TS_ACC8(48), TS_ACC8(56)
#define TS_LIST32                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TS_ACC128                                                                          \
  TS_ACC64, TS_ACC8(64), TS_ACC8(72), TS_ACC8(80), TS_ACC8(88), TS_ACC8(96), TS_ACC8(104), \
      TS_ACC8(112), TS_ACC8(120)
#define TS_LIST64                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "    \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "    \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128, fp32) = (accumulate: +=) A (64 x 16, shared, K-major) B^T (B: 128 x 16, shared,
// K-major).
__device__ __forceinline__ void wgmma_m64n128_ss(float (&d)[64], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " TS_LIST64
      ", %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : TS_ACC64
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64) = (+=) A (64 x 16) B (16 x 64), both from shared memory; kTransA / kTransB: the
// operand is MN-major (its rows run along the reduction) instead of K-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64_ss(float (&d)[32], uint64_t a, uint64_t b,
                                                int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TS_LIST32
      ", %32, %33, p, 1, 1, %35, %36;\n"
      "}\n"
      : TS_ACC32
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (64 x 256) = (+=) A (64 x 16) B (16 x 256), both from shared memory; kTransA / kTransB as
// for wgmma_m64n64_ss.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256_ss(float (&d)[128], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
      "%125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : TS_ACC128
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (64 x 128) += A (64 x 16, registers: mma.sync's m16n8k16 A fragment per warp) B (16 x 128,
// shared, MN-major).
__device__ __forceinline__ void wgmma_m64n128_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " TS_LIST64
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : TS_ACC64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// The FP8 pairs of operands the FP8 wrappers below take: a's format, then b's (b is always
// e4m3 there: the weights and the activations; a is an e4m3 activation or an e5m2 gradient).
enum class Fp8Pair { E4m3E4m3, E5m2E4m3 };

// d (64 x 256, fp32) = (+=) A (64 x 32 codes) B^T (B: 256 x 32 codes), both from shared
// memory, K-major (the only FP8 layout wgmma takes).
template <Fp8Pair kPair>
__device__ __forceinline__ void wgmma_m64n256_fp8_ss(float (&d)[128], uint64_t a, uint64_t b,
                                                     int accumulate) {
#define TS_WGMMA_FP8_N256(types)                                                             \
  asm volatile(                                                                              \
      "{\n"                                                                                  \
      ".reg .pred p;\n"                                                                      \
      "setp.ne.b32 p, %130, 0;\n"                                                            \
      "wgmma.mma_async.sync.aligned.m64n256k32.f32." types                                   \
      " {"                                                                                   \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "               \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "     \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "     \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "     \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "     \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "     \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "     \
      "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
      "%124, %125, %126, %127}, %128, %129, p, 1, 1;\n"                                      \
      "}\n"                                                                                  \
      : TS_ACC128                                                                            \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (kPair == Fp8Pair::E4m3E4m3) {
    TS_WGMMA_FP8_N256("e4m3.e4m3");
  } else {
    TS_WGMMA_FP8_N256("e5m2.e4m3");
  }
#undef TS_WGMMA_FP8_N256
}

// d (64 x 128) = (+=) A (64 x 32 codes) B^T (B: 128 x 32 codes), as wgmma_m64n256_fp8_ss.
template <Fp8Pair kPair>
__device__ __forceinline__ void wgmma_m64n128_fp8_ss(float (&d)[64], uint64_t a, uint64_t b,
                                                     int accumulate) {
#define TS_WGMMA_FP8_N128(types)                                         \
  asm volatile(                                                          \
      "{\n"                                                              \
      ".reg .pred p;\n"                                                  \
      "setp.ne.b32 p, %66, 0;\n"                                         \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." types " " TS_LIST64 \
      ", %64, %65, p, 1, 1;\n"                                           \
      "}\n"                                                              \
      : TS_ACC64                                                         \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (kPair == Fp8Pair::E4m3E4m3) {
    TS_WGMMA_FP8_N128("e4m3.e4m3");
  } else {
    TS_WGMMA_FP8_N128("e5m2.e4m3");
  }
#undef TS_WGMMA_FP8_N128
}

// d (64 x 128) += A (64 x 32 e4m3 codes, registers: mma.sync's m16n8k32 A fragment per warp,
// four codes a register, the lowest column in the low byte) B^T (B: 128 x 32 e4m3 codes,
// shared, K-major).
__device__ __forceinline__ void wgmma_m64n128_e4m3_rs(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " TS_LIST64
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : TS_ACC64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

#undef TS_LIST64
#undef TS_LIST32
#undef TS_ACC128
#undef TS_ACC64
#undef TS_ACC32
#undef TS_ACC8

// Byte offset of bf16 element (row, col) in a 128-byte swizzled tile of `rows` rows per
// 64-column block (blocks stored one after another).
__device__ __forceinline__ uint32_t swizzled_offset(int rows, int row, int col) {
  return static_cast<uint32_t>((col / 64) * rows * 128 + row * 128 +
                               ((((col % 64) / 8) ^ (row % 8)) << 4) + (col % 8) * 2);
}

}  // namespace hopper

}  // namespace tessera::cuda
