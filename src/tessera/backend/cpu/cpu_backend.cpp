#include "tessera/backend/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "tessera/backend/cpu/attention_blocked.h"
#include "tessera/backend/cpu/reference.h"
#include "tessera/core/split_master.h"
#include "tessera/ops/op_checks.h"

namespace tessera {

namespace {

constexpr std::string_view kBackend = "cpu";  // how op-check messages name this backend

// Heads run in parallel on OpenMP threads; each thread's BLAS calls must then stay on that
// thread instead of spawning BLAS threads of their own.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : saved_(openblas_get_num_threads()) { openblas_set_num_threads(1); }
  ~SingleThreadedBlas() { openblas_set_num_threads(saved_); }

 private:
  int saved_;
};

// CPU backends alive in the process. OpenBLAS's OpenMP build runs a GEMM on as many threads as
// the calling thread's OpenMP thread count (it resets its own thread setting to that count at
// every call), and its buffers are not safe for GEMMs from several threads at once. With more
// than one backend alive (ranks as threads, LocalCommunicator) each GEMM runs on its calling
// thread alone, so that ranks that multiply at the same time, as pipeline stages do, never
// share those buffers.
std::atomic<int> g_live_backends{0};

// The calling thread's OpenMP thread count set to 1 for the scope.
class OneOpenMpThread {
 public:
  OneOpenMpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOpenMpThread() { omp_set_num_threads(saved_); }
  OneOpenMpThread(const OneOpenMpThread&) = delete;
  OneOpenMpThread& operator=(const OneOpenMpThread&) = delete;

 private:
  int saved_;
};

constexpr size_t kAlignment = 64;
// Elementwise work and reductions are cut into chunks of this many elements, a size that does
// not depend on the thread count, so that partial sums always combine in the same order.
constexpr int64_t kChunk = int64_t{1} << 14;
// Column-split reductions give each thread blocks of this many columns (one cache line).
constexpr int64_t kColumnBlock = 16;

void expect_host(const Tensor& t, const char* op, const char* what) {
  OpChecks(kBackend, DeviceKind::CPU, op).placed(t, what);
}

void expect_f32(const Tensor& t, const char* op, const char* what) {
  expect_host(t, op, what);
  TS_CHECK(t.dtype == DType::F32,
           "cpu {}: {} has dtype {}; the CPU backend is the fp32 reference (bf16 and fp8 "
           "compute belong to the GPU backend)",
           op, what, dtype_name(t.dtype));
}

float* f32(const Tensor& t) {
  return t.as<float>();
}

// Token ids are checked on the host before the parallel loops: an exception may not leave an
// OpenMP region.
void expect_ids_below(const Tensor& ids, int64_t limit, bool allow_negative, const char* op,
                      const char* what) {
  const int32_t* p = ids.as<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TS_CHECK(p[i] < limit && (allow_negative || p[i] >= 0),
             "cpu {}: {}[{}] = {} is outside [0, {})", op, what, i, p[i], limit);
  }
}

// dst[c] += the sum over rows r, in row order, of term(r, c), accumulated in double. Threads
// split the columns, so each column's sum, and the result, is the same for any thread count.
template <class Term>
void accumulate_column_sums(float* dst, int64_t rows, int64_t cols, Term term) {
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t c0 = block * kColumnBlock, c1 = std::min(cols, c0 + kColumnBlock);
    double acc[kColumnBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += term(r, c);
    }
    for (int64_t c = c0; c < c1; ++c) dst[c] = static_cast<float>(dst[c] + acc[c - c0]);
  }
}

// The sum of chunk_sum(begin, end) over fixed-size chunks of [0, n), combined in chunk order.
// (A simd reduction inside a chunk splits it the same way on every run of a given build.)
template <class ChunkSum>
double deterministic_sum(int64_t n, ChunkSum chunk_sum) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    partial[c] = chunk_sum(c * kChunk, std::min(n, (c + 1) * kChunk));
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// body(begin, end) over fixed-size chunks of [0, n), in parallel.
template <class Body>
void parallel_chunks(int64_t n, Body body) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) body(c * kChunk, std::min(n, (c + 1) * kChunk));
}

// A tensor the op adds into (a gradient), fp32 or bf16, seen as fp32: a bf16 tensor's values are
// copied into an fp32 buffer the op adds to, and finish() rounds the sums back to nearest even
// once, as the op API defines bf16 accumulation.
class Fp32Accumulator {
 public:
  Fp32Accumulator(const Tensor& t, const char* op, const char* what) : t_(t) {
    expect_host(t, op, what);
    TS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16,
             "cpu {}: {} has dtype {}, expected fp32 or bf16 (a gradient)", op, what,
             dtype_name(t.dtype));
    if (t.dtype == DType::F32) return;
    copy_.resize(static_cast<size_t>(t.numel()));
    const uint16_t* in = t.as<uint16_t>();
    for (size_t i = 0; i < copy_.size(); ++i) copy_[i] = bf16_bits_to_float(in[i]);
  }
  float* data() { return t_.dtype == DType::F32 ? t_.as<float>() : copy_.data(); }
  void finish() {
    if (t_.dtype == DType::F32) return;
    uint16_t* out = t_.as<uint16_t>();
    for (size_t i = 0; i < copy_.size(); ++i) out[i] = float_to_bf16_bits(copy_[i]);
  }

 private:
  Tensor t_;
  std::vector<float> copy_;
};

struct HostMemory {
  size_t total = 0, available = 0;
};

// MemTotal and MemAvailable of /proc/meminfo, in bytes (0 where unreadable).
HostMemory read_host_memory() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  size_t kib = 0;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemTotal:") m.total = kib * 1024;
    if (key == "MemAvailable:") m.available = kib * 1024;
  }
  return m;
}

double gib(size_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

}  // namespace

// ---- memory ----

CpuBackend::CpuBackend() {
  g_live_backends.fetch_add(1, std::memory_order_relaxed);
}

CpuBackend::~CpuBackend() {
  allocations_.release_all([](void* ptr) { std::free(ptr); });
  g_live_backends.fetch_sub(1, std::memory_order_relaxed);
}

std::string CpuBackend::description() const {
  return fmt::format("cpu (OpenBLAS, {} threads)", omp_get_max_threads());
}

