#include "tessera/backend/cuda/cuda_backend.cuh"

#include <cublasLt.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/cross_entropy.cuh"
#include "tessera/backend/cuda/cudnn_attention.cuh"
#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/elementwise.cuh"
#include "tessera/backend/cuda/embedding.cuh"
#include "tessera/backend/cuda/fp8_cast.cuh"
#include "tessera/backend/cuda/reduce.cuh"
#include "tessera/backend/cuda/rmsnorm.cuh"
#include "tessera/backend/cuda/rope.cuh"
#include "tessera/backend/cuda/swiglu.cuh"
#include "tessera/backend/cpu/reference.h"
#include "tessera/backend/op_checks.h"
#include "tessera/core/error.h"
#include "tessera/ops/op_observer.h"

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

// ---- tensor checks (failures are bugs in the caller: InternalError via TS_CHECK) ----

void expect_device(const Tensor& t, const char* op, const char* what) {
  TS_CHECK(t.defined() || t.numel() == 0, "cuda {}: {} is undefined", op, what);
  TS_CHECK(t.device.kind == DeviceKind::CUDA, "cuda {}: {} lives on {}", op, what,
           device_name(t.device));
}

void expect_type(const Tensor& t, DType d, const char* op, const char* what) {
  expect_device(t, op, what);
  TS_CHECK(t.dtype == d, "cuda {}: {} has dtype {}, expected {}", op, what, dtype_name(t.dtype),
           dtype_name(d));
}

// A compute tensor: bf16 (the performance path) or fp32.
void expect_float(const Tensor& t, const char* op, const char* what) {
  expect_device(t, op, what);
  TS_CHECK(t.dtype == DType::BF16 || t.dtype == DType::F32,
           "cuda {}: {} has dtype {}, expected bf16 or fp32", op, what, dtype_name(t.dtype));
}

void expect_same_type(const Tensor& t, const Tensor& like, const char* op, const char* what) {
  expect_type(t, like.dtype, op, what);
}

void check_rope(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s, const char* op) {
  expect_float(qkv, op, "qkv");
  expect_type(freqs, DType::F32, op, "freqs");
  check_rope_shapes(kBackend, qkv, freqs, s, op);
}

