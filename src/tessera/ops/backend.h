#pragma once
// The op API: every computation the model, trainer and benchmarks need, forward and
// backward, as a facade. Each public op is a plain function (ops/backend.cpp) that checks the
// tensors' placement and shapes, reports the op to the profiler's observer and times it when
// asked, then calls the backend's do_<op>; a backend (backend/cpu, backend/cuda) implements
// only the do_<op>s, over memory it owns, and checks only its own dtype rules. Model and
// trainer code only ever call this interface, and ask what a backend can do with supports(),
// never which vendor it is: a new device is a new backend, never a change to the model.
//
// Conventions:
// - Tensors are contiguous and row-major; shapes are in the comments, N = tokens (B*T).
// - "compute dtype" is the activation/weight dtype of the run (fp32 on the CPU reference,
//   bf16 on GPUs). Statistics (rstd, lse, losses), weight gradients and optimizer state are
//   always fp32.
// - Outputs named d<x> with "accumulates" add into the existing contents (gradient
//   accumulation across micro-batches and residual branches); all other outputs overwrite.
// - Ops are asynchronous with respect to the host on devices that allow it; only
//   download() and synchronize() wait.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

class OpObserver;  // ops/op_observer.h

// What callers may ask of a backend instead of which device or vendor it is.
enum class Capability {
  Bf16Compute,     // bf16 activations and weights (the performance path of GPUs)
  Fp8TensorCores,  // FP8 GEMMs in hardware; the CPU emulates them for tests only
  AsyncQueue,      // ops queue on a device stream and return at once (stream() is valid)
};

// The backend's queue of work (CUDA: its cudaStream_t), for libraries that queue work beside
// the ops, such as a communicator's collectives. Opaque: only code of the same platform
// (backend/<vendor>/) reads `native`. Null on backends that run ops as they are called.
struct StreamHandle {
  void* native = nullptr;
};

// A point in the backend's queue (CUDA: an event). Opaque like StreamHandle.
struct EventHandle {
  void* native = nullptr;
  bool defined() const { return native != nullptr; }
};

struct MemoryStats {
  size_t allocated_bytes = 0;  // live allocations made through this backend
  size_t peak_bytes = 0;       // high-water mark of allocated_bytes since the last reset
  size_t device_total_bytes = 0;
  size_t device_free_bytes = 0;
};

// out = alpha * op(a) @ op(b) + beta * c (+ bias broadcast over rows). Leading dimensions
// of 3-D/4-D tensors are flattened into rows. out must not alias a or b; c may be out; with
// beta = 0, c is not read (it may hold NaN).
struct MatmulArgs {
  Tensor out;            // (M, N), compute dtype or fp32
  Tensor a;              // (M, K), or (K, M) when trans_a
  Tensor b;              // (K, N), or (N, K) when trans_b
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  float beta = 0.0f;
  Tensor c;              // (M, N) read with beta; undefined means out itself
  Tensor bias;           // (N), optional
};

// Shape of causal (optionally sliding-window) grouped-query attention over a packed QKV
// activation. qkv: (B, T, (H + 2*KV) * D) holds, per token, H query heads, then KV key
// heads, then KV value heads; query head h reads key/value head h / (H / KV).
struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  int64_t window = 0;    // > 0: query i sees key j only if i - window < j (and j <= i if causal)
  float scale = 0.0f;    // softmax scale, normally 1/sqrt(head_dim); must be positive
  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
  int64_t tokens() const { return batch * seq; }
};

// A run of the flat parameter buffer and whether AdamW applies weight decay to it
// (Megatron: weight matrices decay, norms and biases do not).
struct ParamSegment {
  int64_t offset = 0;
  int64_t count = 0;
  bool decay = true;
};

struct AdamWArgs {
  Tensor master;         // (P) fp32 master weights, updated in place
  Tensor grad;           // (P) fp32
  Tensor exp_avg;        // (P) fp32 first moment
  Tensor exp_avg_sq;     // (P) fp32 second moment
  Tensor params;         // (P) compute-dtype copy refreshed from master; undefined if master is it
  Tensor grad_norm_sq;   // (1) fp32 on the device: squared global gradient norm. A non-finite
                         // value makes the op change nothing (the step is skipped).
  std::span<const ParamSegment> segments;  // offsets relative to master[0]
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float max_grad_norm = 0;  // clip when the norm exceeds it: g *= max / (norm + 1e-6); 0 = off
  int64_t step = 1;         // 1-based step count for bias correction
};

// ---- FP8 (docs/fp8.md) ----
// Per-tensor scaled FP8: q = saturate(round_to_nearest_even(x * scale)) in e4m3 or e5m2,
// x ~= q * scale_inv. Scales, amaxes and histories are fp32 device scalars/arrays, so that
// no step waits for the host.