bool CpuBackend::supports(Capability c) const {
  switch (c) {
    case Capability::Bf16Compute:
    case Capability::Fp8TensorCores:
    case Capability::Fp8BlockScaling:
    case Capability::AsyncQueue:
    case Capability::CapturesWork:
    case Capability::Fp8Attention:
      return false;
    case Capability::PackedSequences:
      return true;
  }
  return false;
}

EventHandle CpuBackend::create_event() {
  size_t index;
  if (free_events_.empty()) {
    index = event_times_ms_.size();
    event_times_ms_.push_back(0);
  } else {
    index = free_events_.back();
    free_events_.pop_back();
  }
  return EventHandle{reinterpret_cast<void*>(index + 1)};
}

void CpuBackend::destroy_event(EventHandle event) {
  free_events_.push_back(reinterpret_cast<size_t>(event.native) - 1);
}

void CpuBackend::record_event(EventHandle event) {
  event_times_ms_[reinterpret_cast<size_t>(event.native) - 1] =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
}

double CpuBackend::elapsed_ms(EventHandle start, EventHandle end) {
  return event_times_ms_[reinterpret_cast<size_t>(end.native) - 1] -
         event_times_ms_[reinterpret_cast<size_t>(start.native) - 1];
}

void* CpuBackend::allocate(size_t bytes, const char* what) {
  // aligned_alloc wants a multiple of the alignment; a zero-byte request still gets a unique
  // pointer so that release() stays symmetric.
  void* ptr = nullptr;
  if (bytes <= SIZE_MAX - kAlignment) {
    const size_t rounded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
    ptr = std::aligned_alloc(kAlignment, rounded);
  }
  if (ptr == nullptr) {
    const HostMemory host = read_host_memory();
    throw OutOfMemoryError(fmt::format(
        "out of host memory allocating {}: {} bytes ({:.2f} GiB) requested, {} bytes ({:.2f} "
        "GiB) available of {:.2f} GiB; reduce micro_batch_size, seq_length or the model size",
        what != nullptr ? what : "a buffer", bytes, gib(bytes), host.available, gib(host.available),
        gib(host.total)));
  }
  allocations_.add(ptr, bytes);
  return ptr;
}

void CpuBackend::release(void* ptr) {
  if (ptr == nullptr) return;
  allocations_.remove(ptr);
  std::free(ptr);
}

MemoryStats CpuBackend::memory_stats() {
  const HostMemory host = read_host_memory();
  return MemoryStats{allocations_.allocated(), allocations_.peak(), host.total, host.available};
}

void CpuBackend::reset_peak_memory() {
  allocations_.reset_peak();
}

void CpuBackend::do_upload(const Tensor& dst, const void* host_src) {
  if (dst.nbytes() > 0) std::memcpy(dst.data, host_src, dst.nbytes());
}

void CpuBackend::do_download(void* host_dst, const Tensor& src) {
  if (src.nbytes() > 0) std::memcpy(host_dst, src.data, src.nbytes());
}

void CpuBackend::do_copy(const Tensor& dst, const Tensor& src) {
  std::memcpy(dst.data, src.data, dst.nbytes());
}

// ---- elementwise and init ----

void CpuBackend::do_fill(const Tensor& dst, float value) {
  if (dst.dtype == DType::BF16) {  // gradients and optimizer state kept in bf16
    expect_host(dst, "fill", "dst");
    uint16_t* p = dst.as<uint16_t>();
    const uint16_t bits = float_to_bf16_bits(value);
    parallel_chunks(dst.numel(),
                    [&](int64_t begin, int64_t end) { std::fill(p + begin, p + end, bits); });
    return;
  }
  expect_f32(dst, "fill", "dst");
  float* p = f32(dst);
  parallel_chunks(dst.numel(),
                  [&](int64_t begin, int64_t end) { std::fill(p + begin, p + end, value); });
}

void CpuBackend::do_split_master(const Tensor& high, const Tensor& low, const Tensor& master) {
  const float* in = f32(master);
  uint16_t* h = high.as<uint16_t>();
  uint16_t* l = low.as<uint16_t>();
  parallel_chunks(master.numel(), [&](int64_t begin, int64_t end) {
    split_master_values(in + begin, h + begin, l + begin, end - begin);
  });
}

void CpuBackend::do_convert(const Tensor& dst, const Tensor& src) {
  if (dst.dtype == src.dtype) {
    if (dst.data != src.data) std::memcpy(dst.data, src.data, dst.nbytes());
  } else if (src.dtype == DType::F32 && dst.dtype == DType::BF16) {
    const float* in = f32(src);
    uint16_t* out = dst.as<uint16_t>();
    parallel_chunks(src.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = float_to_bf16_bits(in[i]);
    });
  } else if (src.dtype == DType::BF16 && dst.dtype == DType::F32) {
    const uint16_t* in = src.as<uint16_t>();
    float* out = f32(dst);
    parallel_chunks(src.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = bf16_bits_to_float(in[i]);
    });
  } else {
    TS_CHECK(false, "cpu convert: {} -> {} is not supported (fp32 <-> bf16 only)",
             dtype_name(src.dtype), dtype_name(dst.dtype));
  }
}

void CpuBackend::do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                                float std) {
  float* p = f32(dst);
  parallel_chunks(dst.numel(), [&](int64_t begin, int64_t end) {
    ref::init_normal(p + begin, end - begin, seed, first_index + static_cast<uint64_t>(begin), mean,
                     std);
  });
}

// ---- linear algebra ----

void CpuBackend::do_matmul(const MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;
  TS_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX, "cpu matmul: {}x{}x{} exceeds BLAS int", M,
           N, K);
  // A bf16 out (a gradient kept in bf16) is computed in fp32 and rounded once at the end.
  Fp32Accumulator acc(args.out, "matmul", "out");
  float* out = acc.data();
  float beta = args.beta;
  if (args.c.defined() && args.c.data != args.out.data) {
    TS_CHECK(args.c.dtype == args.out.dtype, "cpu matmul: c is {}, out {}",
             dtype_name(args.c.dtype), dtype_name(args.out.dtype));
    // sgemm scales its output in place, so c enters through out.
    if (beta != 0.0f) {
      Fp32Accumulator c(args.c, "matmul", "c");
      std::memcpy(out, c.data(), static_cast<size_t>(M * N) * sizeof(float));
    }
  }
  if (M == 0 || N == 0) return acc.finish();
  std::optional<OneOpenMpThread> alone;
  if (g_live_backends.load(std::memory_order_relaxed) > 1) alone.emplace();
  cblas_sgemm(CblasRowMajor, args.trans_a ? CblasTrans : CblasNoTrans,
              args.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), args.alpha, f32(args.a),
              static_cast<int>(std::max<int64_t>(1, a.cols)), f32(args.b),
              static_cast<int>(std::max<int64_t>(1, b.cols)), beta, out, static_cast<int>(N));
  if (args.bias.defined()) {
    const float* bias = f32(args.bias);
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
    }
  }
  acc.finish();
}

