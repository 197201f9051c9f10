#include "tessera/backend/cuda/cuda_backend.cuh"

#include <cublasLt.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tessera/backend/cpu/reference.h"
#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/attention_decode.cuh"
#include "tessera/backend/cuda/attention_gathered.cuh"
#include "tessera/backend/cuda/cross_entropy.cuh"
#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/cudnn_attention.cuh"
#include "tessera/backend/cuda/elementwise.cuh"
#include "tessera/backend/cuda/embedding.cuh"
#include "tessera/backend/cuda/fp8_cast.cuh"
#include "tessera/backend/cuda/reduce.cuh"
#include "tessera/backend/cuda/rmsnorm.cuh"
#include "tessera/backend/cuda/rope.cuh"
#include "tessera/backend/cuda/swiglu.cuh"
#include "tessera/core/error.h"
#include "tessera/ops/op_checks.h"

namespace tessera::cuda {

namespace {

constexpr std::string_view kBackend = "cuda";  // how op-check messages name this backend

// cuBLASLt's recommended workspace for Hopper: enough for its split-K and stream-K kernels.
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
// Scratch grows in steps of this size, so that slightly larger requests do not reallocate.
constexpr size_t kScratchGranule = size_t{1} << 20;

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB",
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// ---- dtype checks (the facade has checked placement and shapes) ----

void expect_type(const Tensor& t, DType d, const char* op, const char* what) {
  OpChecks(kBackend, DeviceKind::GPU, op).dtype(t, d, what);
}

// A compute tensor: bf16 (the performance path) or fp32.
void expect_float(const Tensor& t, const char* op, const char* what) {
  OpChecks(kBackend, DeviceKind::GPU, op)
      .that(t.dtype == DType::BF16 || t.dtype == DType::F32,
            "{} has dtype {}, expected bf16 or fp32", what, dtype_name(t.dtype));
}

void expect_same_type(const Tensor& t, const Tensor& like, const char* op, const char* what) {
  expect_type(t, like.dtype, op, what);
}

void check_rope(const Tensor& qkv, const Tensor& freqs, const char* op) {
  expect_float(qkv, op, "qkv");
  expect_type(freqs, DType::F32, op, "freqs");
}

void require_bf16_attention(const Tensor& t, const char* op, const char* what) {
  if (t.dtype != DType::BF16) {
    throw InternalError(std::string("attention on CUDA needs bf16: ") + op + " got " + what +
                        " in " + std::string(dtype_name(t.dtype)));
  }
}

RopeShape rope_shape(const AttentionShape& s) {
  return RopeShape{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim};
}

std::string attention_shape_text(const AttentionShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq) +
         " H=" + std::to_string(s.heads) + " KV=" + std::to_string(s.kv_heads) +
         " D=" + std::to_string(s.head_dim) + (s.causal ? " causal" : " full") +
         (s.window > 0 ? " window " + std::to_string(s.window) : std::string());
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
  }
  return false;
}

// ---- lifetime ----

