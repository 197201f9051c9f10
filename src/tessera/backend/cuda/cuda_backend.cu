#include "tessera/backend/cuda/cuda_backend.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "tessera/backend/cpu/reference.h"
#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/attention_decode.cuh"
#include "tessera/backend/cuda/attention_gathered.cuh"
#include "tessera/backend/cuda/attention_rowwise.cuh"
#include "tessera/backend/cuda/cross_entropy.cuh"
#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/cudnn_attention.cuh"
#include "tessera/backend/cuda/elementwise.cuh"
#include "tessera/backend/cuda/embedding.cuh"
#include "tessera/backend/cuda/fp8_cast.cuh"
#include "tessera/backend/cuda/grouped_matmul_hopper.cuh"
#include "tessera/backend/cuda/mla.cuh"
#include "tessera/backend/cuda/moe.cuh"
#include "tessera/backend/cuda/reduce.cuh"
#include "tessera/backend/cuda/rmsnorm.cuh"
#include "tessera/backend/cuda/rope.cuh"
#include "tessera/backend/cuda/sampling.cuh"
#include "tessera/backend/cuda/swiglu.cuh"
#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/error.h"
#include "tessera/ops/op_checks.h"

namespace tessera::cuda {

namespace {

// cuBLASLt's recommended workspace for Hopper: enough for its split-K and stream-K kernels.
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
// Scratch grows in steps of this size, so that slightly larger requests do not reallocate.
constexpr size_t kScratchGranule = size_t{1} << 20;
// Where FP8 GEMM scales that are not 16-byte aligned are copied for cuBLASLt: two 256-byte
// tensor-scale slots (a, b), then one 16-byte slot per weight of a grouped GEMM, first
// allocated with room for kFp8PlannedWeightSlots (DeepSeek-V3's 256 routed experts: every
// preset's experts on one rank) and grown past that by the grouped GEMM that needs more.
constexpr size_t kFp8TensorSlotFloats = 64;
constexpr size_t kFp8WeightSlotFloats = 4;
constexpr int64_t kFp8PlannedWeightSlots = 256;
constexpr size_t fp8_scale_slot_bytes(int64_t weight_slots) {
  return (2 * kFp8TensorSlotFloats + kFp8WeightSlotFloats * static_cast<size_t>(weight_slots)) *
         sizeof(float);
}
constexpr size_t kFp8ScaleSlotBytes = fp8_scale_slot_bytes(kFp8PlannedWeightSlots);

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB",
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// The kernels read freqs row t % seq for token row t: a row per token is one sequence of them.
RopeShape rope_shape(const AttentionShape& s) {
  if (s.rope_per_token)
    return RopeShape{1, s.tokens(), s.heads, s.kv_heads, s.head_dim, s.qkv_width()};
  return RopeShape{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.qkv_width()};
}

std::string attention_shape_text(const AttentionShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq) +
         " H=" + std::to_string(s.heads) + " KV=" + std::to_string(s.kv_heads) +
         " D=" + std::to_string(s.head_dim) +
         (s.v_dim() != s.head_dim ? " Dv=" + std::to_string(s.v_dim()) : std::string()) +
         (s.causal ? " causal" : " full") +
         (s.window > 0 ? " window " + std::to_string(s.window) : std::string());
}

// Tessera's flash kernels (attention.cuh) take head_dim 64 or 128 with values as wide; every
// other shape runs on the row-wise kernels (attention_rowwise.cuh) when cuDNN does not take it.
bool flash_kernels_take(const AttentionShape& s) {
  return (s.head_dim == 64 || s.head_dim == 128) && s.v_dim() == s.head_dim;
}

cuda::MlaQkvView mla_view(const MlaQkvArgs& a) {
  cuda::MlaQkvView v;
  const size_t e = dtype_size(a.qkv.dtype);
  v.qkv = a.qkv.data;
  v.q = static_cast<char*>(a.q.data) + a.q_col * e;
  v.q_stride = matrix_dims(a.q).cols;
  v.k_rope = static_cast<char*>(a.k_rope.data) + a.k_col * e;
  v.k_stride = matrix_dims(a.k_rope).cols;
  v.kv = a.kv.data;
  v.freqs = a.freqs.as<float>();
  v.s = a.s;
  v.rope_dim = a.rope_dim;
  return v;
}

// Calls f(g, begin, rows, w) for each row group g of a grouped GEMM with rows: [begin, begin +
// rows) of the host offsets, multiplied by weight w (group_weights[g], or g).
template <class F>
void for_each_row_group(std::span<const int32_t> offsets, std::span<const int32_t> weights, F&& f) {
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    if (rows > 0) f(static_cast<int64_t>(g), begin, rows, weights.empty() ? g : weights[g]);
  }
}

// A grouped weight gradient's weights (W, M, N) that no group wrote (started[w] 0): beta times
// what they hold, i.e. zeroed, kept or (fp32 only) scaled.
void finish_unwritten_weights(const char* op, const Tensor& out, const std::vector<char>& started,
                              float beta, cudaStream_t stream) {
  const int64_t elems = out.numel() / out.dim(0);
  const size_t bytes = elems * dtype_size(out.dtype);
  for (size_t w = 0; w < started.size(); ++w) {
    if (started[w]) continue;
    char* weight = static_cast<char*>(out.data) + w * bytes;
    if (beta == 0.0f) {
      TS_CUDA_CHECK(cudaMemsetAsync(weight, 0, bytes, stream));
    } else if (beta != 1.0f) {
      TS_CHECK(out.dtype == DType::F32, "cuda {}: beta {} on a {} weight without rows (fp32 only)",
               op, beta, dtype_name(out.dtype));
      scale_floats(reinterpret_cast<float*>(weight), elems, beta, stream);
    }
  }
}

// Rows [used, rows) of a grouped GEMM's output, which no group covers, zeroed.
void zero_rows_past_groups(const Tensor& out, int64_t used, cudaStream_t stream) {
  const MatrixDims o = matrix_dims(out);
  const size_t row_bytes = o.cols * dtype_size(out.dtype);
  if (used < o.rows)
    TS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(out.data) + used * row_bytes, 0,
                                  (o.rows - used) * row_bytes, stream));
}

}  // namespace

// ---- ranges and events ----

void CudaBackend::do_range_push(const char* name) {
  nvtxRangePushA(name);
}

void CudaBackend::do_range_pop() {
  nvtxRangePop();
}

EventHandle CudaBackend::create_event() {
  cudaEvent_t e = nullptr;
  TS_CUDA_CHECK(cudaEventCreate(&e));
  events_.push_back(e);
  return EventHandle{e};
}

void CudaBackend::destroy_event(EventHandle event) {
  auto e = static_cast<cudaEvent_t>(event.native);
  events_.erase(std::find(events_.begin(), events_.end(), e));
  cudaEventDestroy(e);
}

void CudaBackend::record_event(EventHandle event) {
  TS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event.native), stream_));
}

void CudaBackend::wait_event(EventHandle event) {
  TS_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event.native), 0));
}

double CudaBackend::elapsed_ms(EventHandle start, EventHandle end) {
  TS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end.native)));
  float ms = 0;
  TS_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.native),
                                     static_cast<cudaEvent_t>(end.native)));
  return ms;
}

bool CudaBackend::supports(Capability c) const {
  switch (c) {
    case Capability::Bf16Compute:
    case Capability::AsyncQueue:
      return true;
    case Capability::Fp8TensorCores:
      return fp8_tensor_cores_;
    case Capability::Fp8BlockScaling:
      return fp8_block_scaling_;
    case Capability::PackedSequences:  // Tessera's attention kernels; cuDNN's are not used for them
    case Capability::CapturesWork:
      return true;
    case Capability::Fp8Attention:  // the warpgroup forward's FP8 form
      return attention_hopper_available(128, device_);
  }
  return false;
}

// ---- lifetime ----

CudaBackend::CudaBackend(int device, const BackendOptions& options)
    : device_(device), attention_(options.attention), deterministic_(options.deterministic) {
  TS_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  fp8_tensor_cores_ = prop.major * 10 + prop.minor >= 89;  // Ada (8.9) and Hopper (9.0) on
  // cuBLASLt's 1x128 / 128x128 block-scaled FP8 kernels are Hopper's (Blackwell scales FP8 by
  // 32-element MX blocks instead) and came with cuBLAS 12.9: the library loaded at run time
  // decides, whatever the headers this was built with.
  fp8_block_scaling_ = prop.major == 9 && lt_block_scaling_available();
  // Non-blocking: our stream never waits for work others put on the legacy default stream.
  TS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  lt_workspace_ = allocate(kLtWorkspaceBytes, "cuBLASLt workspace");
  lt_ = std::make_unique<LtMatmul>(lt_workspace_, kLtWorkspaceBytes, options.gemm_autotune);
  if (attention_ != AttentionBackend::Tessera) {
    cudnn_ = CudnnAttention::create(stream_, &cudnn_unavailable_);
    static bool reported = false;  // once per process: tests make many backends
    if (cudnn_ == nullptr && attention_ == AttentionBackend::Auto && !reported) {
      reported = true;
      std::fprintf(stderr,
                   "tessera: attention_backend auto: using Tessera's attention kernels: %s\n",
                   cudnn_unavailable_.c_str());
    }
  }
}