void CpuBackend::do_bias_backward(const Tensor& dbias, const Tensor& dout) {
  Fp32Accumulator db(dbias, "bias_backward", "dbias");
  const MatrixDims d = matrix_dims(dout);
  const float* g = f32(dout);
  accumulate_column_sums(db.data(), d.rows, d.cols, [&](int64_t r, int64_t c) {
    return static_cast<double>(g[r * d.cols + c]);
  });
  db.finish();
}

// ---- model ops ----

void CpuBackend::do_embedding_forward(const Tensor& out, const Tensor& tokens,
                                      const Tensor& table) {
  const MatrixDims t = matrix_dims(table);
  const int64_t N = tokens.numel(), C = t.cols;
  expect_ids_below(tokens, t.rows, false, "embedding_forward", "tokens");
  const int32_t* ids = tokens.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::embedding_forward(f32(out) + n * C, ids + n, f32(table), 1, C);
}

void CpuBackend::do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                                       const Tensor& tokens) {
  Fp32Accumulator acc(dtable, "embedding_backward", "dtable");
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel(), C = t.cols;
  expect_ids_below(tokens, t.rows, false, "embedding_backward", "tokens");
  // Split by columns: a row of dtable that several tokens hit then has one writer, which adds
  // in token order whatever the thread count.
  const int32_t* ids = tokens.as<int32_t>();
  const float* g = f32(dout);
  float* table = acc.data();
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t c0 = block * kColumnBlock, c1 = std::min(C, c0 + kColumnBlock);
    for (int64_t n = 0; n < N; ++n) {
      float* row = table + static_cast<int64_t>(ids[n]) * C;
      for (int64_t c = c0; c < c1; ++c) row[c] += g[n * C + c];
    }
  }
  acc.finish();
}

void CpuBackend::do_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                            const Tensor& table, int64_t first_id) {
  const char* op = "embedding_shard_forward";
  const MatrixDims t = matrix_dims(table);
  const int64_t N = tokens.numel(), C = t.cols;
  // Tokens of other shards are expected; only a negative one is bad data.
  expect_ids_below(tokens, std::numeric_limits<int32_t>::max(), false, op, "tokens");
  const int32_t* ids = tokens.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::embedding_shard_forward(f32(out) + n * C, ids + n, f32(table), 1, C, t.rows, first_id);
}

void CpuBackend::do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                             const Tensor& tokens, int64_t first_id) {
  const char* op = "embedding_shard_backward";
  // A bf16 dtable (a gradient kept in bf16) is summed in fp32 and rounded once, as
  // embedding_backward's.
  Fp32Accumulator acc(dtable, op, "dtable");
  const MatrixDims t = matrix_dims(dtable);
  const int64_t N = tokens.numel(), C = t.cols, V = t.rows;
  expect_ids_below(tokens, std::numeric_limits<int32_t>::max(), false, op, "tokens");
  // Split by columns, as embedding_backward: one writer per row, adding in token order.
  const int32_t* ids = tokens.as<int32_t>();
  const float* g = f32(dout);
  float* table = acc.data();
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t c0 = block * kColumnBlock, c1 = std::min(C, c0 + kColumnBlock);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t id = static_cast<int64_t>(ids[n]) - first_id;
      if (id < 0 || id >= V) continue;
      float* row = table + id * C;
      for (int64_t c = c0; c < c1; ++c) row[c] += g[n * C + c];
    }
  }
  acc.finish();
}

void CpuBackend::do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                    const Tensor& weight, float eps) {
  const MatrixDims d = matrix_dims(x);
  const int64_t N = d.rows, C = d.cols;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    ref::rmsnorm_forward(f32(out) + n * C, f32(rstd) + n, f32(x) + n * C, f32(weight), 1, C, eps);
  }
}

void CpuBackend::do_attention_forward_cast(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                           const AttentionShape& s, const Fp8CastArgs& codes) {
  do_attention_forward(out, lse, qkv, s);
  cast_output(out, codes);
}

void CpuBackend::do_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                         const Tensor& weight, float eps,
                                         const Fp8CastArgs& codes) {
  host_rmsnorm_forward_cast(out, rstd, x, weight, eps, codes);
}

void CpuBackend::do_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x,
                                             const Tensor& /*rstd*/, const Tensor& weight,
                                             float eps) {
  host_rmsnorm_transposed_codes(codes, x, weight, eps);
}

void CpuBackend::do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                     const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  Fp32Accumulator dw(dweight, op, "dweight");
  const MatrixDims d = matrix_dims(x);
  const int64_t N = d.rows, C = d.cols;
  const float *g = f32(dout), *xs = f32(x), *r = f32(rstd);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    ref::rmsnorm_backward<float>(f32(dx) + n * C, nullptr, g + n * C, xs + n * C, f32(weight),
                                 r + n, 1, C);
  }
  accumulate_column_sums(dw.data(), N, C, [&](int64_t n, int64_t c) {
    return static_cast<double>(g[n * C + c]) * xs[n * C + c] * r[n];
  });
  dw.finish();
}

void CpuBackend::do_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  AttentionShape token = s;  // one (b, t) row at a time, with its freqs row
  token.batch = token.seq = 1;
  const int64_t width = s.qkv_width();
  const bool per_row = s.rope_per_token;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < s.tokens(); ++row) {
    ref::rope_forward(f32(qkv) + row * width,
                      f32(freqs) + (per_row ? row : row % s.seq) * s.head_dim, token);
  }
}

