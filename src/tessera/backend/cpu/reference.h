#pragma once
// Reference implementations of every op of ops/backend.h (llm.c train_gpt2.c style): plain
// loops over raw pointers, shapes in the comments, N = tokens (B*T).
//
// Templates on the scalar type T, instantiated for float and double. The double instances
// are the ground truth of the finite-difference gradient checks; the float instances do the
// arithmetic of the CPU backend, which calls them on rows (or heads, or chunks) from its
// OpenMP loops. Sums over a row, a column or a softmax accumulate in double in both.
//
// Output semantics are the op API's: gradients documented there as "accumulates" add into
// their existing contents; every other output is overwritten.
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tessera/ops/backend.h"

namespace tessera::ref {

// ---- linear algebra ----

// out (M, N) = alpha * op(a) @ op(b) + beta * c + bias (broadcast over rows).
// a: (M, K), or (K, M) when trans_a. b: (K, N), or (N, K) when trans_b. c (M, N) may be null,
// which means out itself; beta == 0 does not read c at all (as BLAS: NaN there does not
// propagate). bias (N) may be null. out must not alias a or b.
template <class T>
void matmul_forward(T* out, const T* a, const T* b, const T* c, const T* bias, int64_t M, int64_t N,
                    int64_t K, bool trans_a, bool trans_b, T alpha, T beta);

// Gradients of matmul_forward for dout (M, N); each one that is non-null accumulates:
// da (shape of a), db (shape of b), dbias (N), dc (M, N) += beta * dout.
// Written as the matmul_forward calls a model makes through the op API, so the trans flags of
// each case are spelled out (and checked by finite differences) once.
template <class T>
void matmul_backward(T* da, T* db, T* dbias, T* dc, const T* dout, const T* a, const T* b,
                     int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, T alpha, T beta);

// dbias (N) accumulates the column sums of dout (M, N).
template <class T>
void bias_backward(T* dbias, const T* dout, int64_t M, int64_t N);

// ---- embedding ----

// out (N, C) = table[tokens]; tokens (N) in [0, V); table (V, C).
template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t C);

// dtable (V, C) accumulates the rows of dout (N, C) at tokens (N), in token order.
template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N, int64_t C);

// A vocabulary shard's table (V, C) holds the rows of token ids [first_id, first_id + V).
// out (N, C) = table[tokens - first_id], a zero row for a token outside the shard.
template <class T>
void embedding_shard_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t C,
                             int64_t V, int64_t first_id);

// dtable (V, C) accumulates the rows of dout (N, C) whose tokens lie in the shard, in token
// order.
template <class T>
void embedding_shard_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N, int64_t C,
                              int64_t V, int64_t first_id);

// ---- RMSNorm ----

// x (N, C), weight (C). rstd (N) = 1 / sqrt(mean(x^2) + eps); out (N, C) = x * rstd * weight.
template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* weight, int64_t N, int64_t C, T eps);

// dout, x (N, C); weight (C); rstd (N) from rmsnorm_forward. dx (N, C) accumulates; dweight
// (C) accumulates unless null (the CPU backend reduces it separately, split by columns).
template <class T>
void rmsnorm_backward(T* dx, T* dweight, const T* dout, const T* x, const T* weight, const T* rstd,
                      int64_t N, int64_t C);

// ---- rotary embedding ----

// In place on the s.heads query and s.kv_heads key heads of qkv (B, T, s.qkv_width()); values
// are untouched. freqs (T, D): row t = cos(t * inv_freq[0..D/2)) then sin(t * inv_freq[...]).
// Rotate-half pairs element i with i + D/2:
//   x'[i] = x[i] cos - x[i + D/2] sin,   x'[i + D/2] = x[i + D/2] cos + x[i] sin.
template <class T>
void rope_forward(T* qkv, const T* freqs, const AttentionShape& s);

// The transposed (= inverse) rotation, in place on the query/key heads of dqkv (B, T, width).
template <class T>
void rope_backward(T* dqkv, const T* freqs, const AttentionShape& s);

// ---- attention ----

// Keys visible from query i of sequence b form the contiguous range [first, last] (empty if
// first > last): j <= i when causal, i - window < j when window > 0, and j at or after the
// first token of i's document with s.document_starts.
struct KeyRange {
  int64_t first, last;
};
KeyRange visible_keys(const AttentionShape& s, int64_t i, int64_t b = 0);

