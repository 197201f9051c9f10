#pragma once
// DPO pairs with their prompt once (ModelRuntime::shared_prompt_side, SharedPromptPair): the
// model's rows hold each pair's prompt once and both answers after it, so every GEMM, norm and
// MLP runs on the prompt once. Attention alone must see the two sides apart (the rejected
// answer must not see the chosen one), so it runs on an expanded copy: each pair's two sides as
// two sequences of shared_prompt_side tokens, the prompt's rows in both, exactly the batched
// layout's attention. Its outputs return to their rows; in the backward the prompt's rows
// take the gradients of both copies.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "tessera/model/model.h"
#include "tessera/model/parallel_layers.h"

namespace tessera {

// Where each row of the expanded layout reads from and returns to, on the host.
struct SharedPromptRows {
  // Per attention row (2 x pairs x side): the model row it reads (padding reads its pair's
  // first row, whose values are finite; nothing of it returns).
  std::vector<int32_t> source;
  // Per attention row: its position in its document (padding restarts at 0 after the side),
  // as SampleSource::sample gives a batched side's.
  std::vector<int32_t> positions;
  // The model rows that take an attention row's results, and those attention rows: every row
  // but padding, its own side's copy (the prompt's: the chosen side's).
  std::vector<int32_t> home_model, home_attention;
  // Per pair, the attention rows of its prompt's two copies: the chosen side's (home), which
  // takes the rejected side's gradients too.
  struct PromptCopies {
    int64_t chosen = 0, rejected = 0, rows = 0;
    bool operator==(const PromptCopies&) const = default;
  };
  std::vector<PromptCopies> prompts;
  // The model rows of each pair's padding, [begin, end), which no attention row returns to.
  std::vector<std::pair<int64_t, int64_t>> padding;
  // The model rows that start each scaled sequence (each pair's chosen side, then its
  // rejected side), and the end: 2 x pairs + 1 values.
  std::vector<int64_t> sequence_rows;
};

// Throws InternalError for a pair that does not fit its row or its sides.
SharedPromptRows shared_prompt_rows(std::span<const SharedPromptPair> pairs, int64_t row_length,
                                    int64_t side_length);

// The expansion's device buffers, owned by the model's activation plan: per slot, the rows
// (int32, as SharedPromptRows, padded to their planned sizes); shared, the expanded q, k, v,
// output and their gradients (2 B side, width).
struct SharedPromptBuffers {
  Tensor source, home_model, home_attention;
  Tensor qkv, out, dqkv, dout;
};

// Attention of the model's rows through the expanded layout, by `attention` (one
// context-parallel rank: the backend's attention).
class SharedPromptAttention {
 public:
  SharedPromptAttention(Backend& backend, ContextParallelAttention& attention,
                        const SharedPromptBuffers& buffers)
      : backend_(backend), attention_(attention), b_(buffers) {}
  // What a slot's batch needs on the host beside its buffers' rows.
  struct Layout {
    int64_t homes = 0;  // home_model's and home_attention's rows
    std::vector<SharedPromptRows::PromptCopies> prompts;
    std::vector<std::pair<int64_t, int64_t>> padding;
  };
  // out, qkv: the model's rows; lse and `s`: the expanded layout's (s.batch x s.seq rows).
  void forward(const Layout& l, const Tensor& out, const Tensor& lse, const Tensor& qkv,
               const AttentionShape& s);
  void backward(const Layout& l, const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                const Tensor& lse, const Tensor& qkv, const AttentionShape& s);

 private:
  // The first `rows` rows of a shared buffer, `width` wide.
  static Tensor rows(const Tensor& buffer, int64_t rows, int64_t width);

  Backend& backend_;
  ContextParallelAttention& attention_;
  const SharedPromptBuffers& b_;
};

}  // namespace tessera