CudaBackend::~CudaBackend() {
  // No throwing here: errors at teardown (e.g. after a device fault) are ignored.
  if (stream_) cudaStreamSynchronize(stream_);
  cudnn_.reset();
  lt_.reset();
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  allocations_.release_all([this](void* ptr) {
    if (!foreign_.contains(ptr)) cudaFree(ptr);
  });
  if (stream_) cudaStreamDestroy(stream_);
}

std::string CudaBackend::description() const {
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  int driver = 0, runtime = 0;
  TS_CUDA_CHECK(cudaDriverGetVersion(&driver));
  TS_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const size_t lt = cublasLtGetVersion();  // e.g. 130100 = 13.1.0
  // Which of Tessera's flash kernels run here: warpgroup MMAs (sm_90a builds on sm_90) at
  // head_dim 128, warp MMAs otherwise.
  const bool warpgroup = attention_hopper_available(128, device_);
  std::string attention = warpgroup ? "Tessera kernels (warpgroup MMAs at head_dim 128)"
                                    : "Tessera kernels (warp MMAs)";
  if (cudnn_ != nullptr && attention_ == AttentionBackend::Auto && warpgroup) {
    // use_cudnn_attention's rule: the deterministic backward goes to cuDNN at head_dim 128 too.
    attention += ", cuDNN " + cudnn_->version_string() +
                 (deterministic_ ? " for the backward and other shapes (auto)" : " for other shapes (auto)");
  } else if (cudnn_ != nullptr) {
    attention = "cuDNN " + cudnn_->version_string() +
                (attention_ == AttentionBackend::Auto ? " (auto)" : "");
  } else if (attention_ == AttentionBackend::Auto) {
    attention += " (auto: cuDNN not loaded)";
  }
  if (deterministic_) attention += ", deterministic backward";
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ", " + std::to_string(prop.multiProcessorCount) + " SMs, " +
         gib(prop.totalGlobalMem) + ", driver " + version_string(driver) + ", runtime " +
         version_string(runtime) + ", cuBLASLt " + std::to_string(lt / 10000) + "." +
         std::to_string((lt / 100) % 100) + "." + std::to_string(lt % 100) +
         ", attention: " + attention + ")";
}

// ---- memory ----

void* CudaBackend::allocate(size_t bytes, const char* what) {
  void* ptr = nullptr;
  // A zero-byte request still gets a unique pointer, so that release() stays symmetric.
  const cudaError_t error = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the error so the next runtime call does not report it
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    const size_t held = allocations_.allocated();
    throw OutOfMemoryError("out of GPU memory on " + device_name(device()) + " allocating " +
                           (what != nullptr ? what : "a buffer") + ": " + std::to_string(bytes) +
                           " bytes (" + gib(bytes) + ") requested, " + std::to_string(free_bytes) +
                           " bytes (" + gib(free_bytes) + ") free of " + gib(total_bytes) +
                           ", of which Tessera already holds " + gib(held) +
                           "; reduce micro_batch_size or seq_length, or set recompute_granularity");
  }
  TS_CUDA_CHECK(error);
  allocations_.add(ptr, bytes);
  return ptr;
}

void CudaBackend::release(void* ptr) {
  if (ptr == nullptr) return;
  allocations_.remove(ptr);
  // cudaFree waits for the device, so no queued kernel still uses the memory. Its error is
  // not thrown: releases run in destructors, also while the exception of a device fault
  // unwinds, and a fault is sticky, so the call that hit it has reported it already.
  cudaFree(ptr);
}

// Page-locked, so that copies to and from the device run at the link's rate rather than
// through the driver's staging of pageable memory (about 2.6 GB/s measured for GRPO's moments).
void* CudaBackend::allocate_host(size_t bytes, const char* what) {
  void* ptr = nullptr;
  const cudaError_t error = cudaMallocHost(&ptr, std::max<size_t>(bytes, 1));
  if (error != cudaSuccess) {
    cudaGetLastError();
    throw OutOfMemoryError("out of page-locked host memory allocating " + std::string(what != nullptr ? what : "a buffer") +
                           ": " + std::to_string(bytes) + " bytes (" + gib(bytes) + ") requested");
  }
  return ptr;
}

void CudaBackend::release_host(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

void CudaBackend::count_foreign(void* ptr, size_t bytes) {
  allocations_.add(ptr, bytes);
  foreign_.insert(ptr);
}

void CudaBackend::uncount_foreign(void* ptr) {
  allocations_.remove(ptr);
  foreign_.erase(ptr);
}

void count_foreign_allocation(Backend& backend, void* ptr, size_t bytes) {
  static_cast<CudaBackend&>(backend).count_foreign(ptr, bytes);
}

void uncount_foreign_allocation(Backend& backend, void* ptr) {
  static_cast<CudaBackend&>(backend).uncount_foreign(ptr);
}

MemoryStats CudaBackend::memory_stats() {
  size_t free_bytes = 0, total_bytes = 0;
  TS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return MemoryStats{allocations_.allocated(), allocations_.peak(), total_bytes, free_bytes};
}

void CudaBackend::reset_peak_memory() {
  allocations_.reset_peak();
}

// The old scratch goes before the new one comes (release waits for the device, so no queued
// kernel still reads it): the peak holds one scratch, the size the memory planner counts.
void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    const size_t grown = (bytes + kScratchGranule - 1) / kScratchGranule * kScratchGranule;
    ++scratch_moves_;  // graphs captured before read the old scratch
    release(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    scratch_ = allocate(grown, "kernel scratch");
    scratch_bytes_ = grown;
  }
  return scratch_;
}

namespace {

// A CUDA graph of captured ops, valid while the backend's kernel scratch stays where it was.
class CudaGraphWork final : public CapturedWork {
 public:
  CudaGraphWork(cudaGraphExec_t exec, cudaStream_t stream, const uint64_t* scratch_moves)
      : exec_(exec), stream_(stream), scratch_moves_(scratch_moves), captured_at_(*scratch_moves) {}
  ~CudaGraphWork() override { cudaGraphExecDestroy(exec_); }
  bool replay() override {
    if (*scratch_moves_ != captured_at_) return false;
    TS_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    return true;
  }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  const uint64_t* scratch_moves_;
  uint64_t captured_at_;
};

}  // namespace

// Capture on this thread only (another thread's CUDA calls are not disturbed); work that
// allocates or synchronizes fails here, by name, rather than recording something else.
std::unique_ptr<CapturedWork> CudaBackend::do_capture(const std::function<void()>& work) {
  TS_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    work();
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's error is not the caller's
    throw;
  }
  TS_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TS_CUDA_CHECK(instantiated);
  return std::make_unique<CudaGraphWork>(exec, stream_, &scratch_moves_);
}