// qkv (B, T, (H + KV) * D + KV * Dv) packs per token H query heads, then KV key heads, then KV
// value heads (Dv = s.v_dim()); query head h reads key/value head h / (H / KV).
// out (B, T, H*Dv) = softmax(scale * q k^T + mask) v per head; lse (B, H, T) = log-sum-exp of
// each query row's visible scaled scores (-inf, with a zero output row, if it sees none).
template <class T>
void attention_forward(T* out, T* lse, const T* qkv, const AttentionShape& s);

// attention_forward with s.fp8 (fp8_dot_product_attention), the numerics ops/op_table.inc's
// attention_forward states: both products over e4m3 codes of 128-token tiles of each head,
// the probabilities coded per 128-key tile against the running row max. Heads of one width
// (Dv = D).
template <class T>
void attention_fp8_forward(T* out, T* lse, const T* qkv, const AttentionShape& s);

// dqkv (B, T, width) is overwritten with the gradients of q, k and v for dout (B, T, H*Dv).
// Probabilities are recomputed from lse; sum_j p_ij dp_ij is taken as dout_i . out_i.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* out, const T* lse, const T* qkv,
                        const AttentionShape& s);

// attention_forward for the one (batch b, query head h) pair. scratch: s.seq + s.v_dim().
template <class T>
void attention_head_forward(T* out, T* lse, const T* qkv, const AttentionShape& s, int64_t b,
                            int64_t h, double* scratch);

// attention_backward for the one (batch b, query head h) pair: its dq rows in dqkv are
// overwritten; the gradients of its key and value head accumulate into dk and dv, whose rows
// t = 0..T-1 are dkv_stride elements apart (in dqkv itself: stride = width). scratch: head_dim.
template <class T>
void attention_head_backward(T* dqkv, T* dk, T* dv, int64_t dkv_stride, const T* dout, const T* out,
                             const T* lse, const T* qkv, const AttentionShape& s, int64_t b,
                             int64_t h, double* scratch);

// Context parallelism: the queries of segment `segment` attend to the keys and values of
// every segment. qkv (B, T, width): the segment's packed q, k, v (s.seq = T); kv_all
// (S, B, T, s.kv_width()): segment s's key heads then value heads per token; positions (S, T):
// each token's position in the whole sequence, the same in every sequence of the batch. A key
// is visible from a query at a position no later (causal) and within the window. out
// (B, T, H*D), lse (B, H, T): the segment's queries.
template <class T>
void attention_gathered_forward(T* out, T* lse, const T* qkv, const T* kv_all,
                                const int32_t* positions, int64_t segments, int64_t segment,
                                const AttentionShape& s);

// dqkv's query columns get the segment's query gradients (its other columns are not written);
// dkv_all (S, B, T, s.kv_width()) is overwritten with the key and value gradients that its
// queries give every segment's tokens. The sum over the segments' calls is the whole gradient.
template <class T>
void attention_gathered_backward(T* dqkv, T* dkv_all, const T* dout, const T* out, const T* lse,
                                 const T* qkv, const T* kv_all, const int32_t* positions,
                                 int64_t segments, int64_t segment, const AttentionShape& s);

// The two above for the one (batch b, query head h) pair; the backward accumulates into the
// key and value rows of dkv_all (not zeroed) and overwrites the pair's query columns of dqkv.
template <class T>
void attention_gathered_head_forward(T* out, T* lse, const T* qkv, const T* kv_all,
                                     const int32_t* positions, int64_t segments, int64_t segment,
                                     const AttentionShape& s, int64_t b, int64_t h);
template <class T>
void attention_gathered_head_backward(T* dqkv, T* dkv_all, const T* dout, const T* out,
                                      const T* lse, const T* qkv, const T* kv_all,
                                      const int32_t* positions, int64_t segments, int64_t segment,
                                      const AttentionShape& s, int64_t b, int64_t h);

// Generation's attention for one new token per sequence, at position `pos` (or sequence b's at
// positions[b] when positions is not null): q (B, H*D) attends to the keys and values of the
// positions visible from its own (visible_keys) in the cache kv (B, S, KV*(D + Dv)), which
// holds per position the KV key heads, then the KV value heads. out (B, H*Dv). s.seq is the
// cache's capacity S.
template <class T>
void attention_decode(T* out, const T* q, const T* kv, const int32_t* positions, int64_t pos,
                      const AttentionShape& s);

