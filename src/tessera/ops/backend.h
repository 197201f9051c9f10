#pragma once
// The op API: every computation the model, trainer and benchmarks need, forward and
// backward, as a facade. The ops are the lines of one table (ops/op_table.inc); each public op
// is a function generated from its line (ops/backend.cpp) that checks the tensors' placement,
// shapes and dtypes, reports the op to the profiler's observer and times it when asked, then
// calls the backend's do_<op>. A backend (backend/cpu, backend/cuda) implements only the
// do_<op>s, over memory it owns, and checks only what only it knows. Model and trainer code
// only ever call this interface, and ask what a backend can do with supports() and
// supports_op(), never which vendor it is: a new device is a new backend, never a change to
// the model. The conventions of shapes and dtypes are at the top of ops/op_table.inc.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/fp8.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/op_table.h"

namespace tessera {

class OpObserver;  // ops/op_observer.h

// What callers may ask of a backend instead of which device or vendor it is.
enum class Capability {
  Bf16Compute,      // bf16 activations and weights (the performance path of GPUs)
  Fp8TensorCores,   // FP8 GEMMs in hardware; the CPU emulates them for tests only
  AsyncQueue,       // ops queue on a device stream and return at once (stream() is valid)
  Fp8BlockScaling,  // FP8 GEMMs with 1x128 / 128x128 block scales (Fp8Scaling) in hardware
  PackedSequences,  // AttentionShape's document_starts and rope_per_token (packed documents)
  CapturesWork,     // Backend::capture records ops into replayable graphs (CUDA graphs)
  Fp8Attention,     // AttentionShape::fp8 in hardware (FP8 tensor cores); the CPU emulates it
                    // for tests only
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
  Tensor out;  // (M, N), compute dtype or fp32
  Tensor a;    // (M, K), or (K, M) when trans_a
  Tensor b;    // (K, N), or (N, K) when trans_b
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  float beta = 0.0f;
  Tensor c;     // (M, N) read with beta; undefined means out itself
  Tensor bias;  // (N), optional
};

// Shape of causal (optionally sliding-window) grouped-query attention over a packed QKV
// activation. qkv: (B, T, (H + KV) * D + KV * Dv) holds, per token, H query heads and KV key
// heads of D, then KV value heads of Dv; query head h reads key/value head h / (H / KV). The
// output has H heads of Dv. Dv is D except in multi-latent attention (DeepSeek: D 192, Dv 128).
struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  int64_t window = 0;      // > 0: query i sees key j only if i - window < j (and j <= i if causal)
  float scale = 0.0f;      // softmax scale, normally 1/sqrt(head_dim); must be positive
  int64_t v_head_dim = 0;  // Dv; 0: head_dim
  // Packed sequences (reset_attention_mask): (B, T) int32, the first token of each token's
  // document; query i sees key j only if j >= document_starts[b, i]. Undefined: one document
  // per sequence. Backends with Capability::PackedSequences run it.
  Tensor document_starts;
  // With document_starts: the (query, key) pairs its documents (and window) leave visible,
  // summed over the batch, which the ops' cost counts (the device's starts are not read back
  // for it); 0: unknown, the whole causal band is counted.
  double document_pairs = 0;
  // reset_position_ids: the rope ops' freqs hold a row per token (B * T rows), each at its
  // position in its document; false: row t for token t of every sequence. Backends with
  // Capability::PackedSequences run it.
  bool rope_per_token = false;
  // fp8_dot_product_attention: attention_forward (and attention_forward_cast) multiply e4m3
  // codes (op_table.inc's attention_forward gives the numerics); heads of one width. The
  // backward ignores it: bf16 over qkv with the forward's out and lse. Backends with
  // Capability::Fp8Attention run it.
  bool fp8 = false;
  int64_t v_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  int64_t qkv_width() const { return (heads + kv_heads) * head_dim + kv_heads * v_dim(); }
  // Of a token's key heads then value heads alone (qkv's last columns; the KV cache's rows).
  int64_t kv_width() const { return kv_heads * (head_dim + v_dim()); }
  int64_t out_width() const { return heads * v_dim(); }  // of out (B, T, H * Dv)
  int64_t tokens() const { return batch * seq; }
};