void CpuBackend::do_rope_backward(const Tensor& dqkv, const Tensor& freqs,
                                  const AttentionShape& s) {
  AttentionShape token = s;
  token.batch = token.seq = 1;
  const int64_t width = s.qkv_width();
  const bool per_row = s.rope_per_token;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < s.tokens(); ++row) {
    ref::rope_backward(f32(dqkv) + row * width,
                       f32(freqs) + (per_row ? row : row % s.seq) * s.head_dim, token);
  }
}

void CpuBackend::do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                      const AttentionShape& s) {
  if (s.fp8) return ref::attention_fp8_forward(f32(out), f32(lse), f32(qkv), s);
  const int64_t pairs = s.batch * s.heads;
  const SingleThreadedBlas blas_per_thread;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      cpu::attention_head_forward_blocked(f32(out), f32(lse), f32(qkv), s, p / s.heads, p % s.heads,
                                          scratch);
    }
  }
}

void CpuBackend::do_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                       const Tensor& lse, const Tensor& qkv,
                                       const AttentionShape& s) {
  const int64_t B = s.batch, T = s.seq, H = s.heads, KV = s.kv_heads, D = s.head_dim;
  const int64_t Dv = s.v_dim(), width = s.qkv_width(), group = H / KV;
  float* dst = f32(dqkv);

  // Query heads run in parallel. Heads that share a kv head (group > 1) would race on its dk
  // and dv, so each head then accumulates into its own (T, D) and (T, Dv) slices of a scratch
  // buffer, which are summed afterwards in head order: the same result for any thread count.
  std::vector<float> scratch;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t k_stride = width, v_stride = width;
  if (group == 1) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < s.tokens(); ++row) {
      std::fill(dst + row * width + H * D, dst + (row + 1) * width, 0.0f);
    }
  } else {
    scratch.assign(B * H * T * (D + Dv), 0.0f);
    dk = scratch.data();
    dv = dk + B * H * T * D;
    k_stride = D;
    v_stride = Dv;
  }
  const int64_t pairs = B * H;
  const SingleThreadedBlas blas_per_thread;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t b = p / H, h = p % H, kv = h / group;
      float* head_dk = group == 1 ? dst + b * T * width + (H + kv) * D : dk + p * T * D;
      float* head_dv = group == 1 ? dst + b * T * width + (H + KV) * D + kv * Dv : dv + p * T * Dv;
      cpu::attention_head_backward_blocked(dst, head_dk, head_dv, k_stride, v_stride, f32(dout),
                                           f32(out), f32(lse), f32(qkv), s, b, h, scratch);
    }
  }
  if (group == 1) return;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < s.tokens(); ++row) {
    const int64_t b = row / T, t = row % T;
    for (int64_t kv = 0; kv < KV; ++kv) {
      float* dk_row = dst + row * width + (H + kv) * D;
      float* dv_row = dst + row * width + (H + KV) * D + kv * Dv;
      for (int64_t d = 0; d < D; ++d) {
        double k_sum = 0;
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
          k_sum += dk[((b * H + h) * T + t) * D + d];
        dk_row[d] = static_cast<float>(k_sum);
      }
      for (int64_t d = 0; d < Dv; ++d) {
        double v_sum = 0;
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
          v_sum += dv[((b * H + h) * T + t) * Dv + d];
        dv_row[d] = static_cast<float>(v_sum);
      }
    }
  }
}

void CpuBackend::do_attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                               const Tensor& qkv, const Tensor& kv_all,
                                               const Tensor& positions, int64_t segment,
                                               const AttentionShape& s) {
  const int64_t segments = positions.numel() / s.seq, pairs = s.batch * s.heads;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; ++p)
    ref::attention_gathered_head_forward(f32(out), f32(lse), f32(qkv), f32(kv_all),
                                         positions.as<int32_t>(), segments, segment, s,
                                         p / s.heads, p % s.heads);
}

void CpuBackend::do_attention_gathered_backward(const Tensor& dqkv, const Tensor& dkv_all,
                                                const Tensor& dout, const Tensor& out,
                                                const Tensor& lse, const Tensor& qkv,
                                                const Tensor& kv_all, const Tensor& positions,
                                                int64_t segment, const AttentionShape& s) {
  const int64_t segments = positions.numel() / s.seq;
  std::memset(dkv_all.data, 0, dkv_all.nbytes());
  // The heads that share a key/value head add into the same rows: each thread takes a (batch,
  // key/value head) pair and its query heads in order, the reference's order.
  const int64_t group = s.heads / s.kv_heads, pairs = s.batch * s.kv_heads;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = p / s.kv_heads, kv = p % s.kv_heads;
    for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
      ref::attention_gathered_head_backward(f32(dqkv), f32(dkv_all), f32(dout), f32(out),
                                            f32(lse), f32(qkv), f32(kv_all),
                                            positions.as<int32_t>(), segments, segment, s, b, h);
  }
}

// One token per sequence: little work, so the reference's loops as they are.
void CpuBackend::do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                     const Tensor& positions, int64_t pos, const AttentionShape& s) {
  ref::attention_decode(f32(out), f32(q), f32(kv),
                        positions.defined() ? positions.as<int32_t>() : nullptr, pos, s);
}

void CpuBackend::do_cache_write(const Tensor& cache, const Tensor& src, int64_t src_col,
                                const Tensor& positions) {
  const int64_t B = cache.dim(0), S = cache.dim(1), W = cache.dim(2);
  const int64_t cols = matrix_dims(src).cols;
  const size_t e = dtype_size(cache.dtype);
  const int32_t* at = positions.as<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TS_CHECK(at[b] >= 0 && at[b] < S, "cache_write: position {} outside the cache's {}", at[b], S);
    std::memcpy(static_cast<char*>(cache.data) + ((b * S + at[b]) * W) * e,
                static_cast<const char*>(src.data) + (b * cols + src_col) * e, W * e);
  }
}

namespace {

// f(first token, count) over blocks of an MLA packing's tokens in parallel: each token's row
// is computed alone.
template <class F>
void mla_qkv_in_token_blocks(const MlaQkvArgs& a, F&& f) {
  constexpr int64_t kBlock = 64;
  const int64_t N = a.s.tokens(), blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk)
    f(blk * kBlock, std::min<int64_t>(kBlock, N - blk * kBlock));
}

}  // namespace