void CudaBackend::do_upload(const Tensor& dst, const void* host_src) {
  if (dst.nbytes() == 0) return;
  // From pageable memory the call returns once the source has been staged, so the caller
  // may reuse host_src at once; the device copy itself is ordered on our stream.
  TS_CUDA_CHECK(cudaMemcpyAsync(dst.data, host_src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::do_download(void* host_dst, const Tensor& src) {
  if (src.nbytes() > 0) {
    TS_CUDA_CHECK(
        cudaMemcpyAsync(host_dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost, stream_));
  }
  TS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::do_copy(const Tensor& dst, const Tensor& src) {
  TS_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::synchronize() {
  TS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- elementwise and init ----

void CudaBackend::do_fill(const Tensor& dst, float value) {
  cuda::fill(dst.data, dst.numel(), value, dst.dtype, stream_);
}

void CudaBackend::do_split_master(const Tensor& high, const Tensor& low, const Tensor& master) {
  cuda::split_master(high.data, low.data, master.as<float>(), master.numel(), stream_);
}

void CudaBackend::do_convert(const Tensor& dst, const Tensor& src) {
  if (dst.data == src.data && dst.dtype == src.dtype) return;
  cuda::convert(dst.data, dst.dtype, src.data, src.dtype, src.numel(), stream_);
}

void CudaBackend::do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                                 float std) {
  cuda::init_normal(dst.data, dst.numel(), seed, first_index, mean, std, dst.dtype, stream_);
}

// ---- linear algebra ----

void CudaBackend::do_matmul(const MatmulArgs& args) {
  TS_CHECK(args.a.dtype == DType::BF16 || args.out.dtype == DType::F32,
           "cuda matmul: fp32 a/b need an fp32 out, got {}", dtype_name(args.out.dtype));
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;

  MatmulProblem p;
  p.out = args.out.data;
  p.out_dtype = args.out.dtype;
  p.a = args.a.data;
  p.b = args.b.data;
  p.a_dtype = p.b_dtype = args.a.dtype;
  if (args.c.defined() && args.c.data != args.out.data) {
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    p.bias = args.bias.data;
    p.bias_dtype = args.bias.dtype;
  }
  p.M = M, p.N = N, p.K = K;
  p.trans_a = args.trans_a, p.trans_b = args.trans_b;
  p.alpha = args.alpha, p.beta = args.beta;
  lt_->run(p, stream_);
}

void CudaBackend::do_bias_backward(const Tensor& dbias, const Tensor& dout) {
  const MatrixDims d = matrix_dims(dout);
  const size_t bytes = bias_backward_scratch_bytes(d.rows, d.cols);
  cuda::bias_backward(dbias.data, dbias.dtype, dout.data, d.rows, d.cols, dout.dtype,
                      scratch(bytes), bytes, stream_);
}

// ---- FP8 ----

namespace {

// What an FP8 cast writes: codes in `format` when it casts (e4m3, unused, when it only takes
// the amax).
struct Fp8CastTarget {
  DType format;
  bool cast;
};

template <class Args>
Fp8CastTarget fp8_cast_target(const Args& args) {
  const Fp8CastTarget t{args.out.defined()     ? args.out.dtype
                        : args.out_t.defined() ? args.out_t.dtype
                                               : DType::E4M3,
                        args.out.defined() || args.out_t.defined()};
  return t;
}

}  // namespace

void CudaBackend::do_fp8_cast_transpose(const Fp8CastArgs& args) {
  const auto [format, cast] = fp8_cast_target(args);
  const MatrixDims d = matrix_dims(args.x);
  cuda::fp8_cast_transpose(args.x.data, args.x.dtype, d.rows, d.cols,
                           cast ? args.scale.as<float>() : nullptr, args.out.data, args.out_t.data,
                           format, args.amax.defined() ? args.amax.as<float>() : nullptr, stream_);
}

void CudaBackend::do_fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  const auto [format, cast] = fp8_cast_target(args);
  const MatrixDims d = matrix_dims(args.x);
  int64_t G = 0;
  if (args.group_rows > 0) {
    G = d.rows / args.group_rows;
  } else {
    G = args.offsets.numel() - 1;
  }
  cuda::fp8_grouped_cast(args.x.data, args.x.dtype, d.rows, d.cols, args.group_rows,
                         args.group_rows > 0 ? nullptr : args.offsets.as<int32_t>(), G,
                         cast ? args.scale.as<float>() : nullptr, cast && args.scale.numel() > 1,
                         args.out.data, args.out_t.data, format,
                         args.amax.defined() ? args.amax.as<float>() : nullptr,
                         args.amax.defined() && args.amax.numel() > 1, stream_);
}

void CudaBackend::do_matmul_fp8(const Fp8MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = a.cols;
  // cuBLASLt's FP8 kernels need 16-byte aligned operands and leading dimensions.
  TS_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0,
           "cuda matmul_fp8: M={} N={} K={} must all be multiples of 16 for cuBLASLt FP8", M, N, K);
  for (const Tensor* t : {&args.out, &args.a, &args.b})
    TS_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
             "cuda matmul_fp8: an operand at {} is not 16-byte aligned", t->data);
  MatmulProblem p;
  p.out = args.out.data;
  p.out_dtype = args.out.dtype;
  p.a = args.a.data;
  p.b = args.b.data;
  p.a_dtype = args.a.dtype;
  p.b_dtype = args.b.dtype;
  if (args.c.defined() && args.c.data != args.out.data) {
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    p.bias = args.bias.data;
    p.bias_dtype = args.bias.dtype;
  }
  p.M = M, p.N = N, p.K = K;
  p.trans_a = false, p.trans_b = true;
  p.alpha = args.alpha, p.beta = args.beta;
  p.a_scale = args.a_scale_inv.as<float>();
  p.b_scale = args.b_scale_inv.as<float>();
  p.a_scaling = args.a_scaling;
  p.b_scaling = args.b_scaling;
  if (p.a_scaling != Fp8Scaling::Tensor || p.b_scaling != Fp8Scaling::Tensor) {
    TS_CHECK(fp8_block_scaling_,
             "cuda matmul_fp8: block scales need a Hopper GPU and cuBLASLt 12.9 or newer; this "
             "process loaded cuBLASLt {} on {}",
             lt_version_string(), description());
    TS_CHECK(M % 128 == 0 && N % 128 == 0 && K % 128 == 0,
             "cuda matmul_fp8: block-scaled M={} N={} K={} must be multiples of 128", M, N, K);
  }
  // Block scales are arrays whose every tile is written by the cast: only tensor scales
  // (single values inside a state buffer) are moved to an aligned slot.
  if (p.a_scaling == Fp8Scaling::Tensor) p.a_scale = aligned_fp8_scale(p.a_scale, 0);
  if (p.b_scaling == Fp8Scaling::Tensor) p.b_scale = aligned_fp8_scale(p.b_scale, 1);
  p.fast_accum = args.fast_accum;
  lt_->run(p, stream_);
}

float* CudaBackend::fp8_scale_slots(int64_t weight_slots) {
  if (fp8_scale_slots_ != nullptr && weight_slots <= fp8_weight_slots_) return fp8_scale_slots_;
  // release() waits for the device: no queued GEMM still reads the old slots.
  release(fp8_scale_slots_);
  fp8_scale_slots_ = nullptr;
  fp8_weight_slots_ = std::max(weight_slots, kFp8PlannedWeightSlots);
  fp8_scale_slots_ =
      static_cast<float*>(allocate(fp8_scale_slot_bytes(fp8_weight_slots_), "fp8 gemm scales"));
  return fp8_scale_slots_;
}

const float* CudaBackend::aligned_fp8_scale(const float* scale, int slot) {
  if (reinterpret_cast<uintptr_t>(scale) % 16 == 0) return scale;
  // Stream order keeps the slot's value until the GEMMs queued before the next copy have
  // read it.
  float* aligned = fp8_scale_slots(0) + kFp8TensorSlotFloats * slot;
  TS_CUDA_CHECK(cudaMemcpyAsync(aligned, scale, sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  return aligned;
}

const float* CudaBackend::aligned_fp8_weight_scales(const float* scales, int64_t count) {
  float* aligned = fp8_scale_slots(count) + 2 * kFp8TensorSlotFloats;
  // One strided copy: scale w lands at aligned[kFp8WeightSlotFloats * w].
  TS_CUDA_CHECK(cudaMemcpy2DAsync(aligned, kFp8WeightSlotFloats * sizeof(float), scales,
                                  sizeof(float), sizeof(float), static_cast<size_t>(count),
                                  cudaMemcpyDeviceToDevice, stream_));
  return aligned;
}

void CudaBackend::do_fp8_block_cast(const Fp8BlockCastArgs& args) {
  const MatrixDims d = matrix_dims(args.x);
  cuda::fp8_block_cast(args.x.data, args.x.dtype, d.rows, d.cols, args.scaling, args.out.data,
                       args.out.defined() ? args.out_scale_inv.as<float>() : nullptr,
                       args.out_t.data,
                       args.out_t.defined() ? args.out_t_scale_inv.as<float>() : nullptr,
                       args.out.defined() ? args.out.dtype : args.out_t.dtype,
                       args.nonfinite.defined() ? args.nonfinite.as<float>() : nullptr, stream_);
}

void CudaBackend::do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const MatrixDims h = matrix_dims(args.amax_history);
  cuda::fp8_update_scales(args.amax_history.as<float>(), h.rows, h.cols, args.scale.as<float>(),
                          args.scale_inv.as<float>(),
                          args.nonfinite.defined() ? args.nonfinite.as<float>() : nullptr,
                          args.fp8_max, args.margin, args.most_recent, args.roll, stream_);
}

// ---- model ops ----

void CudaBackend::do_embedding_forward(const Tensor& out, const Tensor& tokens,
                                       const Tensor& table) {
  const MatrixDims t = matrix_dims(table);
  const int64_t N = tokens.numel(), C = t.cols;
  cuda::embedding_forward(out.data, tokens.as<int32_t>(), table.data, N, C, t.rows, table.dtype,
                          stream_);
}

void CudaBackend::do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                                        const Tensor& tokens) {
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel(), C = t.cols;
  const size_t bytes = embedding_backward_scratch_bytes(N);
  cuda::embedding_backward(dtable.data, dtable.dtype, dout.data, tokens.as<int32_t>(), N, C, t.rows,
                           dout.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                             const Tensor& table, int64_t first_id) {
  const MatrixDims t = matrix_dims(table);
  cuda::embedding_shard_forward(out.data, tokens.as<int32_t>(), table.data, tokens.numel(), t.cols,
                                t.rows, first_id, table.dtype, stream_);
}

void CudaBackend::do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                              const Tensor& tokens, int64_t first_id) {
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel();
  const size_t bytes = embedding_backward_scratch_bytes(N);
  cuda::embedding_shard_backward(dtable.data, dtable.dtype, dout.data, tokens.as<int32_t>(), N,
                                 t.cols, t.rows, first_id, dout.dtype, scratch(bytes), bytes,
                                 stream_);
}

void CudaBackend::do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                     const Tensor& weight, float eps) {
  const MatrixDims d = matrix_dims(x);
  cuda::rmsnorm_forward(out.data, rstd.as<float>(), x.data, weight.data, d.rows, d.cols, eps,
                        x.dtype, stream_);
}

void CudaBackend::do_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                          const Tensor& weight, float eps,
                                          const Fp8CastArgs& codes) {
  const MatrixDims d = matrix_dims(x);
  cuda::rmsnorm_forward_cast(out.data, rstd.as<float>(), codes.out.data, x.data, weight.data,
                             d.rows, d.cols, eps, x.dtype, codes.out.dtype, codes.scale.as<float>(),
                             codes.amax.defined() ? codes.amax.as<float>() : nullptr, stream_);
}

