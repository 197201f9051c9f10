#include "tessera/model/parallel_layers.h"

#include <utility>

#include "tessera/core/error.h"

namespace tessera {

// ---- LinearGemms

LinearGemms::LinearGemms(Backend& backend, TensorOf params, TensorOf grads, size_t param_count)
    : backend_(backend),
      params_(std::move(params)),
      grads_(std::move(grads)),
      fp8_index_(param_count, -1),
      grad_written_(param_count, 0) {}

void LinearGemms::use_fp8(Fp8Linears* fp8, std::vector<int> fp8_index) {
  TS_CHECK(fp8_index.size() == fp8_index_.size(), "FP8 indices for {} parameters, not {}",
           fp8_index.size(), fp8_index_.size());
  fp8_ = fp8;
  fp8_index_ = std::move(fp8_index);
}

void LinearGemms::start_step(bool accumulate_all) {
  std::fill(grad_written_.begin(), grad_written_.end(), accumulate_all ? 1 : 0);
}

Tensor LinearGemms::fp8_weight(int weight) const {
  return fp8_->weight_cached(fp8_index_[weight]) ? Tensor{} : params_(weight);
}

float LinearGemms::take_grad_beta(int weight) {
  const float beta = grad_written_[weight] ? 1.0f : 0.0f;
  grad_written_[weight] = 1;
  return beta;
}

void LinearGemms::backward_without_rows(int weight) {
  const bool frozen = adapted(weight);
  if (take_grad_beta(weight) == 0.0f && !frozen) backend_.fill(grads_(weight), 0.0f);
}

void LinearGemms::forward(const Tensor& out, const LinearOperand& in, int weight, int bias,
                          float beta, const Tensor& c) const {
  if (is_fp8(weight)) {
    fp8_->forward(fp8_index_[weight], out, in, fp8_weight(weight),
                  bias >= 0 ? params_(bias) : Tensor{}, beta, c);
  } else {
    TS_CHECK(!in.cast, "a bf16 linear given an input cast to FP8");
    MatmulArgs m;
    m.out = out;
    m.a = in.x;
    m.b = params_(weight);
    m.trans_b = true;
    m.beta = beta;
    m.c = c;
    if (bias >= 0) m.bias = params_(bias);
    backend_.matmul(m);
  }
  if (adapted(weight)) adapters_->forward(out, in.x, weight);
}

void LinearGemms::backward(const Tensor& din, const LinearOperand& dout_operand,
                           const LinearOperand& in_operand, int weight, int bias) {
  const float grad_beta = take_grad_beta(weight);
  const bool frozen = adapted(weight);  // its adapters train in its place
  const Tensor& dout = dout_operand.x;
  const Tensor& in = in_operand.x;
  TS_CHECK(!dout_operand.cast || (is_fp8(weight) && !frozen && bias < 0),
           "an output gradient given as codes to a linear that reads it in bf16");
  TS_CHECK(!in_operand.codes_t.defined() || (is_fp8(weight) && !frozen),
           "an input given as transposed codes to a linear that reads it in bf16");
  if (is_fp8(weight)) {
    // An adapted weight is frozen: no weight-gradient GEMM (an undefined gradient).
    fp8_->backward(fp8_index_[weight], din, dout_operand, in_operand, fp8_weight(weight),
                   frozen ? Tensor{} : grads_(weight), grad_beta);
    if (frozen) adapters_->backward(din, dout, in, weight);
  } else {
    if (din.defined()) {
      MatmulArgs d;
      d.out = din;
      d.a = dout;
      d.b = params_(weight);
      backend_.matmul(d);
    }
    if (frozen) {
      adapters_->backward(din, dout, in, weight);  // the weight itself is frozen
    } else {
      MatmulArgs w;
      w.out = grads_(weight);
      w.a = dout;
      w.trans_a = true;
      w.b = in;
      w.beta = grad_beta;
      backend_.matmul(w);
    }
  }
  if (bias >= 0) backend_.bias_backward(grads_(bias), dout);
}

void LinearGemms::expert_forward(const Tensor& out, const Tensor& in, int weight, const Tensor& w,
                                 const ExpertGroups& groups) const {
  if (is_fp8(weight)) return fp8_->expert_forward(fp8_index_[weight], out, in, w, groups);
  GroupedMatmulArgs g;
  g.out = out, g.a = in, g.b = w, g.trans_b = true;
  g.offsets = groups.offsets, g.host_offsets = groups.host_offsets;
  g.group_weights = groups.group_weights;
  backend_.grouped_matmul(g);
}

void LinearGemms::expert_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
                                  int weight, const Tensor& w, const Tensor& dw,
                                  const ExpertGroups& groups) {
  const float grad_beta = take_grad_beta(weight);
  if (is_fp8(weight))
    return fp8_->expert_backward(fp8_index_[weight], din, dout, in, w, dw, groups, grad_beta);
  GroupedMatmulArgs d;
  d.out = din, d.a = dout, d.b = w, d.trans_b = false;
  d.offsets = groups.offsets, d.host_offsets = groups.host_offsets;
  d.group_weights = groups.group_weights;
  if (din.defined()) backend_.grouped_matmul(d);
  GroupedMatmulWgradArgs g;
  g.out = dw, g.a = dout, g.b = in, g.beta = grad_beta;
  g.offsets = groups.offsets, g.host_offsets = groups.host_offsets;
  g.group_weights = groups.group_weights;
  backend_.grouped_matmul_wgrad(g);
}