void CpuBackend::do_mla_qkv_forward(const MlaQkvArgs& a) {
  const int64_t q_stride = matrix_dims(a.q).cols, k_stride = matrix_dims(a.k_rope).cols;
  mla_qkv_in_token_blocks(a, [&](int64_t first, int64_t tokens) {
    ref::mla_qkv_forward(f32(a.qkv), f32(a.q) + a.q_col, q_stride, f32(a.k_rope) + a.k_col,
                         k_stride, f32(a.kv), f32(a.freqs), a.s, a.rope_dim, first, tokens);
  });
}

void CpuBackend::do_mla_qkv_backward(const MlaQkvArgs& g) {
  const int64_t q_stride = matrix_dims(g.q).cols, k_stride = matrix_dims(g.k_rope).cols;
  mla_qkv_in_token_blocks(g, [&](int64_t first, int64_t tokens) {
    ref::mla_qkv_backward(f32(g.q) + g.q_col, q_stride, f32(g.k_rope) + g.k_col, k_stride,
                          f32(g.kv), f32(g.qkv), f32(g.freqs), g.s, g.rope_dim, first, tokens);
  });
}

void CpuBackend::do_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src,
                                 int64_t src_col, int64_t cols) {
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  const size_t e = dtype_size(dst.dtype);
  const char* from = static_cast<const char*>(src.data);
  char* to = static_cast<char*>(dst.data);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < d.rows; ++n)
    std::memcpy(to + (n * d.cols + dst_col) * e, from + (n * r.cols + src_col) * e, cols * e);
}

void CpuBackend::do_copy_rows(const Tensor& dst, const Tensor& dst_rows, const Tensor& src,
                              const Tensor& src_rows) {
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  if (dst_rows.defined()) expect_ids_below(dst_rows, d.rows, false, "copy_rows", "dst_rows");
  if (src_rows.defined()) expect_ids_below(src_rows, r.rows, false, "copy_rows", "src_rows");
  const int64_t count = dst_rows.defined() ? dst_rows.numel() : src_rows.numel();
  const size_t row_bytes = static_cast<size_t>(d.cols) * dtype_size(dst.dtype);
  const auto row = [](const Tensor& rows, int64_t i) {
    return rows.defined() ? static_cast<int64_t>(rows.as<int32_t>()[i]) : i;
  };
  const char* from = static_cast<const char*>(src.data);
  char* to = static_cast<char*>(dst.data);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(to + row(dst_rows, i) * row_bytes, from + row(src_rows, i) * row_bytes, row_bytes);
}

// ---- elementwise

void CpuBackend::do_add(const Tensor& out, const Tensor& a, const Tensor& b) {
  parallel_chunks(a.numel(), [&](int64_t begin, int64_t end) {
    ref::add(f32(out) + begin, f32(a) + begin, f32(b) + begin, end - begin);
  });
}

void CpuBackend::do_scale(const Tensor& out, const Tensor& x, float alpha) {
  parallel_chunks(x.numel(), [&](int64_t begin, int64_t end) {
    ref::scale(f32(out) + begin, f32(x) + begin, alpha, end - begin);
  });
}

void CpuBackend::do_softcap(const Tensor& out, const Tensor& x, float cap) {
  parallel_chunks(x.numel(), [&](int64_t begin, int64_t end) {
    ref::softcap(f32(out) + begin, f32(x) + begin, cap, end - begin);
  });
}

void CpuBackend::do_softcap_backward(const Tensor& dx, const Tensor& dy, const Tensor& y,
                                     float cap) {
  parallel_chunks(y.numel(), [&](int64_t begin, int64_t end) {
    ref::softcap_backward(f32(dx) + begin, f32(dy) + begin, f32(y) + begin, cap, end - begin);
  });
}

void CpuBackend::do_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::swiglu_forward(f32(out) + n * F, f32(gate_up) + n * 2 * F, 1, F);
}

void CpuBackend::do_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up,
                                        const Fp8CastArgs& codes) {
  host_swiglu_forward_cast(out, gate_up, codes);
}

void CpuBackend::do_swiglu_backward_cast(const Tensor& dgate_up, const Tensor& dout,
                                         const Tensor& gate_up, const Fp8CastArgs& codes) {
  do_swiglu_backward(dgate_up, dout, gate_up);
  cast_output(dgate_up, codes);
}

void CpuBackend::do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                    const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(gate_up);
  const int64_t N = d.rows, F = d.cols / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    ref::swiglu_backward(f32(dgate_up) + n * 2 * F, f32(dout) + n * F, f32(gate_up) + n * 2 * F, 1,
                         F);
  }
}

void CpuBackend::do_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                  const Tensor& dlogits, float grad_scale) {
  const char* op = "cross_entropy";
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols;
  float* dx = nullptr;
  if (dlogits.defined()) {
    dx = f32(dlogits);
  }
  expect_ids_below(targets, V, true, op, "targets");
  const int32_t* ids = targets.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    ref::cross_entropy(f32(losses) + n, dx != nullptr ? dx + n * V : nullptr, f32(logits) + n * V,
                       ids + n, 1, V, grad_scale);
  }
}

void CpuBackend::do_log_softmax_gather(const Tensor& logps, const Tensor& lse, const Tensor& logits,
                                       const Tensor& targets) {
  const auto [N, V] = matrix_dims(logits);
  expect_ids_below(targets, V, true, "log_softmax_gather", "targets");
  const int32_t* ids = targets.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::log_softmax_gather(f32(logps) + n, f32(lse) + n, f32(logits) + n * V, ids + n, 1, V);
}

void CpuBackend::do_sample_tokens(const Tensor& tokens, const Tensor& logps, const Tensor& entropy,
                                  const Tensor& logits, const Tensor& streams, const Tensor& steps,
                                  int64_t vocab, float temperature, float min_p, uint64_t seed) {
  const auto [B, V] = matrix_dims(logits);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b)
    ref::sample_tokens(tokens.as<int32_t>() + b, f32(logps) + b, f32(entropy) + b, f32(logits) + b * V,
                       streams.as<int32_t>() + b, steps.as<int32_t>() + b, 1, V, vocab, temperature,
                       min_p, seed);
}

void CpuBackend::do_log_softmax_gather_backward(const Tensor& dlogits, const Tensor& dlogps,
                                                const Tensor& logits, const Tensor& lse,
                                                const Tensor& targets) {
  const auto [N, V] = matrix_dims(logits);
  expect_ids_below(targets, V, true, "log_softmax_gather_backward", "targets");
  const int32_t* ids = targets.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::log_softmax_gather_backward(f32(dlogits) + n * V, f32(dlogps) + n, f32(logits) + n * V,
                                     f32(lse) + n, ids + n, 1, V);
}