// Multi-head latent attention (DeepSeek-V2/V3, model/blocks/mla_attention.h) assembles the
// attention op's qkv (s: H query and H key heads of D = Dn + Dr, H value heads of Dv) from
// its projections, per token:
//   query head h  = q[h]                    both parts as projected, the rope part rotated;
//   key head h    = [kv[h]'s first Dn | the rope key, rotated]   (one rope key for all heads);
//   value head h  = kv[h]'s last Dv.
// The rope part of a query head and the rope key arrive in DeepSeek's interleaved layout and
// leave rotated in the rotate-half layout, as Hugging Face's apply_rotary_pos_emb_interleave
// does: with c, s = freqs[t][i], freqs[t][Dr/2 + i] (their cos and sin, times YaRN's mscale),
//   out[i] = c x[2i] - s x[2i+1],   out[Dr/2 + i] = s x[2i] + c x[2i+1].
// Both queries and keys are permuted alike, so attention scores are those of rotating the
// interleaved pairs in place, and Hugging Face's DeepSeek weights load unpermuted.
struct MlaQkvArgs {
  Tensor qkv;  // (N, s.qkv_width()) compute dtype
  Tensor q;    // (N, Wq): the H query heads [nope Dn | rope Dr] at columns [q_col, q_col + H D)
  int64_t q_col = 0;
  Tensor k_rope;  // (N, Wk): the rope key at columns [k_col, k_col + Dr)
  int64_t k_col = 0;
  Tensor kv;             // (N, H (Dn + Dv)): per head its key's nope part, then its value
  Tensor freqs;          // (>= T, Dr) fp32 rope table; token t of every sequence has position t
  AttentionShape s;      // kv_heads == heads, head_dim = Dn + Dr, v_head_dim = Dv
  int64_t rope_dim = 0;  // Dr: even, below head_dim
};

// A run of the flat parameter buffer and whether AdamW applies weight decay to it
// (Megatron: weight matrices decay, norms and biases do not).
struct ParamSegment {
  int64_t offset = 0;
  int64_t count = 0;
  bool decay = true;
};

// The state may be stored in bf16 (Megatron's precision-aware optimizer): the arithmetic is
// fp32 whatever the storage, each bf16 tensor is read into fp32 and its new value rounded back
// to nearest even (a split master's high halves: ties away from zero, core/split_master.h); the
// parameter update uses the fp32 moments before that rounding.
struct AdamWArgs {
  Tensor master;        // (P) fp32 master weights, updated in place; uint16: their low halves,
                        // `params` (bf16) their high halves (split master weights,
                        // core/split_master.h), both updated; undefined: `params` are the
                        // master (bf16 main parameters), updated in place
  Tensor grad;          // (P) fp32 or bf16
  Tensor exp_avg;       // (P) fp32 or bf16 first moment
  Tensor exp_avg_sq;    // (P) fp32 or bf16 second moment
  Tensor params;        // (P) compute-dtype copy refreshed from master; undefined if master is it
  Tensor grad_norm_sq;  // (1) fp32 on the device: squared global gradient norm. A non-finite
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
  Tensor x;      // (R, C) compute dtype
  Tensor out;    // (R, C) e4m3 or e5m2, or undefined
  Tensor out_t;  // (C, R) same dtype as out, or undefined
  Tensor scale;  // (1) fp32; read when out or out_t is defined
  Tensor amax;   // (1) fp32 or undefined: max(amax, max |x|), NaN or Inf when x holds one
};

// Per-tensor scaled FP8 cast of x (R, C) cut into G row groups, with its codes row-major and/or
// transposed, in one pass over x. Its two uses in an MoE layer's FP8 experts are one op
// because they are one cast:
//   activations: rows grouped by expert (offsets, read on the device, so no step waits for the
//     host), one scale and one amax for all (the tensor's), out_t x's transpose (C, R) as
//     GroupedFp8MatmulWgradArgs reads it; rows from o_G on are neither read nor written
//     (padding the grouped GEMMs never read), nor are their columns of out_t;
//   an expert stack (E, out, in) viewed as (E * out, in): E groups of `out` rows (group_rows),
//     each expert with its own scale and amax (consecutive slots), and out_t the stack of the
//     experts' transposes (E, in, out).
// Group g uses scale[g] and amax[g] when those hold G values, else the single one.
//   codes = saturate(round_to_nearest_even(x * scale)), as fp8_cast_transpose's.
struct Fp8GroupedCastArgs {
  Tensor x;                // (R, C) compute dtype
  int64_t group_rows = 0;  // > 0: G = R / group_rows groups, o_g = g * group_rows; 0: offsets
  Tensor offsets;          // (G + 1) int32, o_g = offsets[g]: 0 at g = 0, non-decreasing,
                           // offsets[G] <= R
  Tensor out;              // (R, C) e4m3 or e5m2, or undefined
  Tensor out_t;            // R * C like out (as above), or undefined
  Tensor scale;            // (1) or (G) fp32; read when out or out_t is defined
  Tensor amax;             // (1) or (G) fp32 >= 0, or undefined: max(amax, max |x| over the
                           // group's rows), NaN or Inf when they hold one
};

