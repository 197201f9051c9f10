#pragma once
// The layers that split a model over ranks, each doing its own collectives over its group
// (Megatron's tensor_parallel layers and mappings): column- and row-parallel linears, the
// vocabulary-parallel embedding and cross-entropy, and context-parallel attention. Over a
// group of one rank every collective is the identity, so a model calls the same layer on one
// device and on many. The GEMMs underneath are LinearGemms', bf16 or FP8.
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/model/expert_exchange.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/model.h"
#include "tessera/model/param_layout.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Low-rank adapters on some of a model's linear weights (LoRA, model/lora_model.h): such a
// weight is frozen (no gradient GEMM), and the adapters add their term to its output and take
// their gradients from its output gradient and input.
class LinearAdapters {
 public:
  virtual ~LinearAdapters() = default;
  virtual bool adapts(int weight) const = 0;
  // out += the adapters' term of `in`.
  virtual void forward(const Tensor& out, const Tensor& in, int weight) = 0;
  // The adapters' gradients accumulate; din (when defined) += their term's input gradient.
  virtual void backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight) = 0;
};

// The local GEMMs of a model's linear layers and expert stacks: bf16 through the op API, or FP8
// (Fp8Linears) for the weights an fp8 run casts; and whether each weight's gradient has been
// written in this step. The first weight-gradient GEMM of a step writes it (beta 0), later
// ones add, so no pass over the gradients zeroes them first.
class LinearGemms {
 public:
  // params(i), grads(i): parameter i and its gradient wherever they are now (the model's flat
  // buffers, or a sharded unit bound for the pass).
  using TensorOf = std::function<Tensor(int)>;
  LinearGemms(Backend& backend, TensorOf params, TensorOf grads, size_t param_count);

  // FP8 GEMMs for the weights fp8_index names (index into fp8's linears, -1: bf16).
  void use_fp8(Fp8Linears* fp8, std::vector<int> fp8_index);
  // Adapters on the weights they adapt, which are frozen from then on (not owned; null: none).
  void use_adapters(LinearAdapters* adapters) { adapters_ = adapters; }
  bool is_fp8(int weight) const { return fp8_index_[weight] >= 0; }
  // Whether adapters adapt `weight` (and read its input and output gradient).
  bool adapted(int weight) const { return adapters_ && adapters_->adapts(weight); }

  // A new step: every weight's next weight-gradient GEMM writes; `accumulate_all` (sharded
  // gradients, started by their owner) makes every one add instead.
  void start_step(bool accumulate_all);

  // Where `weight`'s forward reads its input's FP8 codes when a producer writes them
  // (Fp8Linears::input_cast); undefined out for a bf16 weight.
  Fp8CastArgs input_cast(int weight, int64_t rows) const {
    return is_fp8(weight) ? fp8_->input_cast(fp8_index_[weight], rows) : Fp8CastArgs{};
  }
  // out = in @ W^T (+ bias) + beta * c.
  void forward(const Tensor& out, const LinearOperand& in, int weight, int bias, float beta,
               const Tensor& c) const;
  // Where `weight`'s backward reads its output gradient's FP8 codes when a producer writes
  // them (Fp8Linears::output_grad_cast); undefined out for a bf16 weight and for an adapted
  // one (its adapters read the gradient itself).
  Fp8CastArgs output_grad_cast(int weight, int64_t rows) const {
    if (!is_fp8(weight) || adapted(weight)) return {};
    return fp8_->output_grad_cast(fp8_index_[weight], rows);
  }
  // din = dout @ W (skipped when undefined); dW (+)= dout^T @ in; dbias += colsum(dout).
  // With dout.cast (an FP8 weight without adapters or bias) its codes are already written;
  // with in.codes_t (an FP8 weight without adapters) the input's transposed codes.
  void backward(const Tensor& din, const LinearOperand& dout, const LinearOperand& in, int weight,
                int bias);
  // A backward of `weight` on no rows (the output head on a batch without loss rows): its
  // gradient gets their zero contribution, which must be written where the step's first
  // weight-gradient GEMM would have overwritten last step's values.
  void backward_without_rows(int weight);
  // The next weight-gradient GEMM of `weight` writes its gradient (beta 0) rather than adding
  // to it: a sharded unit's first micro-batch (DecoderModel::start_unit_grads).
  void write_grad_next(int weight) { grad_written_[weight] = 0; }
  // An expert stack w (local experts, out, in) over the row groups; dw accumulates.
  void expert_forward(const Tensor& out, const Tensor& in, int weight, const Tensor& w,
                      const ExpertGroups& groups) const;
  void expert_backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight,
                       const Tensor& w, const Tensor& dw, const ExpertGroups& groups);
  Backend& backend() const { return backend_; }

 private:
  // What an FP8 GEMM of `weight` casts: the weight, or nothing once its codes are cached (a
  // sharded unit read from copies has no weights bound; DecoderModel::unit_read_from_copies).
  Tensor fp8_weight(int weight) const;
  // 0 for the step's first weight-gradient GEMM of `weight`, 1 after; marks it written.
  float take_grad_beta(int weight);

  Backend& backend_;
  TensorOf params_, grads_;
  Fp8Linears* fp8_ = nullptr;
  LinearAdapters* adapters_ = nullptr;
  std::vector<int> fp8_index_;
  std::vector<char> grad_written_;
};