// ---- QK norm ----

void CpuBackend::do_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                                    const Tensor& q_weight, const Tensor& k_weight,
                                    const AttentionShape& s, float eps) {
  AttentionShape token = s;  // one token at a time
  token.batch = token.seq = 1;
  const int64_t W = s.qkv_width(), heads = s.heads + s.kv_heads;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < s.tokens(); ++n)
    ref::qk_norm_forward(f32(out) + n * W, f32(rstd) + n * heads, f32(qkv) + n * W, f32(q_weight),
                         f32(k_weight), token, eps);
}

void CpuBackend::do_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight,
                                     const Tensor& dk_weight, const Tensor& dout, const Tensor& qkv,
                                     const Tensor& q_weight, const Tensor& k_weight,
                                     const Tensor& rstd, const AttentionShape& s) {
  const char* op = "qk_norm_backward";
  // The reference adds into fp32 weight gradients only (bf16 ones are the GPU's).
  expect_f32(dq_weight, op, "dq_weight");
  ref::qk_norm_backward(f32(dqkv), f32(dq_weight), f32(dk_weight), f32(dout), f32(qkv),
                        f32(q_weight), f32(k_weight), f32(rstd), s);
}

// ---- mixture of experts ----
// Router, losses and counts are per-token loops over a few experts: the reference's, run as
// they are. Dispatch and combine are row copies spread over threads by token.

namespace {

// Expert ids of (N, K) routing slots, each in [0, E).
const int32_t* expert_ids(const Tensor& indices, int64_t experts, const char* op) {
  expect_ids_below(indices, experts, false, op, "indices");
  return indices.as<int32_t>();
}

// Rows of a permuted (R, C) tensor, each in [0, R), or -1 for a dropped pair.
const int32_t* permuted_rows(const Tensor& rows, int64_t R, const char* op) {
  expect_ids_below(rows, R, true, op, "rows");
  return rows.as<int32_t>();
}

}  // namespace

void CpuBackend::do_moe_router_forward(const Tensor& indices, const Tensor& weights,
                                       const Tensor& logits, const Tensor& bias,
                                       const MoeRouting& r) {
  const int64_t N = matrix_dims(logits).rows, E = r.experts, K = r.topk;
  const float* b = bias.defined() ? f32(bias) : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::moe_router_forward(indices.as<int32_t>() + n * K, f32(weights) + n * K,
                            f32(logits) + n * E, b, 1, r, n);
}

void CpuBackend::do_moe_router_backward(const Tensor& dlogits, const Tensor& dweights,
                                        const Tensor& logits, const Tensor& indices,
                                        const MoeRouting& r) {
  const char* op = "moe_router_backward";
  const int32_t* ids = expert_ids(indices, r.experts, op);
  const int64_t N = matrix_dims(logits).rows, E = r.experts, K = r.topk;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::moe_router_backward(f32(dlogits) + n * E, f32(dweights) + n * K, f32(logits) + n * E,
                             ids + n * K, 1, r);
}

void CpuBackend::do_moe_aux_loss(const MoeAuxLossArgs& a) {
  const char* op = "moe_aux_loss";
  const int32_t* ids = expert_ids(a.indices, a.routing.experts, op);
  ref::moe_aux_loss(a.loss.defined() ? f32(a.loss) : nullptr,
                    a.dlogits.defined() ? f32(a.dlogits) : nullptr, f32(a.logits), ids,
                    matrix_dims(a.logits).rows, a.routing, a.seq, a.grad_scale);
}

void CpuBackend::do_moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                               float grad_scale) {
  const char* op = "moe_z_loss";
  if (loss.defined()) expect_f32(loss, op, "loss");
  if (dlogits.defined()) expect_f32(dlogits, op, "dlogits");
  const MatrixDims d = matrix_dims(logits);
  ref::moe_z_loss(loss.defined() ? f32(loss) : nullptr, dlogits.defined() ? f32(dlogits) : nullptr,
                  f32(logits), d.rows, d.cols, grad_scale);
}

void CpuBackend::do_moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  const char* op = "moe_expert_counts";
  const int32_t* ids = expert_ids(indices, counts.numel(), op);
  ref::moe_expert_counts(f32(counts), ids, indices.numel(), counts.numel());
}

void CpuBackend::do_moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) {
  ref::moe_expert_bias_update(f32(bias), f32(counts), bias.numel(), rate);
}

void CpuBackend::do_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                                const Tensor& x, const Tensor& indices, int64_t align,
                                const MoeCapacity& capacity) {
  const char* op = "moe_permute";
  const int64_t E = offsets.numel() - 1;
  const int32_t* ids = expert_ids(indices, E, op);
  const MatrixDims xd = matrix_dims(x), pd = matrix_dims(xp);
  const int64_t N = xd.rows, C = xd.cols, K = matrix_dims(indices).cols;
  std::vector<char> keep;
  if (capacity.capacity > 0) {
    std::vector<double> w;
    if (!capacity.by_position) {
      w.assign(f32(capacity.weights), f32(capacity.weights) + N * K);
    }
    keep = ref::moe_capacity_keep(ids, w.data(), N, K, E, capacity.capacity, capacity.by_position);
    if (capacity.dropped.defined()) {
      *f32(capacity.dropped) = static_cast<float>(std::count(keep.begin(), keep.end(), 0));
    }
  }
  ref::moe_dispatch_plan(rows.as<int32_t>(), offsets.as<int32_t>(), ids, N, K, E, align,
                         keep.empty() ? nullptr : keep.data());
  float* out = f32(xp);
  const int32_t* to = rows.as<int32_t>();
  parallel_chunks(pd.rows * C,
                  [&](int64_t begin, int64_t end) { std::fill(out + begin, out + end, 0.0f); });
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      if (to[n * K + k] >= 0)
        std::copy(f32(x) + n * C, f32(x) + (n + 1) * C, out + to[n * K + k] * C);
}