void require_bf16_attention(const Tensor& t, const char* op, const char* what) {
  expect_device(t, op, what);
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

// ---- op timing ----

// Brackets one op with a pair of events on the stream while timing is on; free otherwise.
class CudaBackend::OpTimer {
 public:
  OpTimer(CudaBackend& b, const char* name) : b_(b), name_(name) {
    if (!b_.timing_) return;
    start_ = take_event();
    TS_CUDA_CHECK(cudaEventRecord(start_, b_.stream_));
  }
  ~OpTimer() {
    if (start_ == nullptr) return;
    cudaEvent_t end = take_event();
    if (end != nullptr && cudaEventRecord(end, b_.stream_) == cudaSuccess) {
      b_.timed_.push_back({name_, start_, end});
    }
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  cudaEvent_t take_event() {
    if (!b_.spare_events_.empty()) {
      cudaEvent_t e = b_.spare_events_.back();
      b_.spare_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return nullptr;
    return e;
  }

  CudaBackend& b_;
  const char* name_;
  cudaEvent_t start_ = nullptr;
};

void CudaBackend::enable_op_timing(bool on) {
  if (on && !timing_) {  // a fresh measurement: drop totals and pairs from earlier ones
    op_totals_ms_.clear();
    for (const TimedOp& t : timed_) {
      spare_events_.push_back(t.start);
      spare_events_.push_back(t.end);
    }
    timed_.clear();
  }
  timing_ = on;
}

std::vector<std::pair<std::string, double>> CudaBackend::op_times_ms() {
  synchronize();
  for (const TimedOp& t : timed_) {
    float ms = 0;
    TS_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.end));
    op_totals_ms_[t.name] += ms;
    spare_events_.push_back(t.start);
    spare_events_.push_back(t.end);
  }
  timed_.clear();
  return {op_totals_ms_.begin(), op_totals_ms_.end()};
}

void CudaBackend::range_push(const char* name) {
  nvtxRangePushA(name);
  if (op_observer_ != nullptr) op_observer_->range_begin(name);
}

void CudaBackend::range_pop() {
  if (op_observer_ != nullptr) op_observer_->range_end();
  nvtxRangePop();
}

// ---- lifetime ----

CudaBackend::CudaBackend(int device, AttentionBackend attention, bool gemm_autotune)
    : device_(device), attention_(attention) {
  TS_CUDA_CHECK(cudaSetDevice(device_));
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
  for (const TimedOp& t : timed_) {
    cudaEventDestroy(t.start);
    cudaEventDestroy(t.end);
  }
  for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
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

void CudaBackend::upload(const Tensor& dst, const void* host_src) {
  OpTimer timer(*this, "upload");
  const ObservedOp observed(op_observer_, "upload", [&] { return op_args::transfer(dst); });
  expect_device(dst, "upload", "dst");
  if (dst.nbytes() == 0) return;
  // From pageable memory the call returns once the source has been staged, so the caller
  // may reuse host_src at once; the device copy itself is ordered on our stream.
  TS_CUDA_CHECK(cudaMemcpyAsync(dst.data, host_src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::download(void* host_dst, const Tensor& src) {
  OpTimer timer(*this, "download");
  const ObservedOp observed(op_observer_, "download", [&] { return op_args::transfer(src); });
  expect_device(src, "download", "src");
  if (src.nbytes() > 0) {
    TS_CUDA_CHECK(
        cudaMemcpyAsync(host_dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost, stream_));
  }
  TS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
  OpTimer timer(*this, "copy");
  const ObservedOp observed(op_observer_, "copy", [&] { return op_args::transfer(src); });
  expect_device(dst, "copy", "dst");
  expect_device(src, "copy", "src");
  TS_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(),
           "cuda copy: dst {} {} and src {} {} differ", dtype_name(dst.dtype), dst.shape.str(),
           dtype_name(src.dtype), src.shape.str());
  if (dst.data == src.data || dst.nbytes() == 0) return;
  TS_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::synchronize() {
  TS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- elementwise and init ----

void CudaBackend::fill(const Tensor& dst, float value) {
  OpTimer timer(*this, "fill");
  const ObservedOp observed(op_observer_, "fill", [&] { return op_args::elements(dst); });
  expect_device(dst, "fill", "dst");
  cuda::fill(dst.data, dst.numel(), value, dst.dtype, stream_);
}

void CudaBackend::convert(const Tensor& dst, const Tensor& src) {
  OpTimer timer(*this, "convert");
  const ObservedOp observed(op_observer_, "convert", [&] { return op_args::convert(dst, src); });
  expect_float(dst, "convert", "dst");
  expect_float(src, "convert", "src");
  expect_count(kBackend, dst, src.numel(), "convert", "dst");
  if (dst.data == src.data && dst.dtype == src.dtype) return;
  cuda::convert(dst.data, dst.dtype, src.data, src.dtype, src.numel(), stream_);
}

void CudaBackend::init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                              float std) {
  OpTimer timer(*this, "init_normal");
  const ObservedOp observed(op_observer_, "init_normal", [&] { return op_args::elements(dst); });
  expect_float(dst, "init_normal", "dst");
  cuda::init_normal(dst.data, dst.numel(), seed, first_index, mean, std, dst.dtype, stream_);
}

// ---- linear algebra ----

void CudaBackend::matmul(const MatmulArgs& args) {
  OpTimer timer(*this, "matmul");
  const ObservedOp observed(op_observer_, "matmul", [&] { return op_args::matmul(args); });
  const char* op = "matmul";
  expect_float(args.a, op, "a");
  expect_same_type(args.b, args.a, op, "b");
  expect_float(args.out, op, "out");
  TS_CHECK(args.a.dtype == DType::BF16 || args.out.dtype == DType::F32,
           "cuda matmul: fp32 a/b need an fp32 out, got {}", dtype_name(args.out.dtype));
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;
  TS_CHECK((args.trans_a ? a.cols : a.rows) == M,
           "cuda matmul: a {} (trans_a={}) does not have the {} rows of out {}", args.a.shape.str(),
           args.trans_a, M, args.out.shape.str());
  TS_CHECK((args.trans_b ? b.cols : b.rows) == K && (args.trans_b ? b.rows : b.cols) == N,
           "cuda matmul: b {} (trans_b={}) is not (K={}, N={})", args.b.shape.str(), args.trans_b,
           K, N);
  TS_CHECK(args.out.data != args.a.data && args.out.data != args.b.data,
           "cuda matmul: out aliases an input");

  MatmulProblem p;
  p.out = args.out.data;
  p.out_dtype = args.out.dtype;
  p.a = args.a.data;
  p.b = args.b.data;
  p.a_dtype = p.b_dtype = args.a.dtype;
  if (args.c.defined() && args.c.data != args.out.data) {
    expect_same_type(args.c, args.out, op, "c");
    expect_count(kBackend, args.c, M * N, op, "c");
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    expect_float(args.bias, op, "bias");
    expect_count(kBackend, args.bias, N, op, "bias");
    p.bias = args.bias.data;
    p.bias_dtype = args.bias.dtype;
  }
  p.M = M, p.N = N, p.K = K;
  p.trans_a = args.trans_a, p.trans_b = args.trans_b;
  p.alpha = args.alpha, p.beta = args.beta;
  lt_->run(p, stream_);
}

void CudaBackend::bias_backward(const Tensor& dbias, const Tensor& dout) {
  OpTimer timer(*this, "bias_backward");
  const ObservedOp observed(op_observer_, "bias_backward",
                            [&] { return op_args::rows_cols(dout); });
  expect_type(dbias, DType::F32, "bias_backward", "dbias");
  expect_float(dout, "bias_backward", "dout");
  const MatrixDims d = matrix_dims(dout);
  expect_count(kBackend, dbias, d.cols, "bias_backward", "dbias");
  const size_t bytes = bias_backward_scratch_bytes(d.rows, d.cols);
  cuda::bias_backward(dbias.as<float>(), dout.data, d.rows, d.cols, dout.dtype, scratch(bytes),
                      bytes, stream_);
}

// ---- FP8 ----

void CudaBackend::fp8_cast_transpose(const Fp8CastArgs& args) {
  OpTimer timer(*this, "fp8_cast_transpose");
  const ObservedOp observed(op_observer_, "fp8_cast_transpose",
                            [&] { return op_args::rows_cols(args.x); });
  const char* op = "fp8_cast_transpose";
  expect_float(args.x, op, "x");
  const MatrixDims d = matrix_dims(args.x);
  DType format = DType::E4M3;
  for (const Tensor* t : {&args.out, &args.out_t}) {
    if (!t->defined()) continue;
    expect_device(*t, op, t == &args.out ? "out" : "out_t");
    expect_count(kBackend, *t, d.rows * d.cols, op, t == &args.out ? "out" : "out_t");
    TS_CHECK(t->dtype == DType::E4M3 || t->dtype == DType::E5M2, "cuda {}: output dtype {} is not fp8",
             op, dtype_name(t->dtype));
    format = t->dtype;
  }
  TS_CHECK(!args.out.defined() || !args.out_t.defined() || args.out.dtype == args.out_t.dtype,
           "cuda {}: out {} and out_t {} differ", op, dtype_name(args.out.dtype),
           dtype_name(args.out_t.dtype));
  const bool cast = args.out.defined() || args.out_t.defined();
  if (cast) {
    expect_type(args.scale, DType::F32, op, "scale");
    expect_count(kBackend, args.scale, 1, op, "scale");
  }
  if (args.amax.defined()) {
    expect_type(args.amax, DType::F32, op, "amax");
    expect_count(kBackend, args.amax, 1, op, "amax");
  }
  cuda::fp8_cast_transpose(args.x.data, args.x.dtype, d.rows, d.cols,
                           cast ? args.scale.as<float>() : nullptr, args.out.data, args.out_t.data,
                           format, args.amax.defined() ? args.amax.as<float>() : nullptr, stream_);
}

void CudaBackend::matmul_fp8(const Fp8MatmulArgs& args) {
  OpTimer timer(*this, "matmul_fp8");
  const ObservedOp observed(op_observer_, "matmul_fp8", [&] { return op_args::matmul_fp8(args); });
  const char* op = "matmul_fp8";
  expect_float(args.out, op, "out");
  expect_device(args.a, op, "a");
  expect_device(args.b, op, "b");
  for (const Tensor* s : {&args.a_scale_inv, &args.b_scale_inv}) {
    expect_type(*s, DType::F32, op, "scale_inv");
    expect_count(kBackend, *s, 1, op, "scale_inv");
  }
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = a.cols;
  TS_CHECK(a.rows == M && b.rows == N && b.cols == K,
           "cuda matmul_fp8: a {} and b {} do not give out {} (out = a @ b^T)", args.a.shape.str(),
           args.b.shape.str(), args.out.shape.str());
  // cuBLASLt's FP8 kernels need 16-byte aligned operands and leading dimensions.
  TS_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0,
           "cuda matmul_fp8: M={} N={} K={} must all be multiples of 16 for cuBLASLt FP8", M, N, K);
  for (const Tensor* t : {&args.out, &args.a, &args.b})
    TS_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
             "cuda matmul_fp8: an operand at {} is not 16-byte aligned", t->data);
  TS_CHECK(args.out.data != args.a.data && args.out.data != args.b.data,
           "cuda matmul_fp8: out aliases an input");
  MatmulProblem p;
  p.out = args.out.data;
  p.out_dtype = args.out.dtype;
  p.a = args.a.data;
  p.b = args.b.data;
  p.a_dtype = args.a.dtype;
  p.b_dtype = args.b.dtype;
  if (args.c.defined() && args.c.data != args.out.data) {
    expect_same_type(args.c, args.out, op, "c");
    expect_count(kBackend, args.c, M * N, op, "c");
    p.c = args.c.data;
  }
  if (args.bias.defined()) {
    expect_same_type(args.bias, args.out, op, "bias");
    expect_count(kBackend, args.bias, N, op, "bias");
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

void CudaBackend::fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  OpTimer timer(*this, "fp8_update_scales");
  const ObservedOp observed(op_observer_, "fp8_update_scales",
                            [&] { return op_args::elements(args.amax_history); });
  const char* op = "fp8_update_scales";
  expect_type(args.amax_history, DType::F32, op, "amax_history");
  const MatrixDims h = matrix_dims(args.amax_history);
  expect_type(args.scale, DType::F32, op, "scale");
  expect_type(args.scale_inv, DType::F32, op, "scale_inv");
  expect_count(kBackend, args.scale, h.cols, op, "scale");
  expect_count(kBackend, args.scale_inv, h.cols, op, "scale_inv");
  if (args.nonfinite.defined()) {
    expect_type(args.nonfinite, DType::F32, op, "nonfinite");
    expect_count(kBackend, args.nonfinite, 1, op, "nonfinite");
  }
  cuda::fp8_update_scales(args.amax_history.as<float>(), h.rows, h.cols, args.scale.as<float>(),
                          args.scale_inv.as<float>(),
                          args.nonfinite.defined() ? args.nonfinite.as<float>() : nullptr,
                          args.fp8_max, args.margin, args.most_recent, args.roll, stream_);
}

// ---- model ops ----

void CudaBackend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  OpTimer timer(*this, "embedding_forward");
  const ObservedOp observed(op_observer_, "embedding_forward",
                            [&] { return op_args::embedding(tokens, table, table.dtype); });
  const char* op = "embedding_forward";
  expect_float(table, op, "table");
  expect_same_type(out, table, op, "out");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(table);
  const int64_t N = tokens.numel(), C = t.cols;
  expect_count(kBackend, out, N * C, op, "out");
  cuda::embedding_forward(out.data, tokens.as<int32_t>(), table.data, N, C, t.rows, table.dtype,
                          stream_);
}

void CudaBackend::embedding_backward(const Tensor& dtable, const Tensor& dout,
                                     const Tensor& tokens) {
  OpTimer timer(*this, "embedding_backward");
  const ObservedOp observed(op_observer_, "embedding_backward",
                            [&] { return op_args::embedding(tokens, dtable, dout.dtype); });
  const char* op = "embedding_backward";
  expect_type(dtable, DType::F32, op, "dtable");
  expect_float(dout, op, "dout");
  expect_type(tokens, DType::I32, op, "tokens");
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel(), C = t.cols;
  expect_count(kBackend, dout, N * C, op, "dout");
  const size_t bytes = embedding_backward_scratch_bytes(N);
  cuda::embedding_backward(dtable.as<float>(), dout.data, tokens.as<int32_t>(), N, C, t.rows,
                           dout.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                  const Tensor& weight, float eps) {
  OpTimer timer(*this, "rmsnorm_forward");
  const ObservedOp observed(op_observer_, "rmsnorm_forward", [&] { return op_args::rows_cols(x); });
  const char* op = "rmsnorm_forward";
  expect_float(x, op, "x");
  expect_same_type(out, x, op, "out");
  expect_same_type(weight, x, op, "weight");
  expect_type(rstd, DType::F32, op, "rstd");
  const MatrixDims d = matrix_dims(x);
  expect_count(kBackend, out, d.rows * d.cols, op, "out");
  expect_count(kBackend, rstd, d.rows, op, "rstd");
  expect_count(kBackend, weight, d.cols, op, "weight");
  cuda::rmsnorm_forward(out.data, rstd.as<float>(), x.data, weight.data, d.rows, d.cols, eps,
                        x.dtype, stream_);
}

void CudaBackend::rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                   const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  OpTimer timer(*this, "rmsnorm_backward");
  const ObservedOp observed(op_observer_, "rmsnorm_backward",
                            [&] { return op_args::rows_cols(x); });
  const char* op = "rmsnorm_backward";
  expect_float(x, op, "x");
  expect_same_type(dx, x, op, "dx");
  expect_same_type(dout, x, op, "dout");
  expect_same_type(weight, x, op, "weight");
  expect_type(dweight, DType::F32, op, "dweight");
  expect_type(rstd, DType::F32, op, "rstd");
  const MatrixDims d = matrix_dims(x);
  const int64_t N = d.rows, C = d.cols;
  expect_count(kBackend, dx, N * C, op, "dx");
  expect_count(kBackend, dout, N * C, op, "dout");
  expect_count(kBackend, dweight, C, op, "dweight");
  expect_count(kBackend, weight, C, op, "weight");
  expect_count(kBackend, rstd, N, op, "rstd");
  const size_t bytes = rmsnorm_backward_scratch_bytes(N, C);
  cuda::rmsnorm_backward(dx.data, dweight.as<float>(), dout.data, x.data, weight.data,
                         rstd.as<float>(), N, C, x.dtype, scratch(bytes), bytes, stream_);
}

void CudaBackend::rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  OpTimer timer(*this, "rope_forward");
  const ObservedOp observed(op_observer_, "rope_forward",
                            [&] { return op_args::rope(s, qkv.dtype); });
  check_rope(qkv, freqs, s, "rope_forward");
  cuda::rope_forward(qkv.data, freqs.as<float>(), rope_shape(s), qkv.dtype, stream_);
}

void CudaBackend::rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s) {
  OpTimer timer(*this, "rope_backward");
  const ObservedOp observed(op_observer_, "rope_backward",
                            [&] { return op_args::rope(s, dqkv.dtype); });
  check_rope(dqkv, freqs, s, "rope_backward");
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

void CudaBackend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                    const AttentionShape& s) {
  OpTimer timer(*this, "attention_forward");
  const ObservedOp observed(op_observer_, "attention_forward",
                            [&] { return op_args::attention(s, qkv.dtype); });
  const char* op = "attention_forward";
  check_attention_shape(kBackend, s, op);
  require_bf16_attention(qkv, op, "qkv");
  require_bf16_attention(out, op, "out");
  expect_type(lse, DType::F32, op, "lse");
  expect_count(kBackend, qkv, s.tokens() * s.qkv_width(), op, "qkv");
  expect_count(kBackend, out, s.tokens() * s.heads * s.head_dim, op, "out");
  expect_count(kBackend, lse, s.batch * s.heads * s.seq, op, "lse");
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

void CudaBackend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                     const Tensor& lse, const Tensor& qkv,
                                     const AttentionShape& s) {
  OpTimer timer(*this, "attention_backward");
  const ObservedOp observed(op_observer_, "attention_backward",
                            [&] { return op_args::attention(s, qkv.dtype); });
  const char* op = "attention_backward";
  check_attention_shape(kBackend, s, op);
  require_bf16_attention(dqkv, op, "dqkv");
  require_bf16_attention(dout, op, "dout");
  require_bf16_attention(out, op, "out");
  require_bf16_attention(qkv, op, "qkv");
  expect_type(lse, DType::F32, op, "lse");
  const int64_t width = s.qkv_width(), HD = s.heads * s.head_dim;
  expect_count(kBackend, qkv, s.tokens() * width, op, "qkv");
  expect_count(kBackend, dqkv, s.tokens() * width, op, "dqkv");
  expect_count(kBackend, out, s.tokens() * HD, op, "out");
  expect_count(kBackend, dout, s.tokens() * HD, op, "dout");
  expect_count(kBackend, lse, s.batch * s.heads * s.seq, op, "lse");
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

void CudaBackend::swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  OpTimer timer(*this, "swiglu_forward");
  const ObservedOp observed(op_observer_, "swiglu_forward",
                            [&] { return op_args::rows_cols(gate_up); });
  const char* op = "swiglu_forward";
  expect_float(gate_up, op, "gate_up");
  expect_same_type(out, gate_up, op, "out");
  const MatrixDims d = matrix_dims(gate_up);
  TS_CHECK(d.cols % 2 == 0, "cuda swiglu_forward: gate_up {} has an odd width",
           gate_up.shape.str());
  const int64_t N = d.rows, F = d.cols / 2;
  expect_count(kBackend, out, N * F, op, "out");
  cuda::swiglu_forward(out.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

void CudaBackend::swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                  const Tensor& gate_up) {
  OpTimer timer(*this, "swiglu_backward");
  const ObservedOp observed(op_observer_, "swiglu_backward",
                            [&] { return op_args::rows_cols(gate_up); });
  const char* op = "swiglu_backward";
  expect_float(gate_up, op, "gate_up");
  expect_same_type(dgate_up, gate_up, op, "dgate_up");
  expect_same_type(dout, gate_up, op, "dout");
  const MatrixDims d = matrix_dims(gate_up);
  TS_CHECK(d.cols % 2 == 0, "cuda swiglu_backward: gate_up {} has an odd width",
           gate_up.shape.str());
  const int64_t N = d.rows, F = d.cols / 2;
  expect_count(kBackend, dgate_up, N * 2 * F, op, "dgate_up");
  expect_count(kBackend, dout, N * F, op, "dout");
  cuda::swiglu_backward(dgate_up.data, dout.data, gate_up.data, N, F, gate_up.dtype, stream_);
}

void CudaBackend::cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                const Tensor& dlogits, float grad_scale) {
  OpTimer timer(*this, "cross_entropy");
  const ObservedOp observed(op_observer_, "cross_entropy",
                            [&] { return op_args::cross_entropy(logits, dlogits); });
  const char* op = "cross_entropy";
  expect_float(logits, op, "logits");
  expect_type(losses, DType::F32, op, "losses");
  expect_type(targets, DType::I32, op, "targets");
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols;
  expect_count(kBackend, losses, N, op, "losses");
  expect_count(kBackend, targets, N, op, "targets");
  TS_CHECK(V < (int64_t{1} << 31), "cuda cross_entropy: vocabulary {} exceeds 2^31", V);
  void* dx = nullptr;
  if (dlogits.defined()) {
    expect_same_type(dlogits, logits, op, "dlogits");
    expect_count(kBackend, dlogits, N * V, op, "dlogits");
    dx = dlogits.data;
  }
  cuda::cross_entropy(losses.as<float>(), dx, logits.data, targets.as<int32_t>(), N, V, grad_scale,
                      logits.dtype, stream_);
}

// ---- reductions and optimizer ----

void CudaBackend::sum(const Tensor& out, const Tensor& x, bool accumulate) {
  OpTimer timer(*this, "sum");
  const ObservedOp observed(op_observer_, "sum", [&] { return op_args::reduction(x, accumulate); });
  expect_type(out, DType::F32, "sum", "out");
  expect_type(x, DType::F32, "sum", "x");
  expect_count(kBackend, out, 1, "sum", "out");
  const size_t bytes = sum_scratch_bytes(x.numel());
  cuda::sum(out.as<float>(), x.as<float>(), x.numel(), accumulate, scratch(bytes), bytes, stream_);
}

void CudaBackend::sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  OpTimer timer(*this, "sum_squares");
  const ObservedOp observed(op_observer_, "sum_squares",
                            [&] { return op_args::reduction(x, accumulate); });
  expect_type(out, DType::F32, "sum_squares", "out");
  expect_type(x, DType::F32, "sum_squares", "x");
  expect_count(kBackend, out, 1, "sum_squares", "out");
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
    for (const ParamSegment& seg : segments) {
      TS_CHECK(seg.offset >= 0 && seg.count >= 0 && seg.offset + seg.count <= params,
               "cuda adamw_step: segment [{}, +{}) outside the {} parameters", seg.offset,
               seg.count, params);
    }
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

void CudaBackend::adamw_step(const AdamWArgs& args) {
  OpTimer timer(*this, "adamw_step");
  const ObservedOp observed(op_observer_, "adamw_step", [&] { return op_args::adamw(args); });
  const char* op = "adamw_step";
  expect_type(args.master, DType::F32, op, "master");
  expect_type(args.grad, DType::F32, op, "grad");
  expect_type(args.exp_avg, DType::F32, op, "exp_avg");
  expect_type(args.exp_avg_sq, DType::F32, op, "exp_avg_sq");
  expect_type(args.grad_norm_sq, DType::F32, op, "grad_norm_sq");
  const int64_t P = args.master.numel();
  expect_count(kBackend, args.grad, P, op, "grad");
  expect_count(kBackend, args.exp_avg, P, op, "exp_avg");
  expect_count(kBackend, args.exp_avg_sq, P, op, "exp_avg_sq");
  expect_count(kBackend, args.grad_norm_sq, 1, op, "grad_norm_sq");
  void* params = nullptr;
  DType params_dtype = DType::F32;
  if (args.params.defined() && args.params.data != args.master.data) {
    expect_float(args.params, op, "params");
    expect_count(kBackend, args.params, P, op, "params");
    params = args.params.data;
    params_dtype = args.params.dtype;
  }
  TS_CHECK(args.step >= 1, "cuda adamw_step: step {} is not 1-based", args.step);

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
