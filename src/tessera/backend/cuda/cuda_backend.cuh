#pragma once
// The CUDA backend: the op API on one GPU. Every op is queued on the backend's own stream
// and returns at once; download() and synchronize() wait. Each do_<op> checks its dtypes (the
// facade, ops/backend.cpp, has checked placement and shapes), then calls the launcher of its
// kernel family (rmsnorm.cuh, ...), which opens an NVTX range named after the op and launches
// the kernels.
//
// Dtypes: bf16 is the performance path; every op also takes fp32 compute tensors (tests,
// references), except attention, which is bf16 only. Statistics, weight gradients and
// optimizer state are fp32, as in ops/backend.h.
//
// Memory: allocations go straight to cudaMalloc (the model and optimizer allocate a few
// large buffers once), with accounting of live and peak bytes. Kernel scratch (partial
// sums, sort buffers, attention backward) is one buffer that grows on demand; the cuBLASLt
// workspace is another. Both count in memory_stats().
//
// Attention runs on Tessera's own kernels (attention.cuh: the flash kernels for head_dim 64 and
// 128; attention_rowwise.cuh for every other shape, such as multi-latent attention's narrower
// value heads) or on cuDNN's fused SDPA (cudnn_attention.cuh), chosen by
// TrainingConfig::attention_backend:
//   tessera  always Tessera's kernels; cuDNN is never loaded.
//   cudnn    cuDNN (9.14 or newer) must load when the backend is made (make_cuda_backend throws
//            ConfigError otherwise), and every attention call must get a cuDNN plan for its
//            shape with 16-byte aligned buffers, else ConfigError naming the shape and cuDNN's
//            reason. Never falls back.
//   auto     Tessera's warpgroup kernels where they run (bf16 at head_dim 128 on an sm_90a
//            build; the deterministic backward excepted), at cuDNN's pace or ahead of it there.
//            Otherwise cuDNN when it loads and, per shape and direction, builds a plan (first
//            use, then cached) and the buffers are 16-byte aligned; otherwise Tessera's kernels,
//            with a one-line note on stderr the first time a shape falls back. Forward and backward
//            decide independently: both read and write the same out/lse, so a cuDNN forward
//            may feed a Tessera backward and vice versa.
// cuDNN's backward accumulates dQ with fp32 atomics (its default, fastest algorithm): bitwise
// reproducible only while at most two key tiles meet in a dQ row.
//
// Used from one host thread at a time (the trainer's); only the allocation table is locked.
#include <initializer_list>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/cuda/adamw.cuh"
#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/matmul.cuh"
#include "tessera/backend/cuda/vendor.h"
#include "tessera/config/config.h"
#include "tessera/ops/allocation_tracker.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

class CudnnAttention;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device, const BackendOptions& options = {});
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device{DeviceKind::GPU, device_}; }
  std::string_view name() const override { return "cuda"; }
  std::string description() const override;
  bool supports(Capability c) const override;
  int64_t fp8_gemm_multiple() const override { return kFp8GemmMultiple; }
  // 256 rows: under 3% of an 8192-token batch's head padded on average, a few tuned shapes.
  int64_t varying_gemm_rows_multiple() const override { return 256; }
  bool grouped_matmul_reads_device_offsets(DType dtype, int64_t rows,
                                           int64_t groups) const override;
  StreamHandle stream() const override { return StreamHandle{stream_}; }
  // Whether cuDNN attention is loaded (attention_backend cudnn or auto), and why not.
  bool cudnn_attention_loaded() const { return cudnn_ != nullptr; }
  const std::string& cudnn_unavailable_reason() const { return cudnn_unavailable_; }

  void* allocate(size_t bytes, const char* what) override;
  void release(void* ptr) override;
  void* allocate_host(size_t bytes, const char* what) override;
  void release_host(void* ptr) override;
  // count_foreign_allocation / uncount_foreign_allocation (cuda_backend.h).
  void count_foreign(void* ptr, size_t bytes);
  void uncount_foreign(void* ptr);
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;
  void synchronize() override;

  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event) override;
  void wait_event(EventHandle event) override;
  double elapsed_ms(EventHandle start, EventHandle end) override;

 protected:
  void do_upload(const Tensor& dst, const void* host_src) override;
  void do_download(void* host_dst, const Tensor& src) override;
  void do_copy(const Tensor& dst, const Tensor& src) override;
  std::unique_ptr<CapturedWork> do_capture(const std::function<void()>& work) override;
  void do_range_push(const char* name) override;
  void do_range_pop() override;

  // Every op of the table (ops/op_table.inc).