void CpuBackend::do_moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) {
  const char* op = "moe_permute_backward";
  const MatrixDims xd = matrix_dims(dx);
  const int32_t* from = permuted_rows(rows, matrix_dims(dxp).rows, op);
  const int64_t N = xd.rows, C = xd.cols, K = matrix_dims(rows).cols;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::moe_permute_backward(f32(dx) + n * C, f32(dxp), from + n * K, 1, K, C);
}

void CpuBackend::do_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                                  const Tensor& weights) {
  const char* op = "moe_unpermute";
  const MatrixDims od = matrix_dims(out);
  const int32_t* from = permuted_rows(rows, matrix_dims(yp).rows, op);
  const int64_t N = od.rows, C = od.cols, K = matrix_dims(rows).cols;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::moe_unpermute(f32(out) + n * C, f32(yp), from + n * K, f32(weights) + n * K, 1, K, C);
}

void CpuBackend::do_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights,
                                           const Tensor& dout, const Tensor& yp, const Tensor& rows,
                                           const Tensor& weights) {
  const char* op = "moe_unpermute_backward";
  const MatrixDims od = matrix_dims(dout), pd = matrix_dims(yp);
  const int32_t* to = permuted_rows(rows, pd.rows, op);
  const int64_t N = od.rows, C = od.cols, K = matrix_dims(rows).cols;
  float* d = f32(dyp);
  parallel_chunks(pd.rows * C,
                  [&](int64_t begin, int64_t end) { std::fill(d + begin, d + end, 0.0f); });
  // Every (n, k) writes its own row of dyp (the plan gives each copy a distinct row).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = to[n * K + k];
      const float w = f32(weights)[n * K + k];
      double dot = 0;
      for (int64_t c = 0; c < C && row >= 0; ++c) {
        dot += static_cast<double>(f32(dout)[n * C + c]) * f32(yp)[row * C + c];
        d[row * C + c] = w * f32(dout)[n * C + c];
      }
      f32(dweights)[n * K + k] = static_cast<float>(dot);
    }
  }
}

namespace {

// The groups of a grouped GEMM from the host offsets, each as [begin, rows) and its weight.
struct GroupRows {
  int64_t begin, rows, weight;
};
std::vector<GroupRows> group_rows(std::span<const int32_t> offsets,
                                  std::span<const int32_t> weights) {
  std::vector<GroupRows> g;
  for (size_t i = 0; i + 1 < offsets.size(); ++i)
    g.push_back({offsets[i], offsets[i + 1] - offsets[i],
                 weights.empty() ? static_cast<int64_t>(i) : weights[i]});
  return g;
}

}  // namespace

void CpuBackend::do_grouped_matmul(const GroupedMatmulArgs& a) {
  const MatrixDims o = matrix_dims(a.out);
  const int64_t N = o.cols, K = matrix_dims(a.a).cols;
  std::optional<OneOpenMpThread> alone;
  if (g_live_backends.load(std::memory_order_relaxed) > 1) alone.emplace();
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets = host_group_offsets(a.offsets, a.host_offsets, storage);
  for (const GroupRows& g : group_rows(offsets, a.group_weights)) {
    if (g.rows == 0) continue;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, a.trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(g.rows), static_cast<int>(N), static_cast<int>(K), 1.0f,
                f32(a.a) + g.begin * K, static_cast<int>(std::max<int64_t>(1, K)),
                f32(a.b) + g.weight * N * K,
                static_cast<int>(std::max<int64_t>(1, a.trans_b ? K : N)), 0.0f,
                f32(a.out) + g.begin * N, static_cast<int>(std::max<int64_t>(1, N)));
  }
  float* tail = f32(a.out) + static_cast<int64_t>(offsets.back()) * N;
  std::fill(tail, f32(a.out) + o.rows * N, 0.0f);
}

void CpuBackend::do_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  const char* op = "grouped_matmul_wgrad";
  // A bf16 out (expert gradients kept in bf16) is summed in fp32 and rounded once at the end.
  Fp32Accumulator acc(a.out, op, "out");
  float* out = acc.data();
  const int64_t M = a.out.dim(1), N = a.out.dim(2), W = a.out.dim(0);
  // A weight's first group applies beta, later ones add; BLAS is never called with K = 0
  // (it may leave beta to the caller), so weights without rows are scaled here.
  std::optional<OneOpenMpThread> alone;
  if (g_live_backends.load(std::memory_order_relaxed) > 1) alone.emplace();
  std::vector<char> started(static_cast<size_t>(W), 0);
  std::vector<int32_t> storage;
  for (const GroupRows& g :
       group_rows(host_group_offsets(a.offsets, a.host_offsets, storage), a.group_weights)) {
    if (g.rows == 0) continue;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(g.rows), 1.0f, f32(a.a) + g.begin * M,
                static_cast<int>(std::max<int64_t>(1, M)), f32(a.b) + g.begin * N,
                static_cast<int>(std::max<int64_t>(1, N)), started[g.weight] ? 1.0f : a.beta,
                out + g.weight * M * N, static_cast<int>(std::max<int64_t>(1, N)));
    started[g.weight] = 1;
  }
  for (int64_t w = 0; w < W; ++w) {
    if (started[w]) continue;
    float* weight = out + w * M * N;
    for (int64_t i = 0; i < M * N; ++i) weight[i] = a.beta == 0.0f ? 0.0f : a.beta * weight[i];
  }
  acc.finish();
}

void CpuBackend::do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                              const Tensor& targets, int64_t first_id) {
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols;
  const int32_t* ids = targets.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    ref::cross_entropy_shard_stats(f32(stats) + 2 * n, f32(logits) + n * V, ids + n, 1, V,
                                   first_id);
}

void CpuBackend::do_cross_entropy_shard(const Tensor& losses, const Tensor& logits,
                                        const Tensor& targets, const Tensor& all_stats,
                                        int64_t first_id, const Tensor& dlogits, float grad_scale) {
  const MatrixDims d = matrix_dims(logits);
  const int64_t N = d.rows, V = d.cols, S = all_stats.numel() / (2 * N);
  float* dx = nullptr;
  if (dlogits.defined()) {
    dx = f32(dlogits);
  }
  // Row n of each shard's stats, gathered so that the reference sees S shards of one row.
  const float* stats = f32(all_stats);
  const int32_t* ids = targets.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> row_stats(2 * S);
    for (int64_t s = 0; s < S; ++s) {
      row_stats[2 * s] = stats[(s * N + n) * 2];
      row_stats[2 * s + 1] = stats[(s * N + n) * 2 + 1];
    }
    ref::cross_entropy_shard(f32(losses) + n, dx != nullptr ? dx + n * V : nullptr,
                             f32(logits) + n * V, ids + n, row_stats.data(), S, 1, V, first_id,
                             grad_scale);
  }
}