CudaBackend::CudaBackend(int device, AttentionBackend attention, bool gemm_autotune)
    : device_(device), attention_(attention) {
  TS_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  fp8_tensor_cores_ = prop.major * 10 + prop.minor >= 89;  // Ada (8.9) and Hopper (9.0) on
  // Non-blocking: our stream never waits for work others put on the legacy default stream.
  TS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  lt_workspace_ = allocate(kLtWorkspaceBytes, "cuBLASLt workspace");
  lt_ = std::make_unique<LtMatmul>(lt_workspace_, kLtWorkspaceBytes, gemm_autotune);
  if (attention_ != AttentionBackend::Tessera) {
    cudnn_ = CudnnAttention::create(stream_, &cudnn_unavailable_);
    static bool reported = false;  // once per process: tests make many backends
    if (cudnn_ == nullptr && attention_ == AttentionBackend::Auto && !reported) {
      reported = true;
      std::fprintf(stderr, "tessera: attention_backend auto: using Tessera's attention kernels: %s\n",
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
  allocations_.release_all([](void* ptr) { cudaFree(ptr); });
  if (stream_) cudaStreamDestroy(stream_);
}

std::string CudaBackend::description() const {
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  int driver = 0, runtime = 0;
  TS_CUDA_CHECK(cudaDriverGetVersion(&driver));
  TS_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const size_t lt = cublasLtGetVersion();  // e.g. 130100 = 13.1.0
  std::string attention = "Tessera kernels";
  if (cudnn_ != nullptr) {
    attention = "cuDNN " + cudnn_->version_string() +
                (attention_ == AttentionBackend::Auto ? " (auto)" : "");
  } else if (attention_ == AttentionBackend::Auto) {
    attention += " (auto: cuDNN not loaded)";
  }
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

MemoryStats CudaBackend::memory_stats() {
  size_t free_bytes = 0, total_bytes = 0;
  TS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return MemoryStats{allocations_.allocated(), allocations_.peak(), total_bytes, free_bytes};
}

void CudaBackend::reset_peak_memory() { allocations_.reset_peak(); }

void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    const size_t grown = (bytes + kScratchGranule - 1) / kScratchGranule * kScratchGranule;
    void* fresh = allocate(grown, "kernel scratch");
    release(scratch_);
    scratch_ = fresh;
    scratch_bytes_ = grown;
  }
  return scratch_;
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

void CudaBackend::do_convert(const Tensor& dst, const Tensor& src) {
  expect_float(dst, "convert", "dst");
  expect_float(src, "convert", "src");
  if (dst.data == src.data && dst.dtype == src.dtype) return;
  cuda::convert(dst.data, dst.dtype, src.data, src.dtype, src.numel(), stream_);
}

void CudaBackend::do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                                 float std) {
  expect_float(dst, "init_normal", "dst");
  cuda::init_normal(dst.data, dst.numel(), seed, first_index, mean, std, dst.dtype, stream_);
}

// ---- linear algebra ----

void CudaBackend::do_matmul(const MatmulArgs& args) {
  const char* op = "matmul";
  expect_float(args.a, op, "a");
  expect_same_type(args.b, args.a, op, "b");
  expect_float(args.out, op, "out");
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
    expect_same_type(args.c, args.out, op, "c");
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    expect_float(args.bias, op, "bias");
    p.bias = args.bias.data;
    p.bias_dtype = args.bias.dtype;
  }
  p.M = M, p.N = N, p.K = K;
  p.trans_a = args.trans_a, p.trans_b = args.trans_b;
  p.alpha = args.alpha, p.beta = args.beta;
  lt_->run(p, stream_);
}

void CudaBackend::do_bias_backward(const Tensor& dbias, const Tensor& dout) {
  expect_type(dbias, DType::F32, "bias_backward", "dbias");
  expect_float(dout, "bias_backward", "dout");
  const MatrixDims d = matrix_dims(dout);
  const size_t bytes = bias_backward_scratch_bytes(d.rows, d.cols);
  cuda::bias_backward(dbias.as<float>(), dout.data, d.rows, d.cols, dout.dtype, scratch(bytes),
                      bytes, stream_);
}

// ---- FP8 ----

void CudaBackend::do_fp8_cast_transpose(const Fp8CastArgs& args) {
  const char* op = "fp8_cast_transpose";
  expect_float(args.x, op, "x");
  const MatrixDims d = matrix_dims(args.x);
  const DType format = args.out.defined()     ? args.out.dtype
                       : args.out_t.defined() ? args.out_t.dtype
                                              : DType::E4M3;
  const bool cast = args.out.defined() || args.out_t.defined();
  if (cast) {
    expect_type(args.scale, DType::F32, op, "scale");
  }
  if (args.amax.defined()) {
    expect_type(args.amax, DType::F32, op, "amax");
  }
  cuda::fp8_cast_transpose(args.x.data, args.x.dtype, d.rows, d.cols,
                           cast ? args.scale.as<float>() : nullptr, args.out.data, args.out_t.data,
                           format, args.amax.defined() ? args.amax.as<float>() : nullptr, stream_);
}

void CudaBackend::do_matmul_fp8(const Fp8MatmulArgs& args) {
  const char* op = "matmul_fp8";
  expect_float(args.out, op, "out");
  for (const Tensor* s : {&args.a_scale_inv, &args.b_scale_inv}) {
    expect_type(*s, DType::F32, op, "scale_inv");
  }
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
    expect_same_type(args.c, args.out, op, "c");
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    expect_same_type(args.bias, args.out, op, "bias");
    p.bias = args.bias.data;
    p.bias_dtype = args.bias.dtype;
  }
  p.M = M, p.N = N, p.K = K;
  p.trans_a = false, p.trans_b = true;
  p.alpha = args.alpha, p.beta = args.beta;
  p.a_scale = args.a_scale_inv.as<float>();
  p.b_scale = args.b_scale_inv.as<float>();
  for (int i = 0; i < 2; ++i) {
    const float*& scale = i == 0 ? p.a_scale : p.b_scale;
    if (reinterpret_cast<uintptr_t>(scale) % 16 == 0) continue;
    if (fp8_scale_slots_ == nullptr)
      fp8_scale_slots_ = static_cast<float*>(allocate(512, "fp8 gemm scales"));
    // Stream order keeps the slot's value until this GEMM has read it.
    float* slot = fp8_scale_slots_ + 64 * i;
    TS_CUDA_CHECK(cudaMemcpyAsync(slot, scale, sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    scale = slot;
  }
  p.fast_accum = args.fast_accum;
  lt_->run(p, stream_);
}

void CudaBackend::do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const char* op = "fp8_update_scales";
  expect_type(args.amax_history, DType::F32, op, "amax_history");
  const MatrixDims h = matrix_dims(args.amax_history);
  expect_type(args.scale, DType::F32, op, "scale");
  expect_type(args.scale_inv, DType::F32, op, "scale_inv");
  if (args.nonfinite.defined()) {
    expect_type(args.nonfinite, DType::F32, op, "nonfinite");
  }
  cuda::fp8_update_scales(args.amax_history.as<float>(), h.rows, h.cols, args.scale.as<float>(),
                          args.scale_inv.as<float>(),
                          args.nonfinite.defined() ? args.nonfinite.as<float>() : nullptr,
                          args.fp8_max, args.margin, args.most_recent, args.roll, stream_);
}

// ---- model ops ----

void CudaBackend::do_embedding_forward(const Tensor& out, const Tensor& tokens,
                                       const Tensor& table) {
  const char* op = "embedding_forward";
  expect_float(table, op, "table");
  expect_same_type(out, table, op, "out");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(table);
  const int64_t N = tokens.numel(), C = t.cols;
  cuda::embedding_forward(out.data, tokens.as<int32_t>(), table.data, N, C, t.rows, table.dtype,
                          stream_);
}

void CudaBackend::do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                                        const Tensor& tokens) {
  const char* op = "embedding_backward";
  expect_type(dtable, DType::F32, op, "dtable");
  expect_float(dout, op, "dout");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel(), C = t.cols;
  const size_t bytes = embedding_backward_scratch_bytes(N);
  cuda::embedding_backward(dtable.as<float>(), dout.data, tokens.as<int32_t>(), N, C, t.rows,
                           dout.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                             const Tensor& table, int64_t first_id) {
  const char* op = "embedding_shard_forward";
  expect_float(table, op, "table");
  expect_same_type(out, table, op, "out");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(table);
  cuda::embedding_shard_forward(out.data, tokens.as<int32_t>(), table.data, tokens.numel(), t.cols,
                                t.rows, first_id, table.dtype, stream_);
}

void CudaBackend::do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                              const Tensor& tokens, int64_t first_id) {
  const char* op = "embedding_shard_backward";
  expect_type(dtable, DType::F32, op, "dtable");
  expect_float(dout, op, "dout");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel();
  const size_t bytes = embedding_backward_scratch_bytes(N);
  cuda::embedding_shard_backward(dtable.as<float>(), dout.data, tokens.as<int32_t>(), N, t.cols,
                                 t.rows, first_id, dout.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                     const Tensor& weight, float eps) {
  const char* op = "rmsnorm_forward";
  expect_float(x, op, "x");
  expect_same_type(out, x, op, "out");
  expect_same_type(weight, x, op, "weight");
  expect_type(rstd, DType::F32, op, "rstd");
  const MatrixDims d = matrix_dims(x);
  cuda::rmsnorm_forward(out.data, rstd.as<float>(), x.data, weight.data, d.rows, d.cols, eps,
                        x.dtype, stream_);
}

void CudaBackend::do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                      const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  expect_float(x, op, "x");
  expect_same_type(dx, x, op, "dx");
  expect_same_type(dout, x, op, "dout");
  expect_same_type(weight, x, op, "weight");
  expect_type(dweight, DType::F32, op, "dweight");
  expect_type(rstd, DType::F32, op, "rstd");
  const MatrixDims d = matrix_dims(x);
  const int64_t N = d.rows, C = d.cols;
  const size_t bytes = rmsnorm_backward_scratch_bytes(N, C);
  cuda::rmsnorm_backward(dx.data, dweight.as<float>(), dout.data, x.data, weight.data,
                         rstd.as<float>(), N, C, x.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  check_rope(qkv, freqs, "rope_forward");
  cuda::rope_forward(qkv.data, freqs.as<float>(), rope_shape(s), qkv.dtype, stream_);
}

void CudaBackend::do_rope_backward(const Tensor& dqkv, const Tensor& freqs,
                                   const AttentionShape& s) {
  check_rope(dqkv, freqs, "rope_backward");
  cuda::rope_backward(dqkv.data, freqs.as<float>(), rope_shape(s), dqkv.dtype, stream_);
}

bool CudaBackend::use_cudnn_attention(const AttentionShape& s, bool backward,
                                      std::initializer_list<const void*> buffers) {
  if (cudnn_ == nullptr) return false;  // attention_backend tessera, or auto without cuDNN
  const std::string key = std::string(backward ? "backward " : "forward ") + attention_shape_text(s);
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
  if (attention_ == AttentionBackend::Cudnn) {
    throw ConfigError("configuration", "attention_backend", "cudnn",
                      "auto or tessera: cuDNN " + cudnn_->version_string() +
                          " cannot run the attention " + key + ": " + why);
  }
  attention_fallbacks_.insert(key);
  std::fprintf(stderr, "tessera: attention_backend auto: attention %s on Tessera's kernels: %s\n",
               key.c_str(), why.c_str());
}

void CudaBackend::do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const AttentionShape& s) {
  const char* op = "attention_forward";
  require_bf16_attention(qkv, op, "qkv");
  require_bf16_attention(out, op, "out");
  expect_type(lse, DType::F32, op, "lse");
  if (use_cudnn_attention(s, false, {out.data, lse.data, qkv.data})) {
    const size_t bytes = cudnn_->forward_plan(s).workspace_bytes;
    try {
      cudnn_->forward(out.data, lse.as<float>(), qkv.data, s, bytes > 0 ? scratch(bytes) : nullptr);
      return;
    } catch (const InternalError& e) {  // a failed cuDNN call: auto falls back, cudnn rethrows
      if (attention_ == AttentionBackend::Cudnn) throw;
      cudnn_attention_fallback("forward " + attention_shape_text(s), e.what());
    }
  }
  cuda::attention_forward(out.data, lse.as<float>(), qkv.data, s, stream_);
}