void CudaBackend::do_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x,
                                              const Tensor& rstd, const Tensor& weight,
                                              float /*eps*/) {
  const MatrixDims d = matrix_dims(x);
  cuda::rmsnorm_transposed_codes(codes.out_t.data, x.data, rstd.as<float>(), weight.data, d.rows,
                                 d.cols, x.dtype, codes.out_t.dtype, codes.scale.as<float>(),
                                 stream_);
}

void CudaBackend::do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                      const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  const MatrixDims d = matrix_dims(x);
  const int64_t N = d.rows, C = d.cols;
  const size_t bytes = rmsnorm_backward_scratch_bytes(N, C);
  cuda::rmsnorm_backward(dx.data, dweight.data, dweight.dtype, dout.data, x.data, weight.data,
                         rstd.as<float>(), N, C, x.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  cuda::rope_forward(qkv.data, freqs.as<float>(), rope_shape(s), qkv.dtype, stream_);
}

void CudaBackend::do_rope_backward(const Tensor& dqkv, const Tensor& freqs,
                                   const AttentionShape& s) {
  cuda::rope_backward(dqkv.data, freqs.as<float>(), rope_shape(s), dqkv.dtype, stream_);
}

bool CudaBackend::use_cudnn_attention(const AttentionShape& s, bool backward,
                                      std::initializer_list<const void*> buffers) {
  if (cudnn_ == nullptr) return false;  // attention_backend tessera, or auto without cuDNN
  // Under auto, Tessera's warpgroup kernels keep the shapes they run (bf16 at head_dim 128 on
  // an sm_90a build): there they are at cuDNN's pace or ahead of it (docs/performance.md,
  // 2026-11-29). Not the deterministic backward: cuDNN's is twice as fast as Tessera's.
  if (attention_ == AttentionBackend::Auto && !(backward && deterministic_) && flash_kernels_take(s) &&
      attention_hopper_available(s.head_dim, device_)) {
    return false;
  }
  const std::string key =
      std::string(backward ? "backward " : "forward ") + attention_shape_text(s);
  if (attention_fallbacks_.count(key) != 0) return false;  // auto only: reported before
  const CudnnPlanInfo& plan = backward ? cudnn_->backward_plan(s) : cudnn_->forward_plan(s);
  std::string why = plan.supported ? "" : plan.reason;
  for (const void* p : buffers) {
    if (why.empty() && !CudnnAttention::aligned16(p)) why = "a buffer is not 16-byte aligned";
  }
  if (why.empty()) return true;
  cudnn_attention_fallback(key, why);
  return false;
}

void CudaBackend::cudnn_attention_fallback(const std::string& key, const std::string& why) {
  if (attention_ == AttentionBackend::Vendor) {
    throw ConfigError("configuration", "attention_backend", "cudnn",
                      "auto or tessera: cuDNN " + cudnn_->version_string() +
                          " cannot run the attention " + key + ": " + why);
  }
  attention_fallbacks_.insert(key);
  std::fprintf(stderr, "tessera: attention_backend auto: attention %s on Tessera's kernels: %s\n",
               key.c_str(), why.c_str());
}

// FP8 attention (s.fp8) runs on the warpgroup forward only, bf16 in and out.
void CudaBackend::attention_forward_fp8(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                        const AttentionShape& s, const Fp8CastArgs& codes) {
  const size_t bytes = cuda::attention_fp8_scratch_bytes(s);
  const bool ran = qkv.dtype == DType::BF16 &&
                   cuda::attention_forward_fp8(
                       out.data, lse.as<float>(), qkv.data, s, scratch(bytes), codes.out.data,
                       codes.out.defined() ? codes.out.dtype : DType::E4M3,
                       codes.out.defined() ? codes.scale.as<float>() : nullptr,
                       codes.amax.defined() ? codes.amax.as<float>() : nullptr, stream_);
  if (!ran) {
    throw InternalError(
        "FP8 attention (fp8_dot_product_attention) runs on Hopper GPUs (sm_90a "
        "builds) over bf16 heads of 128; not " +
        attention_shape_text(s) + " in " + std::string(dtype_name(qkv.dtype)));
  }
}

void CudaBackend::do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const AttentionShape& s) {
  if (s.fp8) return attention_forward_fp8(out, lse, qkv, s, {});
  // fp32 runs (parity checks) take the row-wise kernels; packed documents skip cuDNN, whose
  // ragged layout wants the documents as separate sequences of a padded batch.
  if (qkv.dtype == DType::F32) {
    cuda::attention_rowwise_forward(out.data, lse.as<float>(), qkv.data, s, qkv.dtype, stream_);
    return;
  }
  if (!s.document_starts.defined() && use_cudnn_attention(s, false, {out.data, lse.data, qkv.data})) {
    const size_t bytes = cudnn_->forward_plan(s).workspace_bytes;
    try {
      cudnn_->forward(out.data, lse.as<float>(), qkv.data, s, bytes > 0 ? scratch(bytes) : nullptr);
      return;
    } catch (const InternalError& e) {  // a failed cuDNN call: auto falls back, cudnn rethrows
      if (attention_ == AttentionBackend::Vendor) throw;
      cudnn_attention_fallback("forward " + attention_shape_text(s), e.what());
    }
  }
  if (!flash_kernels_take(s)) {
    cuda::attention_rowwise_forward(out.data, lse.as<float>(), qkv.data, s, qkv.dtype, stream_);
    return;
  }
  cuda::attention_forward(out.data, lse.as<float>(), qkv.data, s, stream_);
}

// The warpgroup forward writes the codes in its epilogue; where another kernel runs (fp32,
// cuDNN, other head sizes) the cast follows the attention.
void CudaBackend::do_attention_forward_cast(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                            const AttentionShape& s, const Fp8CastArgs& codes) {
  if (s.fp8) return attention_forward_fp8(out, lse, qkv, s, codes);
  const bool flash = qkv.dtype == DType::BF16 && flash_kernels_take(s) &&
                     (s.document_starts.defined() ||
                      !use_cudnn_attention(s, false, {out.data, lse.data, qkv.data}));
  if (flash && cuda::attention_forward_cast(out.data, lse.as<float>(), qkv.data, s, codes.out.data,
                                            codes.out.dtype, codes.scale.as<float>(),
                                            codes.amax.defined() ? codes.amax.as<float>() : nullptr,
                                            stream_)) {
    return;
  }
  do_attention_forward(out, lse, qkv, s);
  cast_output(out, codes);
}

void CudaBackend::do_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                        const Tensor& lse, const Tensor& qkv,
                                        const AttentionShape& s) {
  // cuDNN's fused attention and the flash kernels are bf16; fp32 takes the row-wise kernels,
  // packed documents the flash kernels (or the row-wise ones for other head sizes).
  const bool rowwise = qkv.dtype == DType::F32 || !flash_kernels_take(s);
  if (qkv.dtype == DType::BF16 && !s.document_starts.defined() &&
      use_cudnn_attention(s, true, {dqkv.data, dout.data, out.data, lse.data, qkv.data})) {
    const CudnnAttentionOptions options{.deterministic = deterministic_};
    const size_t bytes = cudnn_->backward_plan(s, options).workspace_bytes;
    try {
      cudnn_->backward(dqkv.data, dout.data, out.data, lse.as<float>(), qkv.data, s,
                       bytes > 0 ? scratch(bytes) : nullptr, options);
      return;
    } catch (const InternalError& e) {  // a failed cuDNN call: auto falls back, cudnn rethrows
      if (attention_ == AttentionBackend::Vendor) throw;
      cudnn_attention_fallback("backward " + attention_shape_text(s), e.what());
    }
  }
  if (rowwise) {
    const size_t bytes = attention_rowwise_backward_scratch_bytes(s);
    cuda::attention_rowwise_backward(dqkv.data, dout.data, out.data, lse.as<float>(), qkv.data, s,
                                     scratch(bytes), qkv.dtype, stream_);
    return;
  }
  const AttentionOptions options{.deterministic = deterministic_};
  const size_t bytes = attention_backward_scratch_bytes(s, options);
  cuda::attention_backward(dqkv.data, dout.data, out.data, lse.as<float>(), qkv.data, s,
                           bytes > 0 ? scratch(bytes) : nullptr, stream_, options);
}