// ---- multi-latent attention ----

// qkv (N, s.qkv_width()) rows [first_token, first_token + tokens) from the query heads
// q (rows q_stride apart, H x (Dn | Dr) from its first element), the rope key k_rope (rows
// k_stride apart, Dr), kv (N, H (Dn + Dv)) and freqs (T, Dr), as ops/backend.h's MlaQkvArgs
// states; token n has position n % s.seq.
template <class T>
void mla_qkv_forward(T* qkv, const T* q, int64_t q_stride, const T* k_rope, int64_t k_stride,
                     const T* kv, const T* freqs, const AttentionShape& s, int64_t rope_dim,
                     int64_t first_token, int64_t tokens);

// Its gradient for those rows: dq's H x D and dk_rope's Dr columns per row overwritten (the
// rope key's is the heads' sum, taken in head order), dkv (N, H (Dn + Dv)) overwritten.
template <class T>
void mla_qkv_backward(T* dq, int64_t q_stride, T* dk_rope, int64_t k_stride, T* dkv, const T* dqkv,
                      const T* freqs, const AttentionShape& s, int64_t rope_dim,
                      int64_t first_token, int64_t tokens);

// ---- SwiGLU ----

// gate_up (N, 2F) holds [gate | up]; out (N, F) = silu(gate) * up, silu(g) = g * sigmoid(g).
template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int64_t F);

// dgate_up (N, 2F) is overwritten; dout (N, F).
template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, int64_t N, int64_t F);

// ---- elementwise ----

// out[i] = a[i] + b[i]; out[i] = alpha x[i]; out[i] = cap tanh(x[i] / cap);
// dx[i] = dy[i] (1 - (y[i] / cap)^2). out may be an input.
template <class T>
void add(T* out, const T* a, const T* b, int64_t n);
template <class T>
void scale(T* out, const T* x, T alpha, int64_t n);
template <class T>
void softcap(T* out, const T* x, T cap, int64_t n);
template <class T>
void softcap_backward(T* dx, const T* dy, const T* y, T cap, int64_t n);

// ---- loss ----

// Forward and backward fused, as in the op API. logits (N, V); targets (N), negative =
// ignored; losses (N) = logsumexp(logits[n]) - logits[n, targets[n]] (0 if ignored).
// If dlogits (N, V) is non-null (it may be logits itself) it is overwritten with
// grad_scale * (softmax(logits[n]) - onehot(targets[n])), a zero row if ignored.
template <class T>
void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                   int64_t V, T grad_scale);

// Per-token log-probabilities, as the op API's log_softmax_gather: logps (N) = logits[n, t] -
// lse[n], lse (N) = logsumexp(logits[n]); both 0 where targets[n] < 0.
template <class T>
void log_softmax_gather(T* logps, T* lse, const T* logits, const int32_t* targets, int64_t N,
                        int64_t V);
// dlogits (N, V), which may be logits, = dlogps[n] * (onehot(targets[n]) - exp(logits[n] -
// lse[n])), a zero row where targets[n] < 0.
template <class T>
void log_softmax_gather_backward(T* dlogits, const T* dlogps, const T* logits, const T* lse,
                                 const int32_t* targets, int64_t N, int64_t V);

// Generation's draw of each row's next token, as the op API's sample_tokens: logits (B, V),
// streams and steps (B); tokens, logps and entropy (B).
template <class T>
void sample_tokens(int32_t* tokens, T* logps, T* entropy, const T* logits, const int32_t* streams,
                   const int32_t* steps, int64_t B, int64_t V, int64_t vocab, T temperature, T min_p,
                   uint64_t seed);

// ---- QK norm (Qwen3) ----

// Every query and key head x (D) of qkv (N, width), N = s.tokens(), RMS-normalised with
// q_weight or k_weight (D); value heads copied. rstd (N, H + KV), query heads first.
template <class T>
void qk_norm_forward(T* out, T* rstd, const T* qkv, const T* q_weight, const T* k_weight,
                     const AttentionShape& s, T eps);

// dqkv (N, width) overwritten (it may be dout); dq_weight, dk_weight (D) accumulate.
template <class T>
void qk_norm_backward(T* dqkv, T* dq_weight, T* dk_weight, const T* dout, const T* qkv,
                      const T* q_weight, const T* k_weight, const T* rstd, const AttentionShape& s);

