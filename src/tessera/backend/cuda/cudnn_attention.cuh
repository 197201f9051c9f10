#pragma once
// cuDNN's fused flash attention (SDPA) through the cuDNN backend graph API, as an alternative to
// Tessera's own kernels (attention.cuh), with the same op contract (ops/backend.h):
//   qkv (B, T, (H + KV) * D + KV * Dv) bf16: per token H query heads, KV key heads, KV value
//   heads (Dv = D but in multi-latent attention);
//   out (B, T, H*Dv) bf16; lse (B, H, T) fp32, natural-log log-sum-exp of the scaled, masked
//   scores; causal and/or sliding window (query i sees key j iff i - window < j [<= i]);
//   backward overwrites dqkv.
//
// Q, K, V, O, dO, dQ, dK, dV are strided BSHD views straight into the packed buffers (no copies):
// Q (B, H, T, D) strides (T*W, D, W, 1) with W the qkv width, K the same with KV heads at offset
// H*D, V (B, KV, T, Dv) strides (T*W, Dv, W, 1) at (H + KV)*D; O and dO (B, H, T, Dv) strides
// (T*H*Dv, Dv, H*Dv, 1). cuDNN's softmax
// statistics output is max + log(sum exp) of the scaled scores, natural log, (B, H, T, 1) fp32
// contiguous: exactly Tessera's lse, so the lse buffer is passed to cuDNN as is, and a forward of
// one implementation can feed the backward of the other.
//
// The graphs are the ones cudnn-frontend's composite SDPA nodes build for cuDNN 9.14-9.20
// (matmul, pointwise, reduction and reshape operations that cuDNN fuses into one flash engine);
// cudnn_attention.cu lists every node. cuDNN is loaded at run time (dlopen of libcudnn.so.9), so
// binaries start and fall back to Tessera's kernels on machines without it; the loaded version
// must be 9.14 or newer (cudnnGetVersion()).
//
// Plans (operation graph, engine config from heuristics mode A, execution plan, workspace size)
// are built on first use of a shape and cached, including "not supported" answers. Include from
// .cu files only (cudaStream_t).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

struct CudnnAttentionOptions {
  // Backward: false (default) accumulates dQ in an fp32 workspace with atomics (cuDNN's default
  // and fastest algorithm; summation order may vary run to run when more than two key tiles
  // contribute to a row). true asks for cuDNN's deterministic algorithm (the frontend's
  // set_deterministic_algorithm(true): dQ written directly, no fp32 accumulator).
  bool deterministic = false;
};

// What building the plan for one shape gave.
struct CudnnPlanInfo {
  bool supported = false;
  std::string reason;           // why not, when !supported: the step, the cuDNN status and message
  int64_t engine = -1;          // cuDNN global engine index of the chosen engine config
  std::string notes;            // engine behavior/numerical notes, e.g. "runtime-compiled"
  size_t workspace_bytes = 0;   // device scratch execute() needs (Tessera's part + cuDNN's)
  double build_ms = 0;          // host time to build the graph and the plan
  int graph_ops = 0;            // operations in the graph
};

// The part of a backward plan's workspace that Tessera lays out in front of the engine's own:
// the softmax sums (B, H, T) fp32, without `deterministic` the dQ accumulator (B, H, T, D) fp32,
// and for T % 128 != 0 the sequence-length arrays; the engine's part follows it (its size is
// known once a plan is built, CudnnPlanInfo::workspace_bytes).
size_t cudnn_backward_tessera_workspace_bytes(const AttentionShape& s, bool deterministic);

class CudnnAttention {
 public:
  // Loads cuDNN and creates a handle bound to `stream` on the current device. Returns nullptr
  // and sets *why when cuDNN cannot be used here (library not found, version below 9.14,
  // handle creation failed). The library search: $TESSERA_CUDNN_LIBRARY if set, then
  // libcudnn.so.9 through the dynamic loader (LD_LIBRARY_PATH).
  static std::unique_ptr<CudnnAttention> create(cudaStream_t stream, std::string* why);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  size_t version() const;           // cudnnGetVersion(), e.g. 91500
  std::string version_string() const;  // "9.15.0"
  std::string library_path() const;    // the file the loader picked

  // The plan for a shape, built on first use (seconds at most; cuDNN may compile kernels at run
  // time) and cached. Never throws for unsupported shapes: see supported/reason.
  const CudnnPlanInfo& forward_plan(const AttentionShape& s);
  const CudnnPlanInfo& backward_plan(const AttentionShape& s, const CudnnAttentionOptions& o = {});

  // Run on the stream given at creation. The plan must be supported (else InternalError with the
  // reason); workspace: at least the plan's workspace_bytes of device memory, 256-byte aligned
  // (may be null when that is 0). Every pointer must be 16-byte aligned (aligned16). A failing
  // cuDNN call throws InternalError naming the call and cuDNN's status and message.
  void forward(void* out, float* lse, const void* qkv, const AttentionShape& s, void* workspace);
  void backward(void* dqkv, const void* dout, const void* out, const float* lse, const void* qkv,
                const AttentionShape& s, void* workspace, const CudnnAttentionOptions& o = {});

  static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

  struct Impl;

 private:
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::cuda