// The warpgroup kernels where they apply, else the portable ones.
void CudaBackend::do_attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                                const Tensor& qkv, const Tensor& kv_all,
                                                const Tensor& positions, int64_t segment,
                                                const AttentionShape& s) {
  const int64_t segments = positions.numel() / s.seq;
  if (qkv.dtype == DType::BF16 &&
      cuda::attention_gathered_forward_warpgroup(out.data, lse.as<float>(), qkv.data, kv_all.data,
                                                 segments, segment, s, stream_)) {
    return;
  }
  cuda::attention_gathered_forward(out.data, lse.as<float>(), qkv.data, kv_all.data,
                                   positions.as<int32_t>(), segments, segment, s, qkv.dtype,
                                   stream_);
}

// The deterministic backward keeps the portable kernels (the warpgroup one adds dQ atomically).
void CudaBackend::do_attention_gathered_backward(const Tensor& dqkv, const Tensor& dkv_all,
                                                 const Tensor& dout, const Tensor& out,
                                                 const Tensor& lse, const Tensor& qkv,
                                                 const Tensor& kv_all, const Tensor& positions,
                                                 int64_t segment, const AttentionShape& s) {
  const int64_t segments = positions.numel() / s.seq;
  const bool warpgroup = qkv.dtype == DType::BF16 && !deterministic_;
  const size_t bytes = std::max(cuda::attention_gathered_backward_scratch_bytes(s),
                                warpgroup ? cuda::attention_backward_scratch_bytes(s) : 0);
  void* const work = scratch(bytes);
  if (warpgroup && cuda::attention_gathered_backward_warpgroup(
                       dqkv.data, dkv_all.data, dout.data, out.data, lse.as<float>(), qkv.data,
                       kv_all.data, segments, segment, s, work, stream_)) {
    return;
  }
  cuda::attention_gathered_backward(dqkv.data, dkv_all.data, dout.data, out.data, lse.as<float>(),
                                    qkv.data, kv_all.data, positions.as<int32_t>(), segments,
                                    segment, s, qkv.dtype, work, bytes, stream_);
}

void CudaBackend::do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                      const Tensor& positions, int64_t pos, const AttentionShape& s) {
  const size_t bytes = cuda::attention_decode_scratch_bytes(s);
  cuda::attention_decode(out.data, q.data, kv.data,
                         positions.defined() ? positions.as<int32_t>() : nullptr, pos, s, q.dtype,
                         bytes ? scratch(bytes) : nullptr, bytes, stream_);
}

void CudaBackend::do_cache_write(const Tensor& cache, const Tensor& src, int64_t src_col,
                                 const Tensor& positions) {
  cuda::cache_write(cache.data, cache.dim(0), cache.dim(1), cache.dim(2), src.data,
                    matrix_dims(src).cols, src_col, positions.as<int32_t>(), dtype_size(cache.dtype),
                    stream_);
}

void CudaBackend::do_mla_qkv_forward(const MlaQkvArgs& a) {
  cuda::mla_qkv_forward(mla_view(a), a.qkv.dtype, stream_);
}

void CudaBackend::do_mla_qkv_backward(const MlaQkvArgs& g) {
  cuda::mla_qkv_backward(mla_view(g), g.qkv.dtype, stream_);
}

void CudaBackend::do_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src,
                                  int64_t src_col, int64_t cols) {
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  cuda::copy_columns(dst.data, d.cols, dst_col, src.data, r.cols, src_col, d.rows, cols,
                     dtype_size(dst.dtype), stream_);
}

void CudaBackend::do_copy_rows(const Tensor& dst, const Tensor& dst_rows, const Tensor& src,
                               const Tensor& src_rows) {
  const int64_t count = dst_rows.defined() ? dst_rows.numel() : src_rows.numel();
  cuda::copy_rows(dst.data, dst_rows.defined() ? dst_rows.as<int32_t>() : nullptr, src.data,
                  src_rows.defined() ? src_rows.as<int32_t>() : nullptr, count,
                  static_cast<size_t>(matrix_dims(dst).cols) * dtype_size(dst.dtype), stream_);
}

void CudaBackend::do_add(const Tensor& out, const Tensor& a, const Tensor& b) {
  cuda::add(out.data, a.data, b.data, a.numel(), a.dtype, stream_);
}

void CudaBackend::do_scale(const Tensor& out, const Tensor& x, float alpha) {
  cuda::scale(out.data, x.data, alpha, x.numel(), x.dtype, stream_);
}

void CudaBackend::do_softcap(const Tensor& out, const Tensor& x, float cap) {
  cuda::softcap(out.data, x.data, cap, x.numel(), x.dtype, stream_);
}

void CudaBackend::do_softcap_backward(const Tensor& dx, const Tensor& dy, const Tensor& y,
                                      float cap) {
  cuda::softcap_backward(dx.data, dy.data, y.data, cap, y.numel(), y.dtype, stream_);
}

void CudaBackend::do_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
  cuda::swiglu_forward(out.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

void CudaBackend::do_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up,
                                         const Fp8CastArgs& codes) {
  const MatrixDims d = matrix_dims(gate_up);
  const DType format = codes.out.defined() ? codes.out.dtype : codes.out_t.dtype;
  cuda::swiglu_forward_cast(out.data, codes.out.data, codes.out_t.data, gate_up.data, d.rows,
                            d.cols / 2, gate_up.dtype, format, codes.scale.as<float>(),
                            codes.amax.defined() ? codes.amax.as<float>() : nullptr, stream_);
}