// ---- mixture of experts (ops/backend.h: MoeRouting, MoeAuxLossArgs) ----

// logits (N, E); bias (E) or null. indices and weights (N, K) overwritten. Token i here is
// token first_token + i of the batch (force_balance's round-robin counts from the batch's
// first token).
template <class T>
void moe_router_forward(int32_t* indices, T* weights, const T* logits, const T* bias, int64_t N,
                        const MoeRouting& r, int64_t first_token = 0);

// dlogits (N, E) overwritten from dweights (N, K).
template <class T>
void moe_router_backward(T* dlogits, const T* dweights, const T* logits, const int32_t* indices,
                         int64_t N, const MoeRouting& r);

// loss (1) += L and dlogits (N, E) += grad_scale * dL/dlogits, each unless null; seq 0 is
// aux_loss, seq > 0 seq_aux_loss over sequences of seq tokens.
template <class T>
void moe_aux_loss(T* loss, T* dlogits, const T* logits, const int32_t* indices, int64_t N,
                  const MoeRouting& r, int64_t seq, T grad_scale);

// loss (1) += mean_n logsumexp(logits_n)^2, dlogits (N, E) += grad_scale * its gradient, each
// unless null.
template <class T>
void moe_z_loss(T* loss, T* dlogits, const T* logits, int64_t N, int64_t E, T grad_scale);

// counts (E) += the (token, slot) pairs of indices (n: N * K entries) routed to each expert.
template <class T>
void moe_expert_counts(T* counts, const int32_t* indices, int64_t n, int64_t E);

// bias (E) += rate * sign(mean(counts) - counts[e]).
template <class T>
void moe_expert_bias_update(T* bias, const T* counts, int64_t E, T rate);

// Token dropping (MoeCapacity): whether each (token, slot) pair of indices (N, K) stays with
// its expert, which keeps at most `capacity` pairs (0: all): the largest weights (N, K), ties
// to the earlier pair, or with by_position the earliest pairs.
std::vector<char> moe_capacity_keep(const int32_t* indices, const double* weights, int64_t N,
                                    int64_t K, int64_t E, int64_t capacity, bool by_position);

// The dispatch of moe_permute: rows (N, K) and offsets (E + 1) from indices (N, K); the pairs
// keep marks false (keep may be null: all stay) get row -1.
void moe_dispatch_plan(int32_t* rows, int32_t* offsets, const int32_t* indices, int64_t N,
                       int64_t K, int64_t E, int64_t align, const char* keep = nullptr);

// xp (R, C) overwritten: x (N, C) rows at rows (N, K), zero elsewhere. Here and below a row
// of -1 is a dropped pair: nothing moves for it.
template <class T>
void moe_permute(T* xp, int64_t R, const T* x, const int32_t* rows, int64_t N, int64_t K,
                 int64_t C);

// dx (N, C) accumulates the rows of dxp its copies went to.
template <class T>
void moe_permute_backward(T* dx, const T* dxp, const int32_t* rows, int64_t N, int64_t K,
                          int64_t C);

// out (N, C) accumulates sum_k weights[n, k] * yp[rows[n, k]].
template <class T>
void moe_unpermute(T* out, const T* yp, const int32_t* rows, const T* weights, int64_t N, int64_t K,
                   int64_t C);

// dyp (R, C) and dweights (N, K) overwritten.
template <class T>
void moe_unpermute_backward(T* dyp, int64_t R, T* dweights, const T* dout, const T* yp,
                            const int32_t* rows, const T* weights, int64_t N, int64_t K, int64_t C);

// out (R, N) = per group a[rows_g] (M_g, K) @ op(b[w(g)]); rows from offsets[G] on zeroed.
// b (W, N, K) when trans_b, else (W, K, N); w(g) = weights[g], or g when weights is null.
template <class T>
void grouped_matmul(T* out, const T* a, const T* b, const int32_t* offsets, int64_t G, int64_t R,
                    int64_t N, int64_t K, bool trans_b, const int32_t* weights = nullptr);

// out[w] (M, N) = beta * out[w] + the sum over the groups g of w of a[rows_g]^T @ b[rows_g],
// for each of the W weights (W < 0: W = G); a (R, M), b (R, N).
template <class T>
void grouped_matmul_wgrad(T* out, const T* a, const T* b, const int32_t* offsets, int64_t G,
                          int64_t M, int64_t N, T beta, int64_t W = -1,
                          const int32_t* weights = nullptr);