// out = alpha * (a * a_scale_inv) @ (b * b_scale_inv)^T + beta * c (+ bias), accumulated in
// fp32. Both operands are K-major ("TN", the only FP8 layout Hopper tensor cores take), so
// callers pass transposed copies where the bf16 GEMM would use a trans flag. a and b may
// differ in format, but not both e5m2. M, N and K must be multiples of the backend's
// fp8_gemm_multiple(). Each operand's scale_inv is one fp32 (Fp8Scaling::Tensor), or one per
// 1x128 tile or 128x128 block in the layout core/fp8.h states (fp8_scale_count): block
// scales need Capability::Fp8BlockScaling, not both operands in 128x128 blocks, no fast
// accumulation, and M, N, K multiples of 128.
struct Fp8MatmulArgs {
  Tensor out;          // (M, N) compute dtype or fp32
  Tensor a;            // (M, K) e4m3/e5m2
  Tensor b;            // (N, K) e4m3/e5m2
  Tensor a_scale_inv;  // fp8_scale_count(a_scaling, M, K) fp32
  Tensor b_scale_inv;  // fp8_scale_count(b_scaling, N, K) fp32
  Fp8Scaling a_scaling = Fp8Scaling::Tensor;
  Fp8Scaling b_scaling = Fp8Scaling::Tensor;
  float alpha = 1.0f;
  float beta = 0.0f;
  Tensor c;                 // (M, N) like out, read with beta; undefined means out itself
  Tensor bias;              // (N) like out, optional
  bool fast_accum = false;  // cuBLASLt's faster, less precise accumulation (forward only)
};