void CudaBackend::do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                     const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
  cuda::swiglu_backward(dgate_up.data, dout.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

// The folded kernel takes aligned bf16 shapes; elsewhere d(gate_up) is written and cast.
void CudaBackend::do_swiglu_backward_cast(const Tensor& dgate_up, const Tensor& dout,
                                          const Tensor& gate_up, const Fp8CastArgs& codes) {
  const MatrixDims d = matrix_dims(gate_up);
  if (cuda::swiglu_backward_cast(
          dout.data, gate_up.data, d.rows, d.cols / 2, gate_up.dtype, codes.out.data,
          codes.out_t.data, codes.out.dtype, codes.scale.as<float>(),
          codes.amax.defined() ? codes.amax.as<float>() : nullptr, stream_)) {
    return;
  }
  do_swiglu_backward(dgate_up, dout, gate_up);
  cast_output(dgate_up, codes);
}

void CudaBackend::do_cross_entropy(const Tensor& losses, const Tensor& logits,
                                   const Tensor& targets, const Tensor& dlogits, float grad_scale) {
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols;
  TS_CHECK(V < (int64_t{1} << 31), "cuda cross_entropy: vocabulary {} exceeds 2^31", V);
  void* dx = nullptr;
  if (dlogits.defined()) {
    dx = dlogits.data;
  }
  cuda::cross_entropy(losses.as<float>(), dx, logits.data, targets.as<int32_t>(), N, V, grad_scale,
                      logits.dtype, stream_);
}

// ---- QK norm and mixture of experts ----

void CudaBackend::do_log_softmax_gather(const Tensor& logps, const Tensor& lse,
                                        const Tensor& logits, const Tensor& targets) {
  const MatrixDims d = matrix_dims(logits);
  cuda::log_softmax_gather(logps.as<float>(), lse.as<float>(), logits.data, targets.as<int32_t>(),
                           d.rows, d.cols, logits.dtype, stream_);
}

void CudaBackend::do_sample_tokens(const Tensor& tokens, const Tensor& logps, const Tensor& entropy,
                                   const Tensor& logits, const Tensor& streams, const Tensor& steps,
                                   int64_t vocab, float temperature, float min_p, uint64_t seed) {
  const auto [B, V] = matrix_dims(logits);
  const size_t bytes = cuda::sample_tokens_scratch_bytes(B, V);
  cuda::sample_tokens(tokens.as<int32_t>(), logps.as<float>(), entropy.as<float>(), logits.data,
                      streams.as<int32_t>(), steps.as<int32_t>(), B, V, vocab, temperature, min_p, seed,
                      logits.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_log_softmax_gather_backward(const Tensor& dlogits, const Tensor& dlogps,
                                                 const Tensor& logits, const Tensor& lse,
                                                 const Tensor& targets) {
  const MatrixDims d = matrix_dims(logits);
  cuda::log_softmax_gather_backward(dlogits.data, dlogps.as<float>(), logits.data, lse.as<float>(),
                                    targets.as<int32_t>(), d.rows, d.cols, logits.dtype, stream_);
}

void CudaBackend::do_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                                     const Tensor& q_weight, const Tensor& k_weight,
                                     const AttentionShape& s, float eps) {
  cuda::qk_norm_forward(out.data, rstd.as<float>(), qkv.data, q_weight.data, k_weight.data, s, eps,
                        qkv.dtype, stream_);
}

void CudaBackend::do_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight,
                                      const Tensor& dk_weight, const Tensor& dout,
                                      const Tensor& qkv, const Tensor& q_weight,
                                      const Tensor& k_weight, const Tensor& rstd,
                                      const AttentionShape& s) {
  const size_t bytes = qk_norm_backward_scratch_bytes(s);
  cuda::qk_norm_backward(dqkv.data, dq_weight.data, dk_weight.data, dq_weight.dtype, dout.data,
                         qkv.data, q_weight.data, k_weight.data, rstd.as<float>(), s, qkv.dtype,
                         scratch(bytes), bytes, stream_);
}

void CudaBackend::do_moe_router_forward(const Tensor& indices, const Tensor& weights,
                                        const Tensor& logits, const Tensor& bias,
                                        const MoeRouting& r) {
  cuda::moe_router_forward(indices.as<int32_t>(), weights.as<float>(), logits.data, logits.dtype,
                           bias.defined() ? bias.as<float>() : nullptr, matrix_dims(logits).rows, r,
                           stream_);
}

void CudaBackend::do_moe_router_backward(const Tensor& dlogits, const Tensor& dweights,
                                         const Tensor& logits, const Tensor& indices,
                                         const MoeRouting& r) {
  cuda::moe_router_backward(dlogits.as<float>(), dweights.as<float>(), logits.data, logits.dtype,
                            indices.as<int32_t>(), matrix_dims(logits).rows, r, stream_);
}

void CudaBackend::do_moe_aux_loss(const MoeAuxLossArgs& a) {
  const int64_t N = matrix_dims(a.logits).rows;
  const int64_t sequences = a.seq > 0 ? N / a.seq : 1;
  const size_t bytes = moe_loss_scratch_bytes(N, a.routing.experts, sequences);
  cuda::moe_aux_loss(a.loss.defined() ? a.loss.as<float>() : nullptr,
                     a.dlogits.defined() ? a.dlogits.as<float>() : nullptr, a.logits.data,
                     a.logits.dtype, a.indices.as<int32_t>(), N, a.routing, a.seq, a.grad_scale,
                     scratch(bytes), bytes, stream_);
}

void CudaBackend::do_moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                                float grad_scale) {
  const MatrixDims d = matrix_dims(logits);
  const size_t bytes = moe_loss_scratch_bytes(d.rows, d.cols, 0);
  cuda::moe_z_loss(loss.defined() ? loss.as<float>() : nullptr,
                   dlogits.defined() ? dlogits.as<float>() : nullptr, logits.data, logits.dtype,
                   d.rows, d.cols, grad_scale, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  cuda::moe_expert_counts(counts.as<float>(), indices.as<int32_t>(), indices.numel(), stream_);
}

void CudaBackend::do_moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) {
  cuda::moe_expert_bias_update(bias.as<float>(), counts.as<float>(), bias.numel(), rate, stream_);
}

void CudaBackend::do_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                                 const Tensor& x, const Tensor& indices, int64_t align,
                                 const MoeCapacity& capacity) {
  const MatrixDims xd = matrix_dims(x);
  const int64_t E = offsets.numel() - 1, R = matrix_dims(xp).rows, K = matrix_dims(indices).cols;
  const bool by_weight = capacity.capacity > 0 && !capacity.by_position;
  const size_t bytes = moe_permute_scratch_bytes(R, E, xd.rows * K, capacity.capacity);
  cuda::moe_permute(xp.data, rows.as<int32_t>(), offsets.as<int32_t>(), x.data,
                    indices.as<int32_t>(), xd.rows, K, xd.cols, E, R, align, capacity.capacity,
                    capacity.by_position, by_weight ? capacity.weights.as<float>() : nullptr,
                    capacity.dropped.defined() ? capacity.dropped.as<float>() : nullptr, x.dtype,
                    scratch(bytes), bytes, stream_);
}

void CudaBackend::do_moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) {
  const MatrixDims d = matrix_dims(dx);
  cuda::moe_permute_backward(dx.data, dxp.data, rows.as<int32_t>(), d.rows, matrix_dims(rows).cols,
                             d.cols, dx.dtype, stream_);
}

void CudaBackend::do_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                                   const Tensor& weights) {
  const MatrixDims d = matrix_dims(out);
  cuda::moe_unpermute(out.data, yp.data, rows.as<int32_t>(), weights.as<float>(), d.rows,
                      matrix_dims(rows).cols, d.cols, out.dtype, stream_);
}

void CudaBackend::do_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights,
                                            const Tensor& dout, const Tensor& yp,
                                            const Tensor& rows, const Tensor& weights) {
  const MatrixDims d = matrix_dims(dout);
  const int64_t R = matrix_dims(yp).rows;
  const size_t bytes = moe_unpermute_backward_scratch_bytes(R);
  cuda::moe_unpermute_backward(
      dyp.data, dweights.as<float>(), dout.data, yp.data, rows.as<int32_t>(), weights.as<float>(),
      d.rows, matrix_dims(rows).cols, d.cols, R, dout.dtype, scratch(bytes), bytes, stream_);
}

// Given no host offsets (bf16 or FP8, one weight a group, on Hopper): one grouped kernel that
// reads the device's (grouped_matmul_hopper.cuh), so that no step waits for the routing.
// Given host offsets, or shapes the kernel does not take: one cuBLASLt GEMM per non-empty
// group, sized from them (copied from the device when the caller gave none).
//
// Which to ask for: in bf16 the kernel wins where groups are small (64 experts of 512 rows:
// 1.14-1.38x cuBLASLt's per-group GEMMs, Qwen3-30B-A3B's 128: 1.7-4.5x; the proxies +5.5% and
// +17%), cuBLASLt where each group's GEMM fills the GPU many times over (Mixtral's experts of
// 2,048 rows: the kernel at 0.92-1.07 of it, the proxy's step 2.6% slower); performance-notes
// entry 57. In FP8 the kernel wins at every size measured: +11.8% and +10.6% on those
// proxies, and on Mixtral's +0.7-1.5% in four of five A/B runs (-0.3% in one; entry 58).
bool CudaBackend::grouped_matmul_reads_device_offsets(DType dtype, int64_t rows,
                                                      int64_t groups) const {
  constexpr int64_t kMostBf16RowsPerGroup = 1024;
  if (!cuda::grouped_matmul_hopper_runs_on(device_)) return false;
  if (dtype == DType::E4M3) return true;
  return dtype == DType::BF16 && rows <= kMostBf16RowsPerGroup * groups;
}

void CudaBackend::do_grouped_matmul(const GroupedMatmulArgs& a) {
  const int64_t N = matrix_dims(a.out).cols, K = matrix_dims(a.a).cols, R = matrix_dims(a.a).rows;
  const int64_t G = a.offsets.numel() - 1;
  if (a.host_offsets.empty() && a.group_weights.empty() && a.a.dtype == DType::BF16 &&
      cuda::grouped_matmul_hopper_takes(device_, G, 2, {N, K}, {a.out.data, a.a.data, a.b.data})) {
    return cuda::grouped_matmul_hopper(a.out.as<bf16>(), a.a.as<bf16>(), a.b.as<bf16>(),
                                       a.offsets.as<int32_t>(), G, R, N, K, a.trans_b, stream_);
  }
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets = host_group_offsets(a.offsets, a.host_offsets, storage);
  const size_t elem = dtype_size(a.a.dtype);
  for_each_row_group(offsets, a.group_weights,
                     [&](int64_t, int64_t begin, int64_t rows, int64_t w) {
                       MatmulProblem p;
                       p.out = static_cast<char*>(a.out.data) + begin * N * elem;
                       p.out_dtype = a.out.dtype;
                       p.a = static_cast<const char*>(a.a.data) + begin * K * elem;
                       p.b = static_cast<const char*>(a.b.data) + w * N * K * elem;
                       p.a_dtype = p.b_dtype = a.a.dtype;
                       p.M = rows, p.N = N, p.K = K;
                       p.trans_b = a.trans_b;
                       p.tune = false;  // routed row counts: a new shape nearly every call
                       lt_->run(p, stream_);
                     });
  zero_rows_past_groups(a.out, offsets.back(), stream_);
}