// The tensor-parallel group a model's layers split over, and the scratch their collectives
// need. With sequence parallelism the residual stream holds this rank's rows of the tokens
// (its sequence shard), gathered before a column-parallel layer and reduce-scattered after a
// row-parallel one.
struct TensorParallelGroup {
  ParallelGroup* group = nullptr;  // null: a group of one
  int size = 1, rank = 0;
  bool sequence_parallel = false;
  Tensor gathered;  // (N, C): every rank's sequence shard, gathered
  Tensor partial;   // (N, C): partial sums for every token before a reduce-scatter

  ParallelGroup& get() const;
  // gathered = every rank's shard x (Ns, C), in rank order.
  const Tensor& gather_sequence(const Tensor& x);
  // x: this rank's rows of `in` summed over the ranks (reduce-scatter with sequence
  // parallelism), or `in` summed over the ranks in place (all-reduce).
  void reduce_to_sequence(const Tensor& out, const Tensor& in);
};

// Megatron's ColumnParallelLinear: each rank computes its slice of the outputs from the whole
// input (gathered from the sequence shards first); in the backward d(input) holds partial sums
// over this rank's outputs, added up over the ranks.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear(TensorParallelGroup& tp, LinearGemms& gemms) : tp_(tp), gemms_(gemms) {}
  // With in.cast (never under sequence parallelism) the whole input's codes are written.
  void forward(const Tensor& out, const LinearOperand& in, int weight, int bias);
  // With in.codes_t (never under sequence parallelism) the input's transposed codes.
  void backward(const Tensor& din, const LinearOperand& dout, const LinearOperand& in, int weight,
                int bias);

 private:
  TensorParallelGroup& tp_;
  LinearGemms& gemms_;
};

// Megatron's RowParallelLinear: each rank computes partial sums of every output from its slice
// of the inputs, added up over the ranks straight into the residual stream (all-reduce) or into
// each rank's sequence shard of it (reduce-scatter). The residual is added once: by rank 0
// before an all-reduce, by each rank into the rows of its own shard before a reduce-scatter.
// In the backward d(output) is the same on every rank (gathered from the shards) and d(input)
// is this rank's slice, complete.
class RowParallelLinear {
 public:
  RowParallelLinear(TensorParallelGroup& tp, LinearGemms& gemms) : tp_(tp), gemms_(gemms) {}
  // out = in @ W^T (+ residual), summed over the ranks; a bias would be added by every rank.
  void forward(const Tensor& out, const LinearOperand& in, int weight, const Tensor& residual);
  // With dout.cast (never under sequence parallelism, which gathers dout first) its codes are
  // already written.
  void backward(const Tensor& din, const LinearOperand& dout, const LinearOperand& in, int weight);

