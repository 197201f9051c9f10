#pragma once
// Host emulation of the CUDA features attention.cu uses, so that its kernels run unchanged
// (after make_emulation.py swaps the inline-PTX wrappers for the functions below) on a
// machine without a GPU. One OS thread per CUDA thread; CTAs run one after another.
//
// Fidelity where bugs hide:
// - ldmatrix / mma.sync / shfl are warp collectives computed from every lane's operands with
//   the PTX ISA's fragment layouts (a lane's result depends on the other lanes' inputs).
// - cp.async copies are deferred: they land in shared memory only when a cp.async.wait_group
//   retires their group, so reading a stage before waiting for it reads stale data.
// - Shared memory starts at an address that is not 128-byte aligned, so the kernels'
//   alignment of the dynamic base is exercised.
// Not modelled: timing, bank conflicts, memory ordering between CTAs beyond atomics.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

// ---- CUDA vector and bf16 types ----
struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float a, float b) { return {a, b}; }

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline uint16_t emu_float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float emu_bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- runtime API stubs ----
using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorLaunchFailure = 1 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline const char* cudaGetErrorString(cudaError_t) { return "emulated error"; }
cudaError_t cudaGetLastError();
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  return bytes <= 227 * 1024 ? cudaSuccess : cudaErrorLaunchFailure;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline void nvtxRangePushA(const char*) {}
inline void nvtxRangePop() {}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace emu {

constexpr uint32_t kSharedBase = 16;  // shared window address of the dynamic base: unaligned

struct CpAsync {
  uint8_t* dst;
  const uint8_t* src;
  int bytes;
  bool valid;
};

struct Warp {
  explicit Warp() : bar(32) {}
  std::barrier<> bar;
  // Two slot sets alternate between consecutive collectives, so one barrier per collective
  // suffices: a lane can only overwrite set s after everyone passed the next collective.
  struct Slots {
    uint32_t addr[32];
    uint32_t a[32][4], b[32][2];
    float f[32];
  } slots[2];
};

struct ThreadState {
  uint3 tid, bid;
  dim3 bdim, gdim;
  uint8_t* smem = nullptr;  // host pointer of shared address 0
  Warp* warp = nullptr;
  std::barrier<>* cta = nullptr;
  int lane = 0;
  unsigned seq = 0;  // collectives done by this lane
  std::vector<CpAsync> pending;
  std::deque<std::vector<CpAsync>> groups;
};
inline thread_local ThreadState t_state;
inline std::mutex g_atomic_mutex;
inline cudaError_t g_last_error = cudaSuccess;

inline Warp::Slots& next_slots() { return t_state.warp->slots[t_state.seq++ & 1]; }
inline void warp_sync() { t_state.warp->bar.arrive_and_wait(); }

// ---- shared memory addressing ----
inline uint8_t* shared_ptr(uint32_t addr) { return t_state.smem + addr; }

inline void cp_async(uint32_t dst, const void* src, int bytes, bool valid) {
  t_state.pending.push_back({shared_ptr(dst), static_cast<const uint8_t*>(src), bytes, valid});
}
inline void cp_async_commit() {
  t_state.groups.push_back(std::move(t_state.pending));
  t_state.pending.clear();
}
inline void cp_async_wait(int keep) {
  while (static_cast<int>(t_state.groups.size()) > keep) {
    for (const CpAsync& c : t_state.groups.front()) {
      if (c.valid) {
        std::memcpy(c.dst, c.src, c.bytes);
      } else {
        std::memset(c.dst, 0, c.bytes);
      }
    }
    t_state.groups.pop_front();
  }
}

// ldmatrix .x4: lanes 8i..8i+7 give row addresses of matrix i (8 b16 each).
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
  Warp::Slots& s = next_slots();
  if (addr % 16 != 0) {
    std::fprintf(stderr, "ldmatrix: misaligned row address %u\n", addr);
    std::abort();
  }
  s.addr[t_state.lane] = addr;
  warp_sync();
  const int lane = t_state.lane, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    auto elem = [&](int row, int col) {
      uint16_t v;
      std::memcpy(&v, shared_ptr(s.addr[8 * i + row]) + 2 * col, 2);
      return v;
    };
    if (!trans) {
      lo = elem(g, 2 * t);
      hi = elem(g, 2 * t + 1);
    } else {
      lo = elem(2 * t, g);
      hi = elem(2 * t + 1, g);
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

// mma.sync m16n8k16 row.col f32.bf16.bf16.f32 with the PTX fragment layouts.
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Warp::Slots& s = next_slots();
  const int lane = t_state.lane;
  for (int i = 0; i < 4; ++i) s.a[lane][i] = a[i];
  s.b[lane][0] = b0;
  s.b[lane][1] = b1;
  warp_sync();
  auto half = [](uint32_t v, int h) { return emu_bf16_to_float(static_cast<uint16_t>(v >> (16 * h))); };
  auto A = [&](int row, int k) {  // row 0..15, k 0..15
    const int g = row % 8, t = (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half(s.a[g * 4 + t][reg], k % 2);
  };
  auto B = [&](int k, int n) {  // k 0..15, n 0..7
    const int t = (k % 8) / 2;
    return half(s.b[n * 4 + t][k >= 8 ? 1 : 0], k % 2);
  };
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e % 2);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    c[e] = acc;
  }
}