void CudaBackend::do_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  const char* op = "grouped_matmul_wgrad";
  // fp32, or bf16 gradients (main_grads_dtype bf16): the fp32 sums rounded once.
  TS_CHECK(a.out.dtype == DType::F32 || a.out.dtype == DType::BF16,
           "cuda grouped_matmul_wgrad: out is {}, expected fp32 or bf16", dtype_name(a.out.dtype));
  const int64_t M = a.out.dim(1), N = a.out.dim(2), W = a.out.dim(0), R = matrix_dims(a.a).rows;
  if (a.host_offsets.empty() && a.group_weights.empty() && a.a.dtype == DType::BF16 &&
      cuda::grouped_matmul_hopper_takes(device_, W, 2, {M, N}, {a.out.data, a.a.data, a.b.data})) {
    return cuda::grouped_matmul_wgrad_hopper(a.out.data, a.out.dtype == DType::F32, a.a.as<bf16>(),
                                             a.b.as<bf16>(), a.offsets.as<int32_t>(), W, R, M, N,
                                             a.beta, stream_);
  }
  const size_t elem = dtype_size(a.a.dtype), out_elem = dtype_size(a.out.dtype);
  std::vector<int32_t> storage;
  // A weight's first group applies beta, later ones add; weights without rows get beta alone.
  std::vector<char> started(static_cast<size_t>(W), 0);
  for_each_row_group(host_group_offsets(a.offsets, a.host_offsets, storage), a.group_weights,
                     [&](int64_t, int64_t begin, int64_t rows, int64_t w) {
                       MatmulProblem p;
                       p.out = static_cast<char*>(a.out.data) + w * M * N * out_elem;
                       p.out_dtype = a.out.dtype;
                       p.a = static_cast<const char*>(a.a.data) + begin * M * elem;
                       p.b = static_cast<const char*>(a.b.data) + begin * N * elem;
                       p.a_dtype = p.b_dtype = a.a.dtype;
                       p.M = M, p.N = N, p.K = rows;
                       p.trans_a = true;
                       p.beta = started[w] ? 1.0f : a.beta;
                       p.tune = false;
                       lt_->run(p, stream_);
                       started[w] = 1;
                     });
  finish_unwritten_weights(op, a.out, started, a.beta, stream_);
}

// The FP8 grouped GEMMs: the grouped kernel where it takes them from the device's offsets (b
// e4m3, bf16 out), else one cuBLASLt FP8 GEMM per group with rows, as do_grouped_matmul.
// cuBLASLt reads a scale only from a 16-byte aligned address, and the experts' scale_invs sit
// side by side: the activation's scale is copied to its slot once, every weight's scale to
// its own slot in one strided copy, all before the GEMMs are queued (stream order keeps the
// slots' values until they have run, whatever a later op copies there).
void CudaBackend::do_grouped_matmul_fp8(const GroupedFp8MatmulArgs& a) {
  const int64_t N = matrix_dims(a.out).cols, K = a.b.dim(2), R = matrix_dims(a.a).rows;
  TS_CHECK(N % 16 == 0 && K % 16 == 0,
           "cuda grouped_matmul_fp8: N={} K={} must be multiples of 16 for cuBLASLt FP8", N, K);
  for (const Tensor* t : {&a.out, &a.a, &a.b})
    TS_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
             "cuda grouped_matmul_fp8: an operand at {} is not 16-byte aligned", t->data);
  const int64_t G = a.offsets.numel() - 1;
  if (a.host_offsets.empty() && a.group_weights.empty() && a.b.dtype == DType::E4M3 &&
      a.out.dtype == DType::BF16 &&
      cuda::grouped_matmul_hopper_takes(device_, G, 1, {N, K}, {a.out.data, a.a.data, a.b.data})) {
    return cuda::grouped_matmul_fp8_hopper(
        a.out.as<bf16>(), a.a.data, a.a.dtype == DType::E5M2, a.b.data, a.a_scale_inv.as<float>(),
        a.b_scale_inv.as<float>(), a.offsets.as<int32_t>(), G, R, N, K, !a.fast_accum, stream_);
  }
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets = host_group_offsets(a.offsets, a.host_offsets, storage);
  const size_t out_elem = dtype_size(a.out.dtype);
  const float* a_scale = nullptr;
  const float* b_scales = nullptr;
  if (offsets.back() > 0) {
    b_scales = aligned_fp8_weight_scales(a.b_scale_inv.as<float>(), a.b.dim(0));
    a_scale = aligned_fp8_scale(a.a_scale_inv.as<float>(), 0);
  }
  for_each_row_group(
      offsets, a.group_weights, [&](int64_t g, int64_t begin, int64_t rows, int64_t w) {
        TS_CHECK(rows % 16 == 0 && begin % 16 == 0,
                 "cuda grouped_matmul_fp8: group {} has rows [{}, {}); FP8 groups start and end at "
                 "multiples of 16 rows",
                 g, begin, begin + rows);
        MatmulProblem p;
        p.out = static_cast<char*>(a.out.data) + begin * N * out_elem;
        p.out_dtype = a.out.dtype;
        p.a = static_cast<const uint8_t*>(a.a.data) + begin * K;
        p.b = static_cast<const uint8_t*>(a.b.data) + w * N * K;
        p.a_dtype = a.a.dtype;
        p.b_dtype = a.b.dtype;
        p.M = rows, p.N = N, p.K = K;
        p.trans_a = false, p.trans_b = true;
        p.a_scale = a_scale;
        p.b_scale = b_scales + kFp8WeightSlotFloats * w;
        p.fast_accum = a.fast_accum;
        p.tune = false;  // routed row counts: a new shape nearly every call
        lt_->run(p, stream_);
      });
  zero_rows_past_groups(a.out, offsets.back(), stream_);
}

void CudaBackend::do_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& a) {
  const char* op = "grouped_matmul_fp8_wgrad";
  const int64_t M = a.out.dim(1), N = a.out.dim(2), W = a.out.dim(0);
  const int64_t R = matrix_dims(a.a_t).cols;
  TS_CHECK(M % 16 == 0 && N % 16 == 0 && R % 16 == 0,
           "cuda grouped_matmul_fp8_wgrad: M={} N={} and the rows R={} must be multiples of 16 "
           "for cuBLASLt FP8",
           M, N, R);
  for (const Tensor* t : {&a.out, &a.a_t, &a.b_t})
    TS_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
             "cuda grouped_matmul_fp8_wgrad: an operand at {} is not 16-byte aligned", t->data);
  if (a.host_offsets.empty() && a.group_weights.empty() && a.b_t.dtype == DType::E4M3 &&
      cuda::grouped_matmul_hopper_takes(device_, W, 1, {M, N, R},
                                        {a.out.data, a.a_t.data, a.b_t.data})) {
    return cuda::grouped_matmul_fp8_wgrad_hopper(
        a.out.data, a.out.dtype == DType::F32, a.a_t.data, a.a_t.dtype == DType::E5M2, a.b_t.data,
        a.a_scale_inv.as<float>(), a.b_scale_inv.as<float>(), a.offsets.as<int32_t>(), W, R, M, N,
        a.beta, !a.fast_accum, stream_);
  }
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets = host_group_offsets(a.offsets, a.host_offsets, storage);
  const size_t out_elem = dtype_size(a.out.dtype);
  // Both operands have one scale: copied once, before the GEMMs (as in do_grouped_matmul_fp8).
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  if (offsets.back() > 0) {
    a_scale = aligned_fp8_scale(a.a_scale_inv.as<float>(), 0);
    b_scale = aligned_fp8_scale(a.b_scale_inv.as<float>(), 1);
  }
  // A weight's first group applies beta, later ones add; weights without rows get beta alone.
  std::vector<char> started(static_cast<size_t>(W), 0);
  for_each_row_group(
      offsets, a.group_weights, [&](int64_t g, int64_t begin, int64_t rows, int64_t w) {
        TS_CHECK(
            rows % 16 == 0 && begin % 16 == 0,
            "cuda grouped_matmul_fp8_wgrad: group {} has rows [{}, {}); FP8 groups start and end "
            "at multiples of 16 rows",
            g, begin, begin + rows);
        MatmulProblem p;
        p.out = static_cast<char*>(a.out.data) + w * M * N * out_elem;
        p.out_dtype = a.out.dtype;
        // The group's columns of a_t (M, R) and b_t (N, R): K-major, rows R apart.
        p.a = static_cast<const uint8_t*>(a.a_t.data) + begin;
        p.b = static_cast<const uint8_t*>(a.b_t.data) + begin;
        p.a_dtype = a.a_t.dtype;
        p.b_dtype = a.b_t.dtype;
        p.M = M, p.N = N, p.K = rows;
        p.lda = p.ldb = R;
        p.trans_a = false, p.trans_b = true;
        p.beta = started[w] ? 1.0f : a.beta;
        p.a_scale = a_scale;
        p.b_scale = b_scale;
        p.fast_accum = a.fast_accum;
        p.tune = false;
        lt_->run(p, stream_);
        started[w] = 1;
      });
  finish_unwritten_weights(op, a.out, started, a.beta, stream_);
}