 private:
  TensorParallelGroup& tp_;
  LinearGemms& gemms_;
};

// Megatron's VocabParallelEmbedding: each rank holds the rows of ids [first_id, first_id + V)
// and looks up its tokens (zeros for the others'); the lookups add up over the ranks.
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(Backend& backend, TensorParallelGroup& tp, int64_t first_id)
      : backend_(backend), tp_(tp), first_id_(first_id) {}
  // out (Ns, C) = table[tokens] for this rank's rows of the residual stream.
  void forward(const Tensor& out, const Tensor& tokens, const Tensor& table);
  // dtable accumulates dout's rows (gathered from the shards) at this rank's tokens.
  void backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens);

 private:
  Backend& backend_;
  TensorParallelGroup& tp_;
  int64_t first_id_;
};

// Megatron's vocab_parallel_cross_entropy over a chunk of logits (n, V/tp): each rank's
// logsumexp and target logit, all-gathered, give every rank the loss, and each its columns'
// gradient (written over the logits).
class VocabParallelCrossEntropy {
 public:
  // stats (>= n, 2) and all_stats (tp, >= n, 2) fp32: the collective's buffers.
  VocabParallelCrossEntropy(Backend& backend, TensorParallelGroup& tp, int64_t first_id,
                            Tensor stats, Tensor all_stats)
      : backend_(backend), tp_(tp), first_id_(first_id), stats_(stats), all_stats_(all_stats) {}
  void forward(const Tensor& losses, const Tensor& logits, const Tensor& targets,
               const Tensor& dlogits, float grad_scale);

 private:
  Backend& backend_;
  TensorParallelGroup& tp_;
  int64_t first_id_;
  Tensor stats_, all_stats_;
};

// Megatron's context parallelism with the keys and values all-gathered: every rank's k and v
// columns of qkv are gathered (the queries stay with their rank), and this rank's queries
// attend to all of them by position; in the backward they are gathered again rather than
// kept, and each rank's key and value gradients, which every rank's queries contribute to, are
// reduce-scattered back to it.
class ContextParallelAttention {
 public:
  struct Buffers {
    Tensor kv;               // (N, 2 KV D): this rank's k and v columns, or their gradients
    Tensor kv_all, dkv_all;  // (cp x N, 2 KV D): every rank's, and their gradients
    Tensor positions;        // (cp, seq_length) int32: every rank's token positions
  };
  ContextParallelAttention(Backend& backend, int size, int rank, Buffers buffers)
      : backend_(backend), size_(size), rank_(rank), b_(buffers) {}
  // The group of `size` ranks (not owned); needed before the first pass when size > 1.
  void set_group(ParallelGroup* group) { group_ = group; }
  // With codes.out defined out's FP8 codes and amax too (ForwardOps::attention_forward):
  // folded into the kernel on one rank, cast after the gathered attention on several.
  void forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s,
               const Fp8CastArgs& codes);
  void backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                const Tensor& qkv, const AttentionShape& s);

 private:
  ParallelGroup& group() const;
  // The first n rows of a (rows, 2 KV D) buffer.
  static Tensor rows(const Tensor& buffer, int64_t n, const AttentionShape& s);
  // This rank's k and v columns of qkv, all-gathered: (cp x N, 2 KV D).
  Tensor gather_kv(const Tensor& qkv, const AttentionShape& s);

  Backend& backend_;
  ParallelGroup* group_ = nullptr;
  int size_, rank_;
  Buffers b_;
};

// Megatron's causal load balancing of context parallelism: of a sequence cut into 2 x size
// chunks of seq_length / 2 tokens, `rank` holds chunks rank and 2 size - 1 - rank; the whole
// sequence's position of each of its seq_length tokens.
std::vector<int32_t> context_parallel_positions(int64_t seq_length, int size, int rank);
// Every rank's, rank after rank: the positions (size, seq_length) that the gathered attention
// reads (Backend::attention_gathered_forward).
std::vector<int32_t> context_parallel_positions(int64_t seq_length, int size);

}  // namespace tessera