// Block-scaled cast (fp8_recipe blockwise): every 1x128 tile or 128x128 block of x gets its
// own scale from its own amax, fp8_block_scale (a power of two), and its codes
// saturate(round_to_nearest_even(x * scale)). For the two K-major operands a GEMM may need:
//   out   (R, C): K = C. Tile1x128: tiles of one row and 128 columns.
//   out_t (C, R): x transposed, K = R. Tile1x128: tiles of 128 rows of one column of x.
// Block128x128: out and out_t share the blocks (the same scales, in each one's layout).
// Scales are written as scale_inv = 1 / scale in the layouts of core/fp8.h.
struct Fp8BlockCastArgs {
  Tensor x;                                    // (R, C) compute dtype
  Fp8Scaling scaling = Fp8Scaling::Tile1x128;  // Tile1x128 or Block128x128
  Tensor out;                                  // (R, C) e4m3/e5m2, or undefined
  Tensor out_scale_inv;                        // fp8_scale_count(scaling, R, C) fp32, with out
  Tensor out_t;                                // (C, R) like out, or undefined
  Tensor out_t_scale_inv;                      // fp8_scale_count(scaling, C, R) fp32, with out_t
  Tensor nonfinite;  // (1) fp32 or undefined: set to NaN when x holds a NaN or Inf
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

// ---- mixture of experts (docs/moe.md) ----

// How a router turns logits into each token's experts and their weights: Megatron's
// topk_softmax_with_capacity without capacity (dropless). With `sigmoid` false:
//   pre_softmax false: the top-k of the logits, weights = softmax over those k logits;
//   pre_softmax true:  p = softmax over all logits, the top-k of p, weights = those p.
// With `sigmoid`: s = sigmoid(logits); the top-k of s + bias (the bias chooses, it does not
// weigh); weights = the chosen s, divided by their sum (+1e-20) when topk > 1.
// Group-limited (num_groups > 0): experts form num_groups equal groups; a token first keeps
// the group_topk groups with the largest sum of their top (topk / group_topk) selection scores,
// then takes its top-k among those groups' experts. Weights are finally multiplied by
// `scaling` (0: not). Ties go to the lower expert index. force_balance ignores the scores for
// choosing: token n's slot k goes to expert (n * topk + k) mod experts (exactly balanced over a
// batch of experts / gcd(experts, topk) tokens); the weights are computed as above for the
// experts so chosen.
struct MoeRouting {
  int64_t experts = 0, topk = 0;
  bool sigmoid = false;
  bool pre_softmax = false;
  int64_t num_groups = 0, group_topk = 0;
  float scaling = 0.0f;
  bool force_balance = false;
};

// Token dropping in moe_permute (Megatron's topk_softmax_with_capacity): each expert keeps at
// most `capacity` of the (token, slot) pairs routed to it (0: all of them, dropless). Over
// capacity it keeps the pairs with the largest weights (ties: the earlier pair; Megatron's
// "probs" policy), or with by_position the earliest pairs ("position").
struct MoeCapacity {
  int64_t capacity = 0;
  bool by_position = false;
  Tensor weights;  // (N, K) fp32 routing weights; read by the "probs" policy
  Tensor dropped;  // (1) fp32 or undefined: overwritten with the number of dropped pairs
};

// The load-balancing losses of Megatron (moe_utils.py), over the router scores P: softmax of
// the logits, or with sigmoid the sigmoid divided by its sum over experts (+1e-20) when
// topk > 1. f_e counts the (token, slot) pairs routed to expert e (indices).
//   aux_loss (Switch):       L = E / (K * N^2) * sum_e f_e * sum_n P_ne
//   seq_aux_loss (DeepSeek): per sequence b of T tokens, L_b = sum_e (f_be * E / (T K)) *
//                            mean_t P_bte; L = mean_b L_b
// f carries no gradient. L itself is 1 for aux_loss at perfect balance.
struct MoeAuxLossArgs {
  Tensor logits;       // (N, E) compute dtype
  Tensor indices;      // (N, K) int32: the experts each token was routed to
  MoeRouting routing;  // experts, topk and the score function (sigmoid)
  int64_t seq = 0;     // > 0: seq_aux_loss over sequences of seq tokens (N a multiple); 0: aux_loss
  Tensor loss;         // (1) fp32 or undefined: += L
  Tensor dlogits;      // (N, E) fp32 or undefined: += grad_scale * dL/dlogits
  float grad_scale = 1.0f;
};

// Per-group GEMMs over contiguous row ranges (the experts of an MoE layer): group g is rows
// [offsets[g], offsets[g+1]) with offsets[0] = 0 and offsets non-decreasing. host_offsets
// holds the same G + 1 values on the host (a backend that launches one GEMM per group reads
// them there instead of waiting for the device), or is empty: the backend then reads the
// device's (Backend::grouped_matmul_reads_device_offsets says whether that costs a wait). Group g
// multiplies weight w(g) of b's W: group_weights[g] (host, G values in [0, W)), or g itself when
// group_weights is empty (then G = W). Several groups may share a weight (an expert's rows from
// several ranks).
//   out[rows_g] (M_g, N) = a[rows_g] (M_g, K) @ op(b[w(g)]),  op(x) = x^T when trans_b
// Rows of out from offsets[G] on are set to zero.
struct GroupedMatmulArgs {
  Tensor out;  // (R, N) compute dtype
  Tensor a;    // (R, K) compute dtype
  Tensor b;    // (W, N, K) when trans_b, else (W, K, N)
  bool trans_b = true;
  Tensor offsets;                          // (G + 1) int32
  std::span<const int32_t> host_offsets;   // G + 1 values, or empty
  std::span<const int32_t> group_weights;  // G values, or empty (w(g) = g)
};

// The weight gradients of grouped_matmul: for every weight w,
//   out[w] (M, N) = beta * out[w] + the sum over the groups g of w of
//                   a[rows_g]^T (M, M_g) @ b[rows_g] (M_g, N)
// (a weight without rows gives beta * out[w]); groups and w(g) as in GroupedMatmulArgs.
struct GroupedMatmulWgradArgs {
  Tensor out;  // (W, M, N) fp32, or bf16 (gradients kept in bf16: the fp32 sums rounded)
  Tensor a;    // (R, M) compute dtype
  Tensor b;    // (R, N) compute dtype
  float beta = 0.0f;
  Tensor offsets;                          // (G + 1) int32
  std::span<const int32_t> host_offsets;   // G + 1 values, or empty (as grouped_matmul)
  std::span<const int32_t> group_weights;  // G values, or empty (w(g) = g)
};

// FP8 grouped GEMMs (the experts of an MoE layer under fp8, docs/fp8.md): grouped_matmul's
// row groups over per-tensor scaled FP8 operands. A separate op rather than FP8 dtypes accepted
// by grouped_matmul because the operands differ in kind, not only in dtype: FP8 tensor cores
// take only K-major ("TN") operands, so there is no trans_b (callers pass transposed weight
// copies for the data gradient, as for matmul_fp8), every operand carries scales, and every
// group's row count must be a multiple of fp8_gemm_multiple() (moe_permute pads the groups so).
//   out[rows_g] (M_g, N) = (a[rows_g] * a_scale_inv) @ (b[w(g)] * b_scale_inv[w(g)])^T
// accumulated in fp32; groups and w(g) as in GroupedMatmulArgs; groups without rows are
// skipped and rows of out from offsets[G] on are set to zero. a and b may differ in format,
// but not both e5m2; N and K must be multiples of fp8_gemm_multiple(). host_offsets as
// GroupedMatmulArgs' (optional).
struct GroupedFp8MatmulArgs {
  Tensor out;                              // (R, N) compute dtype or fp32
  Tensor a;                                // (R, K) e4m3/e5m2
  Tensor b;                                // (W, N, K) e4m3/e5m2, each weight K-major
  Tensor a_scale_inv;                      // (1) fp32
  Tensor b_scale_inv;                      // (W) fp32, one per weight (expert)
  Tensor offsets;                          // (G + 1) int32
  std::span<const int32_t> host_offsets;   // G + 1 values, or empty
  std::span<const int32_t> group_weights;  // G values, or empty (w(g) = g)
  bool fast_accum = false;                 // cuBLASLt's faster, less precise accumulation
};

// Its weight gradients. The K of these GEMMs is the rows, so both operands come transposed
// (K-major): a_t (M, R) and b_t (N, R), group g's columns [offsets[g], offsets[g+1]). For every
// weight w:
//   out[w] (M, N) = beta * out[w] + the sum over the groups g of w of
//                   (a_t[:, rows_g] * a_scale_inv) @ (b_t[:, rows_g] * b_scale_inv)^T
// (a weight without rows gives beta * out[w]); fp32 accumulation, bf16 out rounded once. R must
// be a multiple of fp8_gemm_multiple() (the rows' stride), as the groups' rows are.
struct GroupedFp8MatmulWgradArgs {
  Tensor out;          // (W, M, N) fp32 or compute dtype
  Tensor a_t;          // (M, R) e4m3/e5m2
  Tensor b_t;          // (N, R) e4m3/e5m2
  Tensor a_scale_inv;  // (1) fp32
  Tensor b_scale_inv;  // (1) fp32
  float beta = 0.0f;
  Tensor offsets;                          // (G + 1) int32
  std::span<const int32_t> host_offsets;   // G + 1 values, or empty
  std::span<const int32_t> group_weights;  // G values, or empty (w(g) = g)
  bool fast_accum = false;
};

// Ops recorded once by Backend::capture, queued again by each replay on the same tensors, whose
// contents may change between replays (their places and shapes may not). Belongs to the
// backend that made it, which it must not outlive.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Queues the recorded ops again; false, queuing nothing, once the backend has moved memory
  // the ops use (its kernel scratch grew since): capture the work again.
  virtual bool replay() = 0;
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
  // Every dimension of this backend's FP8 GEMMs (M, N, K of matmul_fp8 and the grouped FP8
  // GEMMs, whose row groups too) is a multiple of this: a rule of its GEMM library, which the
  // FP8 linear layers and the trainer check a model against.
  virtual int64_t fp8_gemm_multiple() const = 0;
  // GEMMs whose row count changes from call to call (the output head on a batch's loss rows)
  // round it up to a multiple of this. A backend that tunes each new GEMM shape (cuBLASLt's
  // timed candidates, seconds each) then meets a few shapes again and again; 1 where any row
  // count costs only what it computes.
  virtual int64_t varying_gemm_rows_multiple() const { return 1; }
  // Whether grouped_matmul and grouped_matmul_wgrad in `dtype` (e4m3: their FP8 forms, at the
  // formats of Fp8Format hybrid or e4m3) over `groups` row groups of `rows` rows in all (one
  // weight a group) run best from the device's offsets alone: callers then pass no
  // host_offsets and never wait for the device to learn them. True where ops read host
  // memory; on GPUs where the backend's grouped kernel beats its library's GEMMs run once per
  // group. Given no host_offsets, ops run either way (copying them where they must).
  virtual bool grouped_matmul_reads_device_offsets(DType dtype, int64_t rows,
                                                   int64_t groups) const {
    (void)dtype, (void)rows, (void)groups;
    return !supports(Capability::AsyncQueue);
  }
  // The compute dtype of a run with `precision` auto: bf16 where supported, else fp32.
  DType default_compute_dtype() const {
    return supports(Capability::Bf16Compute) ? DType::BF16 : DType::F32;
  }