// ---- TensorParallelGroup

ParallelGroup& TensorParallelGroup::get() const {
  TS_CHECK(group != nullptr, "tensor parallelism over {} ranks without a group", size);
  return *group;
}

const Tensor& TensorParallelGroup::gather_sequence(const Tensor& x) {
  get().all_gather(gathered, x);
  return gathered;
}

void TensorParallelGroup::reduce_to_sequence(const Tensor& out, const Tensor& in) {
  if (size == 1) return;
  if (sequence_parallel)
    get().reduce_scatter(out, in);
  else
    get().all_reduce(in);
}

// ---- ColumnParallelLinear

void ColumnParallelLinear::forward(const Tensor& out, const LinearOperand& in, int weight,
                                   int bias) {
  if (!tp_.sequence_parallel) return gemms_.forward(out, in, weight, bias, 0.0f, {});
  TS_CHECK(!in.cast, "a column-parallel linear given its sequence shard's codes");
  gemms_.forward(out, tp_.gather_sequence(in.x), weight, bias, 0.0f, {});
}

// The weight gradient needs the whole input, gathered again rather than kept; with sequence
// parallelism d(input)'s partial sums for every token go to each rank's shard.
void ColumnParallelLinear::backward(const Tensor& din, const LinearOperand& dout,
                                    const LinearOperand& in, int weight, int bias) {
  const bool sp = tp_.sequence_parallel;
  TS_CHECK(!sp || !in.codes_t.defined(),
           "a column-parallel linear given its sequence shard's transposed codes");
  const LinearOperand x = sp ? LinearOperand(tp_.gather_sequence(in.x)) : in;
  const Tensor dx = din.defined() && sp ? tp_.partial.view({dout.x.dim(0), din.dim(1)}) : din;
  gemms_.backward(dx, dout, x, weight, bias);
  if (din.defined()) tp_.reduce_to_sequence(din, dx);
}

// ---- RowParallelLinear

void RowParallelLinear::forward(const Tensor& out, const LinearOperand& in, int weight,
                                const Tensor& residual) {
  if (!tp_.sequence_parallel) {
    // The residual rides on the GEMM's beta (one pass less over the states), on one rank only.
    const bool add_residual = residual.defined() && tp_.rank == 0;
    gemms_.forward(out, in, weight, -1, add_residual ? 1.0f : 0.0f,
                   add_residual ? residual : Tensor{});
    tp_.reduce_to_sequence(out, out);
    return;
  }
  const Tensor partial = tp_.partial.view({in.x.dim(0), out.dim(1)});
  float beta = 0.0f;
  if (residual.defined()) {
    // Zeros but for the residual in this rank's shard of the rows.
    Backend& b = gemms_.backend();
    const int64_t n = out.dim(0), own = tp_.rank * n;
    b.fill(partial.rows(0, own), 0.0f);
    b.copy(partial.rows(own, own + n), residual);
    b.fill(partial.rows(own + n, partial.dim(0)), 0.0f);
    beta = 1.0f;
  }
  gemms_.forward(partial, in, weight, -1, beta, partial);
  tp_.reduce_to_sequence(out, partial);
}

void RowParallelLinear::backward(const Tensor& din, const LinearOperand& dout,
                                 const LinearOperand& in, int weight) {
  if (!tp_.sequence_parallel) return gemms_.backward(din, dout, in, weight, -1);
  TS_CHECK(!dout.cast, "a row-parallel linear given its output gradient's shard's codes");
  gemms_.backward(din, tp_.gather_sequence(dout.x), in, weight, -1);
}

// ---- VocabParallelEmbedding