inline float shfl_xor(float v, int mask) {
  Warp::Slots& s = next_slots();
  s.f[t_state.lane] = v;
  warp_sync();
  return s.f[t_state.lane ^ mask];
}

inline uint8_t* dynamic_smem() { return t_state.smem + kSharedBase; }

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t,
            Args... args) {
  const unsigned nthreads = block.x * block.y * block.z;
  if (nthreads % 32 != 0 || smem_bytes > 227 * 1024) {
    g_last_error = cudaErrorLaunchFailure;
    return;
  }
  std::vector<uint8_t> smem(kSharedBase + smem_bytes + 64);
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        // Fill with a NaN pattern each CTA: reading shared memory nothing wrote shows up.
        std::memset(smem.data(), 0xFF, smem.size());
        std::vector<std::unique_ptr<Warp>> warps;
        for (unsigned w = 0; w < nthreads / 32; ++w) warps.push_back(std::make_unique<Warp>());
        std::barrier<> cta(nthreads);
        std::vector<std::thread> threads;
        threads.reserve(nthreads);
        for (unsigned i = 0; i < nthreads; ++i) {
          threads.emplace_back([&, i] {
            ThreadState& st = t_state;
            st = ThreadState{};
            st.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
            st.bid = {bx, by, bz};
            st.bdim = block;
            st.gdim = grid;
            st.smem = smem.data();
            st.warp = warps[i / 32].get();
            st.cta = &cta;
            st.lane = static_cast<int>(i % 32);
            kernel(args...);
            if (!st.pending.empty() || !st.groups.empty()) cp_async_wait(0);
          });
        }
        for (auto& th : threads) th.join();
      }
    }
  }
}

}  // namespace emu

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::g_last_error;
  emu::g_last_error = cudaSuccess;
  return e;
}

#define threadIdx (emu::t_state.tid)
#define blockIdx (emu::t_state.bid)
#define blockDim (emu::t_state.bdim)
#define gridDim (emu::t_state.gdim)

inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<size_t>(static_cast<const uint8_t*>(p) - emu::t_state.smem);
}
inline void __syncthreads() { emu::t_state.cta->arrive_and_wait(); }
inline void __syncwarp() { emu::warp_sync(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) { return emu::shfl_xor(v, mask); }
inline float2 atomicAdd(float2* p, float2 v) {
  std::lock_guard<std::mutex> lock(emu::g_atomic_mutex);
  const float2 old = *p;
  p->x += v.x;
  p->y += v.y;
  return old;
}
using std::max;
using std::min;