  // ---- memory ----
  // Throws OutOfMemoryError naming `what` and the requested and free bytes.
  virtual void* allocate(size_t bytes, const char* what) = 0;
  virtual void release(void* ptr) = 0;
  // Host memory that upload() and download() move at the link's full rate (page-locked on a
  // GPU; ordinary memory here): for device state parked on the host. An upload from it may
  // still be reading it after the call returns: write it again only after work queued later
  // (a download) has finished. Throws OutOfMemoryError.
  virtual void* allocate_host(size_t bytes, const char* what);
  virtual void release_host(void* ptr);
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

  // Records the ops `work` queues into a graph, without running them (CUDA graphs: a decode
  // step's hundreds of small kernels then cost one launch). Host code in `work` runs once, at
  // capture: it must not read device results or depend on values that change between replays.
  // Null where the backend does not capture (Capability::CapturesWork) or while ops are
  // observed or timed (replayed ops would pass unseen): run the work itself then.
  std::unique_ptr<CapturedWork> capture(const std::function<void()>& work);

  // Whether this backend runs `op` (a backend for other hardware may leave some out; the
  // facade refuses those by name).
  virtual bool supports_op(OpId op) const {
    (void)op;
    return true;
  }
  // The dtypes of activations and weights it computes in (fp32, and bf16 with Bf16Compute):
  // what the op table's TS_COMPUTE admits.
  std::span<const DType> compute_dtypes() const;