void VocabParallelEmbedding::forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  if (tp_.size == 1) return backend_.embedding_forward(out, tokens, table);
  // Each rank looks up the tokens of its rows (zeros for the others'); the sum over the ranks
  // is the embedding, into every rank or its sequence shard.
  const Tensor& all = tp_.sequence_parallel ? tp_.partial : out;
  backend_.embedding_shard_forward(all, tokens, table, first_id_);
  tp_.reduce_to_sequence(out, all);
}

void VocabParallelEmbedding::backward(const Tensor& dtable, const Tensor& dout,
                                      const Tensor& tokens) {
  if (tp_.size == 1) return backend_.embedding_backward(dtable, dout, tokens);
  const Tensor& d = tp_.sequence_parallel ? tp_.gather_sequence(dout) : dout;
  backend_.embedding_shard_backward(dtable, d, tokens, first_id_);
}

// ---- VocabParallelCrossEntropy

void VocabParallelCrossEntropy::forward(const Tensor& losses, const Tensor& logits,
                                        const Tensor& targets, const Tensor& dlogits,
                                        float grad_scale) {
  if (tp_.size == 1) return backend_.cross_entropy(losses, logits, targets, dlogits, grad_scale);
  const int64_t n = logits.dim(0);
  const Tensor stats = stats_.rows(0, n);
  const Tensor all_stats = all_stats_.flat_range(0, tp_.size * n * 2).view({tp_.size, n, 2});
  backend_.cross_entropy_shard_stats(stats, logits, targets, first_id_);
  tp_.get().all_gather(all_stats, stats);
  backend_.cross_entropy_shard(losses, logits, targets, all_stats, first_id_, dlogits, grad_scale);
}

// ---- ContextParallelAttention

ParallelGroup& ContextParallelAttention::group() const {
  TS_CHECK(group_ != nullptr, "context parallelism over {} ranks without a group", size_);
  return *group_;
}

void ContextParallelAttention::forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const AttentionShape& s, const Fp8CastArgs& codes) {
  if (size_ == 1 && codes.out.defined())
    return backend_.attention_forward_cast(out, lse, qkv, s, codes);
  if (size_ == 1) return backend_.attention_forward(out, lse, qkv, s);
  backend_.attention_gathered_forward(out, lse, qkv, gather_kv(qkv, s), b_.positions, rank_, s);
  if (codes.out.defined())
    backend_.fp8_cast_transpose({out, codes.out, {}, codes.scale, codes.amax});
}

void ContextParallelAttention::backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                        const Tensor& lse, const Tensor& qkv,
                                        const AttentionShape& s) {
  if (size_ == 1) return backend_.attention_backward(dqkv, dout, out, lse, qkv, s);
  const Tensor kv_all = gather_kv(qkv, s);
  const Tensor dkv_all = rows(b_.dkv_all, size_ * qkv.dim(0), s);
  backend_.attention_gathered_backward(dqkv, dkv_all, dout, out, lse, qkv, kv_all, b_.positions,
                                       rank_, s);
  const Tensor dkv = rows(b_.kv, qkv.dim(0), s);
  group().reduce_scatter(dkv, dkv_all);
  backend_.copy_columns(dqkv, s.heads * s.head_dim, dkv, 0, s.kv_width());
}

Tensor ContextParallelAttention::rows(const Tensor& buffer, int64_t n, const AttentionShape& s) {
  return buffer.flat_range(0, n * s.kv_width()).view({n, s.kv_width()});
}

// Only the keys and values travel: the queries are this rank's alone (a third of the bytes of
// the whole qkv with 4 query heads per key head, Llama 3's ratio).
Tensor ContextParallelAttention::gather_kv(const Tensor& qkv, const AttentionShape& s) {
  const int64_t n = qkv.dim(0);
  const Tensor kv = rows(b_.kv, n, s), kv_all = rows(b_.kv_all, size_ * n, s);
  backend_.copy_columns(kv, 0, qkv, s.heads * s.head_dim, s.kv_width());
  group().all_gather(kv_all, kv);
  return kv_all;
}

std::vector<int32_t> context_parallel_positions(int64_t seq_length, int size) {
  std::vector<int32_t> all;
  for (int r = 0; r < size; ++r) {
    const std::vector<int32_t> pos = context_parallel_positions(seq_length, size, r);
    all.insert(all.end(), pos.begin(), pos.end());
  }
  return all;
}

std::vector<int32_t> context_parallel_positions(int64_t seq_length, int size, int rank) {
  const int64_t half = seq_length / 2;
  std::vector<int32_t> pos(static_cast<size_t>(seq_length));
  for (int64_t t = 0; t < seq_length; ++t)
    pos[t] = static_cast<int32_t>(t < half ? rank * half + t
                                           : (2 * int64_t{size} - 1 - rank) * half + t - half);
  return pos;
}

}  // namespace tessera