// Cross-entropy over logits split by vocabulary (Megatron's vocab_parallel_cross_entropy).
// logits (N, V) are the columns [first_id, first_id + V) of the whole row.
// stats (N, 2) = {logsumexp(logits[n]), logits[n, targets[n] - first_id] when the target lies
// in the shard, else 0}.
template <class T>
void cross_entropy_shard_stats(T* stats, const T* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t first_id);

// all_stats (S, N, 2): every shard's stats, in shard order. losses (N) = the logsumexp of the
// shards' logsumexps - the sum of their target logits (0 if ignored). If dlogits (N, V) is
// non-null (it may be logits itself) it is overwritten with grad_scale * (softmax - onehot) on
// this shard's columns, a zero row if ignored.
template <class T>
void cross_entropy_shard(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                         const T* all_stats, int64_t S, int64_t N, int64_t V, int64_t first_id,
                         T grad_scale);

// ---- reductions ----

// out (1) = sum(x) (or out += sum(x) when accumulate); x (n).
template <class T>
void sum(T* out, const T* x, int64_t n, bool accumulate);

// out (1) = sum(x^2) (or out += sum(x^2) when accumulate); x (n).
template <class T>
void sum_squares(T* out, const T* x, int64_t n, bool accumulate);

// ---- optimizer and init ----

// The scalar settings of one AdamW step: the fields of AdamWArgs that are not tensors.
struct AdamWSettings {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float max_grad_norm = 0;
  int64_t step = 1;
  static AdamWSettings from(const AdamWArgs& a);
};

// The per-step constants of the element math in T, derived in double from the float
// settings (the CUDA backend derives its fp32 constants with this too).
template <class T>
struct AdamWScalarsOf {
  T beta1, beta2, one_minus_beta1, one_minus_beta2;
  T step_size;              // lr / (1 - beta1^step)
  T sqrt_bias_correction2;  // sqrt(1 - beta2^step)
  T eps;
  T decay_factor;  // 1 - lr * weight_decay where decay applies, else 1
  T grad_scale;    // the clipping factor (adamw_grad_scale)
};

template <class T>
AdamWScalarsOf<T> adamw_scalars(const AdamWSettings& s, bool decay, double grad_scale) {
  const double beta1 = s.beta1, beta2 = s.beta2, lr = s.lr, step = static_cast<double>(s.step);
  return {static_cast<T>(beta1),
          static_cast<T>(beta2),
          static_cast<T>(1.0 - beta1),
          static_cast<T>(1.0 - beta2),
          static_cast<T>(lr / (1.0 - std::pow(beta1, step))),
          static_cast<T>(std::sqrt(1.0 - std::pow(beta2, step))),
          static_cast<T>(static_cast<double>(s.eps)),
          static_cast<T>(decay ? 1.0 - lr * s.weight_decay : 1.0),
          static_cast<T>(grad_scale)};
}

// The factor every gradient is multiplied by: max_grad_norm / (norm + 1e-6) when clipping is
// on and that is below 1, otherwise 1. nullopt when grad_norm_sq is not finite: skip the step.
std::optional<double> adamw_grad_scale(double grad_norm_sq, double max_grad_norm);

// AdamW (torch.optim.AdamW semantics) on n consecutive elements; params (compute-dtype copy
// of master) may be null. decay: whether weight decay applies to these elements.
template <class T>
void adamw_update(T* master, T* params, T* exp_avg, T* exp_avg_sq, const T* grad, int64_t n,
                  const AdamWSettings& s, bool decay, double grad_scale);

// One full step over the segments (offsets relative to master[0]): skip on a non-finite
// grad_norm_sq, clip, update. Elements outside every segment are untouched.
template <class T>
void adamw_step(T* master, T* params, T* exp_avg, T* exp_avg_sq, const T* grad, double grad_norm_sq,
                std::span<const ParamSegment> segments, const AdamWSettings& s);

// dst (n)[i] = mean + std * random_normal(seed, first_index + i), as one fused multiply-add
// so that every backend can reproduce the float values bit for bit.
template <class T>
void init_normal(T* dst, int64_t n, uint64_t seed, uint64_t first_index, T mean, T std);

}  // namespace tessera::ref