void CudaBackend::do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                               const Tensor& targets, int64_t first_id) {
  const char* op = "cross_entropy_shard_stats";
  const MatrixDims d = matrix_dims(logits);
  TS_CHECK(d.cols < (int64_t{1} << 31), "cuda {}: vocabulary shard {} exceeds 2^31", op, d.cols);
  cuda::cross_entropy_shard_stats(stats.as<float>(), logits.data, targets.as<int32_t>(), d.rows,
                                  d.cols, first_id, logits.dtype, stream_);
}

void CudaBackend::do_cross_entropy_shard(const Tensor& losses, const Tensor& logits,
                                         const Tensor& targets, const Tensor& all_stats,
                                         int64_t first_id, const Tensor& dlogits,
                                         float grad_scale) {
  const char* op = "cross_entropy_shard";
  const MatrixDims d = matrix_dims(logits);
  TS_CHECK(d.cols < (int64_t{1} << 31), "cuda {}: vocabulary shard {} exceeds 2^31", op, d.cols);
  void* dx = nullptr;
  if (dlogits.defined()) {
    dx = dlogits.data;
  }
  cuda::cross_entropy_shard(losses.as<float>(), dx, logits.data, targets.as<int32_t>(),
                            all_stats.as<float>(), all_stats.numel() / (2 * d.rows), d.rows, d.cols,
                            first_id, grad_scale, logits.dtype, stream_);
}

// ---- reductions and optimizer ----

void CudaBackend::do_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  const size_t bytes = sum_scratch_bytes(x.numel());
  cuda::sum(out.as<float>(), x.as<float>(), x.numel(), accumulate, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  const size_t bytes = sum_scratch_bytes(x.numel());
  cuda::sum_squares(out.as<float>(), x.data, x.dtype, x.numel(), accumulate, scratch(bytes), bytes,
                    stream_);
}

const AdamWChunk* CudaBackend::adamw_chunk_table(std::span<const ParamSegment> segments,
                                                 int64_t params, int64_t* count) {
  const bool same =
      params == adamw_params_ && segments.size() == adamw_segments_.size() &&
      std::equal(segments.begin(), segments.end(), adamw_segments_.begin(),
                 [](const ParamSegment& a, const ParamSegment& b) {
                   return a.offset == b.offset && a.count == b.count && a.decay == b.decay;
                 });
  if (!same) {
    adamw_chunks_ = adamw_chunks(segments);
    if (adamw_chunks_.size() > adamw_chunks_capacity_) {  // released first, as the scratch
      release(adamw_chunks_device_);
      adamw_chunks_device_ = nullptr;
      adamw_chunks_capacity_ = 0;
      adamw_chunks_device_ = static_cast<AdamWChunk*>(
          allocate(adamw_chunks_.size() * sizeof(AdamWChunk), "AdamW chunk table"));
      adamw_chunks_capacity_ = adamw_chunks_.size();
    }
    if (!adamw_chunks_.empty()) {
      // From pageable memory: staged by the runtime before the call returns.
      TS_CUDA_CHECK(cudaMemcpyAsync(adamw_chunks_device_, adamw_chunks_.data(),
                                    adamw_chunks_.size() * sizeof(AdamWChunk),
                                    cudaMemcpyHostToDevice, stream_));
    }
    adamw_segments_.assign(segments.begin(), segments.end());
    adamw_params_ = params;
  }
  *count = static_cast<int64_t>(adamw_chunks_.size());
  return adamw_chunks_device_;
}

void CudaBackend::do_adamw_step(const AdamWArgs& args) {
  AdamWBuffers t;
  const bool has_master = args.master.defined();
  const Tensor& updated = has_master ? args.master : args.params;
  t.master = updated.data;
  t.master_dtype = updated.dtype;
  if (has_master && args.params.defined() && args.params.data != args.master.data) {
    t.params = args.params.data;
    t.params_dtype = args.params.dtype;
  }
  t.grad = args.grad.data;
  t.grad_dtype = args.grad.dtype;
  t.exp_avg = args.exp_avg.data;
  t.exp_avg_dtype = args.exp_avg.dtype;
  t.exp_avg_sq = args.exp_avg_sq.data;
  t.exp_avg_sq_dtype = args.exp_avg_sq.dtype;

  // The same constants as ref::adamw_update derives from the same float settings.
  const ref::AdamWSettings settings{args.lr,           args.beta1,         args.beta2, args.eps,
                                    args.weight_decay, args.max_grad_norm, args.step};
  const AdamWScalars s{ref::adamw_scalars<float>(settings, /*decay=*/true, 1.0),
                       args.max_grad_norm};

  int64_t chunk_count = 0;
  const AdamWChunk* chunks = adamw_chunk_table(args.segments, updated.numel(), &chunk_count);
  cuda::adamw_step(t, args.grad_norm_sq.as<float>(), chunks, chunk_count, s, stream_);
}

// ---- entry points (cuda_backend.h) ----

size_t step_buffer_bytes(const StepBufferDemand& d) {
  // The largest scratch any op of the step asks for, in the formulas the ops above use.
  size_t scratch = 0;
  auto need = [&](size_t bytes) { scratch = std::max(scratch, bytes); };
  if (d.tokens > 0 && d.hidden > 0) need(rmsnorm_backward_scratch_bytes(d.tokens, d.hidden));
  if (d.tokens > 0 && d.widest_bias > 0) need(bias_backward_scratch_bytes(d.tokens, d.widest_bias));
  // CUB's size query of the token sort needs a device; without one it is left out (a few
  // hundred KB at 8k tokens, below every other scratch of a model step).
  if (d.tokens > 0 && device_count() > 0) need(embedding_backward_scratch_bytes(d.tokens));
  if (d.largest_reduction > 0) need(sum_scratch_bytes(d.largest_reduction));
  if (d.attention.tokens() > 0) {
    // A plan must not depend on where it is made, so auto is planned for both of what it may
    // run, whether or not this machine has cuDNN or a Hopper GPU: cuDNN's SDPA (wherever the
    // library loads: it takes the model families' shapes) and Tessera's kernels (head_dim 128
    // on Hopper, or no cuDNN). cuDNN's workspace holds Tessera's softmax sums and (unless
    // deterministic) dQ accumulator in front of the engine's own; Tessera's kernels hold two
    // (B, H, T) statistics and (unless deterministic) an fp32 dQ accumulator. Shapes the flash
    // kernels do not take fall back to the row-wise kernels' statistics.
    const AttentionOptions flash{.deterministic = d.backend.deterministic};
    const size_t tessera = flash_kernels_take(d.attention)
                               ? attention_backward_scratch_bytes(d.attention, flash)
                               : attention_rowwise_backward_scratch_bytes(d.attention);
    const size_t cudnn = cudnn_backward_tessera_workspace_bytes(d.attention, d.backend.deterministic);
    need(d.backend.attention == AttentionBackend::Tessera ? tessera
         : d.backend.attention == AttentionBackend::Vendor ? cudnn
                                                            : std::max(tessera, cudnn));
    if (d.attention.fp8) need(attention_fp8_scratch_bytes(d.attention));  // the forward's codes
  }
  const size_t granules = (scratch + kScratchGranule - 1) / kScratchGranule * kScratchGranule;
  size_t chunks = 0;  // the chunk table grows to the largest call's
  for (const auto& call : d.adamw_segments) {
    size_t n = 0;
    for (int64_t count : call)
      n += static_cast<size_t>((count + adamw_chunk_elements() - 1) / adamw_chunk_elements());
    chunks = std::max(chunks, n);
  }
  return kLtWorkspaceBytes + granules + chunks * sizeof(AdamWChunk) +
         (d.fp8_expert_gemms ? kFp8ScaleSlotBytes : 0);
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return count;
}

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    const std::string code =
        std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
    // Without an NVIDIA driver the runtime reports an "insufficient" driver version, which
    // reads as an old driver rather than none: say what the machine lacks, with the error's
    // name only.
    if ((error == cudaErrorInsufficientDriver || error == cudaErrorNoDevice) &&
        !std::filesystem::exists("/proc/driver/nvidia/version"))
      return std::string("no NVIDIA GPU on this machine (no NVIDIA driver is loaded; CUDA: ") +
             cudaGetErrorName(error) + ")";
    if (error == cudaErrorNoDevice)
      return "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES hides them, or none is installed; " +
             code + ")";
    return code;
  }
  return count == 0 ? "the CUDA runtime reports no device" : "";
}

std::unique_ptr<Backend> make_cuda_backend(int device, const BackendOptions& options) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw ConfigError("command line", "device", "cuda:" + std::to_string(device),
                      "a CUDA device index below " + std::to_string(count));
  }
  auto backend = std::make_unique<CudaBackend>(device, options);
  if (options.attention == AttentionBackend::Vendor && !backend->cudnn_attention_loaded()) {
    throw ConfigError("configuration", "attention_backend", "cudnn",
                      "auto or tessera: " + backend->cudnn_unavailable_reason());
  }
  return backend;
}

}  // namespace tessera::cuda