// One read of x producing any of: its FP8 copy, its FP8 transpose, and its amax.
struct Fp8CastArgs {
  Tensor x;       // (R, C) compute dtype
  Tensor out;     // (R, C) e4m3 or e5m2, or undefined
  Tensor out_t;   // (C, R) same dtype as out, or undefined
  Tensor scale;   // (1) fp32; read when out or out_t is defined
  Tensor amax;    // (1) fp32 or undefined: max(amax, max |x|), NaN or Inf when x holds one
};

// out = alpha * (a * a_scale_inv) @ (b * b_scale_inv)^T + beta * c (+ bias), accumulated in
// fp32. Both operands are K-major ("TN", the only FP8 layout Hopper tensor cores take), so
// callers pass transposed copies where the bf16 GEMM would use a trans flag. a and b may
// differ in format, but not both e5m2. M, N and K must be multiples of 16.
struct Fp8MatmulArgs {
  Tensor out;          // (M, N) compute dtype or fp32
  Tensor a;            // (M, K) e4m3/e5m2
  Tensor b;            // (N, K) e4m3/e5m2
  Tensor a_scale_inv;  // (1) fp32
  Tensor b_scale_inv;  // (1) fp32
  float alpha = 1.0f;
  float beta = 0.0f;
  Tensor c;            // (M, N) like out, read with beta; undefined means out itself
  Tensor bias;         // (N) like out, optional
  bool fast_accum = false;  // cuBLASLt's faster, less precise accumulation (forward only)
};

// Delayed-scaling update of S tensors that share a format (core/fp8.h,
// fp8_update_scales_reference, states the arithmetic).
struct Fp8ScaleUpdateArgs {
  Tensor amax_history;  // (H, S) fp32; row 0 holds the amaxes since the last update
  Tensor scale;         // (S) fp32, updated
  Tensor scale_inv;     // (S) fp32, = 1 / scale
  Tensor nonfinite;     // (1) fp32 or undefined: set to NaN if any amax of row 0 is non-finite
  float fp8_max = 448.0f;
  int margin = 0;
  bool most_recent = false;
  bool roll = true;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  // How messages name the backend: "cpu", "cuda".
  virtual std::string_view name() const = 0;
  // One line for logs: "cpu (OpenBLAS, 2 threads)", "NVIDIA H100 80GB HBM3 (sm_90, ...)".
  virtual std::string description() const = 0;
  virtual bool supports(Capability c) const = 0;
  // The compute dtype of a run with `precision` auto: bf16 where supported, else fp32.
  DType default_compute_dtype() const {
    return supports(Capability::Bf16Compute) ? DType::BF16 : DType::F32;
  }

  // ---- memory ----
  // Throws OutOfMemoryError naming `what` and the requested and free bytes.
  virtual void* allocate(size_t bytes, const char* what) = 0;
  virtual void release(void* ptr) = 0;
  virtual MemoryStats memory_stats() = 0;
  virtual void reset_peak_memory() = 0;
  void upload(const Tensor& dst, const void* host_src);
  void download(void* host_dst, const Tensor& src);  // waits for completion
  void copy(const Tensor& dst, const Tensor& src);   // same dtype and numel
  virtual void synchronize() = 0;

  // ---- queue and events ----
  virtual StreamHandle stream() const { return {}; }
  // Events belong to the backend that made them and are freed with it at the latest.
  virtual EventHandle create_event() = 0;
  virtual void destroy_event(EventHandle event) = 0;
  // Marks the point after every op queued so far.
  virtual void record_event(EventHandle event) = 0;
  // Ops queued from now on start after `event` (recorded on any queue of this device).
  virtual void wait_event(EventHandle event) = 0;
  // Milliseconds between two recorded events; waits for `end`.
  virtual double elapsed_ms(EventHandle start, EventHandle end) = 0;

  // Markers that show the model's structure in traces (NVTX on CUDA), reported to the op
  // observer too.
  void range_push(const char* name);
  void range_pop();

  // Profiling hook (ops/op_observer.h): while set, every op and range is reported to
  // `observer` (not owned). Null, the default, costs one pointer test per op.
  void set_op_observer(OpObserver* observer) { op_observer_ = observer; }
  OpObserver* op_observer() const { return op_observer_; }

  // Per-op timing for benchmark breakdowns: while enabled, each op's time between a pair of
  // events is summed by op name.
  void enable_op_timing(bool on);
  // (op name, total milliseconds) since timing was enabled; waits for the device.
  std::vector<std::pair<std::string, double>> op_times_ms();