void CudaBackend::do_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                        const Tensor& lse, const Tensor& qkv,
                                        const AttentionShape& s) {
  const char* op = "attention_backward";
  require_bf16_attention(dqkv, op, "dqkv");
  require_bf16_attention(dout, op, "dout");
  require_bf16_attention(out, op, "out");
  require_bf16_attention(qkv, op, "qkv");
  expect_type(lse, DType::F32, op, "lse");
  if (use_cudnn_attention(s, true, {dqkv.data, dout.data, out.data, lse.data, qkv.data})) {
    const size_t bytes = cudnn_->backward_plan(s).workspace_bytes;
    try {
      cudnn_->backward(dqkv.data, dout.data, out.data, lse.as<float>(), qkv.data, s,
                       bytes > 0 ? scratch(bytes) : nullptr);
      return;
    } catch (const InternalError& e) {  // a failed cuDNN call: auto falls back, cudnn rethrows
      if (attention_ == AttentionBackend::Cudnn) throw;
      cudnn_attention_fallback("backward " + attention_shape_text(s), e.what());
    }
  }
  const size_t bytes = attention_backward_scratch_bytes(s);
  cuda::attention_backward(dqkv.data, dout.data, out.data, lse.as<float>(), qkv.data, s,
                           bytes > 0 ? scratch(bytes) : nullptr, stream_);
}