// ---- reductions and optimizer ----

void CpuBackend::do_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  const float* p = f32(x);
  const double total = deterministic_sum(x.numel(), [&](int64_t begin, int64_t end) {
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = begin; i < end; ++i) acc += p[i];
    return acc;
  });
  float* o = f32(out);
  *o = static_cast<float>((accumulate ? static_cast<double>(*o) : 0.0) + total);
}

void CpuBackend::do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  double total = 0;
  if (x.dtype == DType::BF16) {  // the norm of bf16 gradients
    expect_host(x, "sum_squares", "x");
    const uint16_t* p = x.as<uint16_t>();
    total = deterministic_sum(x.numel(), [&](int64_t begin, int64_t end) {
      double acc = 0;
      for (int64_t i = begin; i < end; ++i) {
        const double v = bf16_bits_to_float(p[i]);
        acc += v * v;
      }
      return acc;
    });
  } else {
    expect_f32(x, "sum_squares", "x");
    const float* p = f32(x);
    total = deterministic_sum(x.numel(), [&](int64_t begin, int64_t end) {
      double acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = begin; i < end; ++i) acc += static_cast<double>(p[i]) * p[i];
      return acc;
    });
  }
  float* o = f32(out);
  *o = static_cast<float>((accumulate ? static_cast<double>(*o) : 0.0) + total);
}

namespace {

// fp32 or bf16 storage of one AdamW state tensor: its elements [o, o + n) are read into fp32
// and written back rounded to nearest even. fp32 tensors are used in place.
class StateView {
 public:
  StateView(const Tensor& t, const char* op, const char* what) : t_(t) {
    expect_host(t, op, what);
    TS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16,
             "cpu {}: {} has dtype {}, expected fp32 or bf16", op, what, dtype_name(t.dtype));
  }
  // The fp32 values of [o, o + n): the tensor itself, or `scratch` filled from its bf16.
  float* read(int64_t o, int64_t n, std::vector<float>& scratch) const {
    if (t_.dtype == DType::F32) return f32(t_) + o;
    scratch.resize(static_cast<size_t>(n));
    const uint16_t* in = t_.as<uint16_t>() + o;
    for (int64_t i = 0; i < n; ++i) scratch[i] = bf16_bits_to_float(in[i]);
    return scratch.data();
  }
  // Stores values (from read()) back when the tensor is bf16.
  void write(int64_t o, int64_t n, const float* values) const {
    if (t_.dtype == DType::F32) return;
    uint16_t* out = t_.as<uint16_t>() + o;
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16_bits(values[i]);
  }

 private:
  Tensor t_;
};

// The master's fp32 values of [o, o + n), read and written back: the state tensor the step
// updates (an fp32 master, or the bf16 parameters themselves without one), or a split master
// (core/split_master.h) joined from the bf16 parameters (its high halves) and its low halves.
class MasterView {
 public:
  MasterView(const AdamWArgs& args, const char* op) {
    if (!args.master.defined()) {
      whole_.emplace(args.params, op, "params");
    } else if (args.master.dtype == DType::U16) {
      high_ = args.params.as<uint16_t>();
      low_ = args.master.as<uint16_t>();
    } else {
      expect_f32(args.master, op, "master");
      whole_.emplace(args.master, op, "master");
    }
  }
  float* read(int64_t o, int64_t n, std::vector<float>& scratch) const {
    if (whole_) return whole_->read(o, n, scratch);
    scratch.resize(static_cast<size_t>(n));
    join_master_values(high_ + o, low_ + o, scratch.data(), n);
    return scratch.data();
  }
  void write(int64_t o, int64_t n, const float* values) const {
    if (whole_) return whole_->write(o, n, values);
    split_master_values(values, high_ + o, low_ + o, n);
  }

 private:
  std::optional<StateView> whole_;
  uint16_t* high_ = nullptr;
  uint16_t* low_ = nullptr;
};

}  // namespace

void CpuBackend::do_adamw_step(const AdamWArgs& args) {
  const char* op = "adamw_step";
  const MasterView master(args, op);
  const StateView grad(args.grad, op, "grad"), m(args.exp_avg, op, "exp_avg"),
      v(args.exp_avg_sq, op, "exp_avg_sq");
  // An fp32 master's compute-dtype copy, written beside it (a split master's high halves are
  // written by master.write()).
  float* params = nullptr;
  if (args.master.defined() && args.master.dtype == DType::F32 && args.params.defined() &&
      args.params.data != args.master.data) {
    params = f32(args.params);
  }

  const std::optional<double> scale =
      ref::adamw_grad_scale(*f32(args.grad_norm_sq), args.max_grad_norm);
  if (!scale) return;

  // Segments are cut into chunks so that one large tensor (the embedding) and many small ones
  // (norm weights) both spread over all threads in a single parallel loop.
  struct Piece {
    int64_t offset, count;
    bool decay;
  };
  std::vector<Piece> pieces;
  for (const ParamSegment& seg : args.segments) {
    for (int64_t begin = 0; begin < seg.count; begin += kChunk) {
      pieces.push_back({seg.offset + begin, std::min(kChunk, seg.count - begin), seg.decay});
    }
  }
  const ref::AdamWSettings settings = ref::AdamWSettings::from(args);
  const int64_t count = static_cast<int64_t>(pieces.size());
#pragma omp parallel
  {
    std::vector<float> p_tmp, g_tmp, m_tmp, v_tmp;  // a bf16 piece's fp32 values
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const Piece& piece = pieces[i];
      const int64_t o = piece.offset, n = piece.count;
      float* p = master.read(o, n, p_tmp);
      float* mv = m.read(o, n, m_tmp);
      float* vv = v.read(o, n, v_tmp);
      ref::adamw_update(p, params != nullptr ? params + o : nullptr, mv, vv, grad.read(o, n, g_tmp),
                        n, settings, piece.decay, *scale);
      master.write(o, n, p);
      m.write(o, n, mv);
      v.write(o, n, vv);
    }
  }
}

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace tessera