  // ---- elementwise and init ----
  void fill(const Tensor& dst, float value);
  // dst = src converted to dst.dtype (same numel), round-to-nearest-even.
  void convert(const Tensor& dst, const Tensor& src);
  // dst[i] = mean + std * N(0,1) drawn from a counter-based generator keyed by
  // (seed, first_index + i): the same values on every backend and any sharding.
  void init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean, float std);

  // ---- linear algebra ----
  void matmul(const MatmulArgs& args);
  // dbias (N) fp32 accumulates the column sums of dout (M, N).
  void bias_backward(const Tensor& dbias, const Tensor& dout);
  // FP8 (structs above). The CPU backend emulates them: codes from core/fp8.h, then an fp32
  // GEMM of the dequantised values.
  void fp8_cast_transpose(const Fp8CastArgs& args);
  void matmul_fp8(const Fp8MatmulArgs& args);
  void fp8_update_scales(const Fp8ScaleUpdateArgs& args);

  // ---- model ops ----
  // out (N, C) = table[tokens]; tokens (N) int32 in [0, V); table (V, C).
  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table);
  // dtable (V, C) fp32 accumulates dout (N, C) rows at tokens (N).
  void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens);

  // Vocabulary-parallel embedding (Megatron's VocabParallelEmbedding): table (V, C) is the
  // shard holding the rows of token ids [first_id, first_id + V). out (N, C) =
  // table[tokens - first_id], a zero row for a token of another shard, so the shards' outputs
  // add up to the whole lookup.
  void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table,
                               int64_t first_id);
  // dtable (V, C) fp32 accumulates the rows of dout (N, C) whose tokens lie in the shard.
  void embedding_shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens,
                                int64_t first_id);

  // out (N, C) = x * rstd * weight, rstd (N) fp32 = 1 / sqrt(mean(x^2) + eps).
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                       float eps);
  // dx (N, C) accumulates, dweight (C) fp32 accumulates; dout, x (N, C); rstd (N).
  void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& rstd);

  // Rotary embedding, rotate-half convention (Hugging Face Llama), in place on the query and
  // key heads of qkv (B, T, width); token t of every sequence has position t.
  // freqs (T, D) fp32: row t holds cos(t * inv_freq[0..D/2)) then sin(t * inv_freq[0..D/2)).
  void rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s);
  // The inverse rotation applied in place to the query/key gradient heads of dqkv.
  void rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s);

  // out (B, T, H*D) = softmax(q k^T * scale + mask) v per head; lse (B, H, T) fp32 receives
  // each query row's log-sum-exp of the scaled, masked scores.
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& s);
  // dqkv (B, T, width) overwritten with the gradients of q, k and v.
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                          const Tensor& lse, const Tensor& qkv, const AttentionShape& s);

  // Context parallelism (Megatron's all-gather of keys and values): the queries of this
  // rank's tokens attend to the keys and values of every rank's. qkv_all (S, B, T, width):
  // segment s packs q, k and v of rank s's T tokens per sequence (s.seq = T), as an all-gather
  // of every rank's qkv (B, T, width) leaves them; positions (S, T) int32: each token's place
  // in the whole sequence (the same in every sequence). A key is visible from a query at a
  // position no later (causal) and within s.window of it. out (B, T, H*D), lse (B, H, T) fp32:
  // the outputs of segment `segment`'s queries, as attention_forward over the whole sequence
  // gives them.
  void attention_gathered_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_all,
                                  const Tensor& positions, int64_t segment,
                                  const AttentionShape& s);
  // dqkv_all (S, B, T, width) overwritten: segment `segment`'s query gradients in its query
  // heads (zeros in the other segments'), and the key and value gradients its queries give
  // every segment's tokens: the sum over the ranks, reduce-scattered, is each rank's dqkv.
  void attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout, const Tensor& out,
                                   const Tensor& lse, const Tensor& qkv_all,
                                   const Tensor& positions, int64_t segment,
                                   const AttentionShape& s);

  // Generation with a KV cache: q (B, H*D), the query heads of one new token per sequence at
  // position `pos`, attends to the positions visible from it (causal, s.window) of
  // kv (B, S, 2*KV*D), which holds per position the KV key heads then the KV value heads;
  // out (B, H*D). s.seq is the cache's capacity S > pos.
  void attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv, int64_t pos,
                        const AttentionShape& s);

  // gate_up (N, 2F) holds [gate | up]; out (N, F) = silu(gate) * up.
  void swiglu_forward(const Tensor& out, const Tensor& gate_up);
  // dgate_up (N, 2F) overwritten.
  void swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up);

  // losses (N) fp32 = -log softmax(logits)[target]; targets (N) int32, negative = ignored
  // (loss 0, gradient 0). If dlogits is defined (it may alias logits) it receives
  // grad_scale * (softmax(logits) - onehot(target)).
  void cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                     const Tensor& dlogits, float grad_scale);

  // Vocabulary-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy), in two steps
  // around an all-gather of the stats over the shards. logits (N, V) are the columns
  // [first_id, first_id + V) of the whole vocabulary; targets (N) int32, negative = ignored.
  // stats (N, 2) fp32: per row, the logsumexp of this shard's logits and the target's logit
  // when the target lies in the shard (else 0).
  void cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits, const Tensor& targets,
                                 int64_t first_id);
  // all_stats (S, N, 2) fp32: every shard's stats, in shard order. losses (N) fp32 = the
  // logsumexp over all shards - the target's logit (0 if ignored), the same on every shard. If
  // dlogits is defined (it may alias logits) it receives grad_scale * (softmax - onehot(target))
  // on this shard's columns.
  void cross_entropy_shard(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                           const Tensor& all_stats, int64_t first_id, const Tensor& dlogits,
                           float grad_scale);

  // ---- reductions and optimizer ----
  // out (1) fp32 = sum(x) (accumulate=false) or out += sum(x); x fp32. Deterministic.
  void sum(const Tensor& out, const Tensor& x, bool accumulate);
  // out (1) fp32 = sum(x^2) or out += sum(x^2); x fp32. Deterministic.
  void sum_squares(const Tensor& out, const Tensor& x, bool accumulate);
  void adamw_step(const AdamWArgs& args);

 protected:
  // What each backend implements. The facade has checked that every tensor argument is
  // defined (or empty) and lives on this backend's device, and that shapes and counts agree
  // as the op's comment states; a do_<op> checks its dtypes and anything only it knows.
  virtual void do_upload(const Tensor& dst, const void* host_src) = 0;
  virtual void do_download(void* host_dst, const Tensor& src) = 0;
  virtual void do_copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void do_range_push(const char* /*name*/) {}
  virtual void do_range_pop() {}
  virtual void do_fill(const Tensor& dst, float value) = 0;
  virtual void do_convert(const Tensor& dst, const Tensor& src) = 0;
  virtual void do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                              float std) = 0;
  virtual void do_matmul(const MatmulArgs& args) = 0;
  virtual void do_bias_backward(const Tensor& dbias, const Tensor& dout) = 0;
  virtual void do_fp8_cast_transpose(const Fp8CastArgs& args) = 0;
  virtual void do_matmul_fp8(const Fp8MatmulArgs& args) = 0;
  virtual void do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) = 0;
  virtual void do_embedding_forward(const Tensor& out, const Tensor& tokens,
                                    const Tensor& table) = 0;
  virtual void do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                                     const Tensor& tokens) = 0;
  virtual void do_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                          const Tensor& table, int64_t first_id) = 0;
  virtual void do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                           const Tensor& tokens, int64_t first_id) = 0;
  virtual void do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                  const Tensor& weight, float eps) = 0;
  virtual void do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                   const Tensor& x, const Tensor& weight, const Tensor& rstd) = 0;
  virtual void do_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) = 0;
  virtual void do_rope_backward(const Tensor& dqkv, const Tensor& freqs,
                                const AttentionShape& s) = 0;
  virtual void do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                    const AttentionShape& s) = 0;
  virtual void do_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                     const Tensor& lse, const Tensor& qkv,
                                     const AttentionShape& s) = 0;
  virtual void do_attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                             const Tensor& qkv_all, const Tensor& positions,
                                             int64_t segment, const AttentionShape& s) = 0;
  virtual void do_attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout,
                                              const Tensor& out, const Tensor& lse,
                                              const Tensor& qkv_all, const Tensor& positions,
                                              int64_t segment, const AttentionShape& s) = 0;
  virtual void do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                   int64_t pos, const AttentionShape& s) = 0;
  virtual void do_swiglu_forward(const Tensor& out, const Tensor& gate_up) = 0;
  virtual void do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                  const Tensor& gate_up) = 0;
  virtual void do_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                const Tensor& dlogits, float grad_scale) = 0;
  virtual void do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                            const Tensor& targets, int64_t first_id) = 0;
  virtual void do_cross_entropy_shard(const Tensor& losses, const Tensor& logits,
                                      const Tensor& targets, const Tensor& all_stats,
                                      int64_t first_id, const Tensor& dlogits,
                                      float grad_scale) = 0;
  virtual void do_sum(const Tensor& out, const Tensor& x, bool accumulate) = 0;
  virtual void do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) = 0;
  virtual void do_adamw_step(const AdamWArgs& args) = 0;

 private:
  template <class MakeArgs>
  friend class OpScope;  // ops/backend.cpp: the observer and timing around one op
  struct TimedOp {
    const char* name;
    EventHandle start, end;
  };
  EventHandle take_event();
  void fold_timed_ops();

  OpObserver* op_observer_ = nullptr;
  bool timing_ = false;
  std::vector<TimedOp> timed_;  // since the last op_times_ms()
  std::vector<EventHandle> spare_events_;
  std::vector<std::pair<std::string, double>> op_totals_ms_;
};

}  // namespace tessera