  // ---- the ops: one per line of ops/op_table.inc, which documents each ----
#define TS_OP(name, params, args, signature) void name params;
#include "tessera/ops/op_table.inc"

 protected:
  // The *_cast ops' codes and amax where a backend does not fold them into the producer: its
  // own cast (do_fp8_cast_transpose) of what the producer wrote, after it.
  void cast_output(const Tensor& out, const Fp8CastArgs& codes) {
    Fp8CastArgs cast = codes;
    cast.x = out;
    do_fp8_cast_transpose(cast);
  }
  // Host backends' *_cast ops, composed: the producer into out (or, where out is undefined, a
  // host temporary: these ops may leave out unwritten), then its cast. rmsnorm_transposed_codes
  // runs the forward again, its statistics recomputed to the bits the forward wrote.
  void host_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up, const Fp8CastArgs& codes);
  void host_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                 const Tensor& weight, float eps, const Fp8CastArgs& codes);
  void host_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x,
                                     const Tensor& weight, float eps);
  // A grouped GEMM's offsets on the host: `host` where the caller gave them, else a copy of
  // the device's into `storage` (a download: waits for the queue).
  std::span<const int32_t> host_group_offsets(const Tensor& offsets, std::span<const int32_t> host,
                                              std::vector<int32_t>& storage);

  // What each backend implements. The facade has checked that every tensor argument is
  // defined (or empty) and lives on this backend's device, that shapes and counts agree as the
  // op's comment states and that dtypes follow its signature; a do_<op> checks anything only
  // it knows.
  virtual void do_upload(const Tensor& dst, const void* host_src) = 0;
  virtual void do_download(void* host_dst, const Tensor& src) = 0;
  virtual void do_copy(const Tensor& dst, const Tensor& src) = 0;
  virtual std::unique_ptr<CapturedWork> do_capture(const std::function<void()>& /*work*/) { return nullptr; }
  virtual void do_range_push(const char* /*name*/) {}
  virtual void do_range_pop() {}
#define TS_OP(name, params, args, signature) virtual void do_##name params = 0;
#include "tessera/ops/op_table.inc"

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