void CudaBackend::do_attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                                const Tensor& qkv_all, const Tensor& positions,
                                                int64_t segment, const AttentionShape& s) {
  const char* op = "attention_gathered_forward";
  expect_float(qkv_all, op, "qkv_all");
  expect_same_type(out, qkv_all, op, "out");
  expect_type(lse, DType::F32, op, "lse");
  expect_type(positions, DType::I32, op, "positions");
  cuda::attention_gathered_forward(out.data, lse.as<float>(), qkv_all.data, positions.as<int32_t>(),
                                   positions.numel() / s.seq, segment, s, qkv_all.dtype, stream_);
}

void CudaBackend::do_attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout,
                                                 const Tensor& out, const Tensor& lse,
                                                 const Tensor& qkv_all, const Tensor& positions,
                                                 int64_t segment, const AttentionShape& s) {
  const char* op = "attention_gathered_backward";
  expect_float(qkv_all, op, "qkv_all");
  expect_same_type(dqkv_all, qkv_all, op, "dqkv_all");
  expect_same_type(dout, qkv_all, op, "dout");
  expect_same_type(out, qkv_all, op, "out");
  expect_type(lse, DType::F32, op, "lse");
  expect_type(positions, DType::I32, op, "positions");
  const size_t bytes = cuda::attention_gathered_backward_scratch_bytes(s);
  cuda::attention_gathered_backward(
      dqkv_all.data, dout.data, out.data, lse.as<float>(), qkv_all.data, positions.as<int32_t>(),
      positions.numel() / s.seq, segment, s, qkv_all.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                      int64_t pos, const AttentionShape& s) {
  const char* op = "attention_decode";
  expect_float(q, op, "q");
  expect_same_type(out, q, op, "out");
  expect_same_type(kv, q, op, "kv");
  cuda::attention_decode(out.data, q.data, kv.data, pos, s, q.dtype, stream_);
}

void CudaBackend::do_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const char* op = "swiglu_forward";
  expect_float(gate_up, op, "gate_up");
  expect_same_type(out, gate_up, op, "out");
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
  cuda::swiglu_forward(out.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

void CudaBackend::do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                     const Tensor& gate_up) {
  const char* op = "swiglu_backward";
  expect_float(gate_up, op, "gate_up");
  expect_same_type(dgate_up, gate_up, op, "dgate_up");
  expect_same_type(dout, gate_up, op, "dout");
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
  cuda::swiglu_backward(dgate_up.data, dout.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

void CudaBackend::do_cross_entropy(const Tensor& losses, const Tensor& logits,
                                   const Tensor& targets, const Tensor& dlogits, float grad_scale) {
  const char* op = "cross_entropy";
  expect_float(logits, op, "logits");
  expect_type(losses, DType::F32, op, "losses");
  expect_type(targets, DType::I32, op, "targets");
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols;
  TS_CHECK(V < (int64_t{1} << 31), "cuda cross_entropy: vocabulary {} exceeds 2^31", V);
  void* dx = nullptr;
  if (dlogits.defined()) {
    expect_same_type(dlogits, logits, op, "dlogits");
    dx = dlogits.data;
  }
  cuda::cross_entropy(losses.as<float>(), dx, logits.data, targets.as<int32_t>(), N, V, grad_scale,
                      logits.dtype, stream_);
}

void CudaBackend::do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                               const Tensor& targets, int64_t first_id) {
  const char* op = "cross_entropy_shard_stats";
  expect_float(logits, op, "logits");
  expect_type(stats, DType::F32, op, "stats");
  expect_type(targets, DType::I32, op, "targets");
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
  expect_float(logits, op, "logits");
  expect_type(losses, DType::F32, op, "losses");
  expect_type(targets, DType::I32, op, "targets");
  expect_type(all_stats, DType::F32, op, "all_stats");
  const MatrixDims d = matrix_dims(logits);
  TS_CHECK(d.cols < (int64_t{1} << 31), "cuda {}: vocabulary shard {} exceeds 2^31", op, d.cols);
  void* dx = nullptr;
  if (dlogits.defined()) {
    expect_same_type(dlogits, logits, op, "dlogits");
    dx = dlogits.data;
  }
  cuda::cross_entropy_shard(losses.as<float>(), dx, logits.data, targets.as<int32_t>(),
                            all_stats.as<float>(), all_stats.numel() / (2 * d.rows), d.rows, d.cols,
                            first_id, grad_scale, logits.dtype, stream_);
}

// ---- reductions and optimizer ----

void CudaBackend::do_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  expect_type(out, DType::F32, "sum", "out");
  expect_type(x, DType::F32, "sum", "x");
  const size_t bytes = sum_scratch_bytes(x.numel());
  cuda::sum(out.as<float>(), x.as<float>(), x.numel(), accumulate, scratch(bytes), bytes, stream_);
}

void CudaBackend::do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  expect_type(out, DType::F32, "sum_squares", "out");
  expect_type(x, DType::F32, "sum_squares", "x");
  const size_t bytes = sum_scratch_bytes(x.numel());
  cuda::sum_squares(out.as<float>(), x.as<float>(), x.numel(), accumulate, scratch(bytes), bytes,
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
    if (adamw_chunks_.size() > adamw_chunks_capacity_) {
      void* fresh = allocate(adamw_chunks_.size() * sizeof(AdamWChunk), "AdamW chunk table");
      release(adamw_chunks_device_);
      adamw_chunks_device_ = static_cast<AdamWChunk*>(fresh);
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
  const char* op = "adamw_step";
  expect_type(args.master, DType::F32, op, "master");
  expect_type(args.grad, DType::F32, op, "grad");
  expect_type(args.exp_avg, DType::F32, op, "exp_avg");
  expect_type(args.exp_avg_sq, DType::F32, op, "exp_avg_sq");
  expect_type(args.grad_norm_sq, DType::F32, op, "grad_norm_sq");
  const int64_t P = args.master.numel();
  void* params = nullptr;
  DType params_dtype = DType::F32;
  if (args.params.defined() && args.params.data != args.master.data) {
    expect_float(args.params, op, "params");
    params = args.params.data;
    params_dtype = args.params.dtype;
  }

  // The same constants as ref::adamw_update derives from the same float settings.
  const ref::AdamWSettings settings{args.lr, args.beta1, args.beta2, args.eps, args.weight_decay,
                                    args.max_grad_norm, args.step};
  const AdamWScalars s{ref::adamw_scalars<float>(settings, /*decay=*/true, 1.0),
                       args.max_grad_norm};

  int64_t chunk_count = 0;
  const AdamWChunk* chunks = adamw_chunk_table(args.segments, P, &chunk_count);
  cuda::adamw_step(args.master.as<float>(), params, params_dtype, args.exp_avg.as<float>(),
                   args.exp_avg_sq.as<float>(), args.grad.as<float>(),
                   args.grad_norm_sq.as<float>(), chunks, chunk_count, s, stream_);
}

// ---- entry points (cuda_backend.h) ----

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
    return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
  }
  return count == 0 ? "the CUDA runtime reports no device" : "";
}

std::unique_ptr<Backend> make_cuda_backend(int device, AttentionBackend attention, bool gemm_autotune) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw ConfigError("command line", "device", "cuda:" + std::to_string(device),
                      "a CUDA device index below " + std::to_string(count));
  }
  auto backend = std::make_unique<CudaBackend>(device, attention, gemm_autotune);
  if (attention == AttentionBackend::Cudnn && !backend->cudnn_attention_loaded()) {
    throw ConfigError("configuration", "attention_backend", "cudnn",
                      "auto or tessera: " + backend->cudnn_unavailable_reason());
  }
  return backend;
}

}  // namespace tessera::cuda