#define TS_OP TESSERA_OP_DECLARE_OVERRIDE
#include "tessera/ops/op_table.inc"

 private:
  // At least `bytes` of device scratch, valid until the next call (ops run in stream order,
  // so one op's scratch is free again when the next op starts).
  void* scratch(size_t bytes);
  // The FP8 scale slots with room for `weight_slots` weight scales (allocated, or grown).
  float* fp8_scale_slots(int64_t weight_slots);
  // A tensor scale cuBLASLt can read: `scale` itself when 16-byte aligned, else slot `slot`
  // (0 or 1) of fp8_scale_slots_ after a copy queued on the stream.
  const float* aligned_fp8_scale(const float* scale, int slot);
  // `count` consecutive weight scales copied (one strided copy queued on the stream) into
  // 16-byte slots: scale w at the result + 4 * w. Call before aligned_fp8_scale for the same
  // GEMMs: growing the slots moves them.
  const float* aligned_fp8_weight_scales(const float* scales, int64_t count);
  // The attention rule above for one call: true = cuDNN, false = Tessera's kernels; throws
  // ConfigError under attention_backend cudnn when cuDNN cannot take the call.
  bool use_cudnn_attention(const AttentionShape& s, bool backward,
                           std::initializer_list<const void*> buffers);
  // Under auto: remembers that `key` ("forward B=.. T=..") runs on Tessera's kernels and says
  // why on stderr; under cudnn: throws ConfigError.
  void cudnn_attention_fallback(const std::string& key, const std::string& why);
  // attention_forward(_cast) with s.fp8 (codes.out undefined: no output codes).
  void attention_forward_fp8(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                             const AttentionShape& s, const Fp8CastArgs& codes);
  // Device copy of the chunk table for these segments, rebuilt only when they change.
  const AdamWChunk* adamw_chunk_table(std::span<const ParamSegment> segments, int64_t params,
                                      int64_t* count);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;

  AllocationTracker allocations_;
  std::set<void*> foreign_;  // counted in allocations_, freed by whoever allocated them

  void* scratch_ = nullptr;
  // Two 256-byte slots that FP8 GEMM scales are copied to when theirs are not 16-byte aligned
  // (cuBLASLt refuses every FP8 algorithm for such scale pointers), then fp8_weight_slots_
  // 16-byte slots for a grouped GEMM's weight scales.
  float* fp8_scale_slots_ = nullptr;
  int64_t fp8_weight_slots_ = 0;
  size_t scratch_bytes_ = 0;
  uint64_t scratch_moves_ = 0;  // how often scratch_ was reallocated (CudaGraphWork's validity)
  void* lt_workspace_ = nullptr;
  std::unique_ptr<LtMatmul> lt_;

  AttentionBackend attention_ = AttentionBackend::Auto;
  bool deterministic_ = false;  // BackendOptions::deterministic
  std::unique_ptr<CudnnAttention> cudnn_;  // null: Tessera's kernels only
  std::string cudnn_unavailable_;          // why cudnn_ is null under auto/cudnn
  std::set<std::string> attention_fallbacks_;  // "direction shape" that run on Tessera's (auto)

  std::vector<ParamSegment> adamw_segments_;  // what the device chunk table was built from
  int64_t adamw_params_ = -1;
  std::vector<AdamWChunk> adamw_chunks_;
  AdamWChunk* adamw_chunks_device_ = nullptr;
  size_t adamw_chunks_capacity_ = 0;  // entries

  bool fp8_tensor_cores_ = false;    // compute capability 8.9 or newer
  bool fp8_block_scaling_ = false;   // Hopper with a cuBLASLt of 12.9 or newer loaded
  std::vector<cudaEvent_t> events_;  // every event made and not destroyed, freed with us
};

}  // namespace tessera::cuda
