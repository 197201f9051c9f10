#pragma once
// DPO pairs with their prompt once (ModelRuntime::shared_prompt_side, SharedPromptPair): the
// model's rows hold each pair's prompt once and both answers after it, so every GEMM, norm and
// MLP runs on the prompt once. Attention alone must see the two sides apart (the rejected
// answer must not see the chosen one), so it runs on an expanded copy: each pair's two sides as
// two sequences of shared_prompt_side tokens, the prompt's rows in both, exactly the batched
// layout's attention. Its outputs return to their rows; in the backward the prompt's rows
// take the gradients of both copies.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tessera/model/model.h"

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
  // The rejected side's copies of the prompt rows, and those prompt rows.
  std::vector<int32_t> copy_attention, copy_model;
  // The model rows that start each scaled sequence (each pair's chosen side, then its
  // rejected side), and the end: 2 x pairs + 1 values.
  std::vector<int64_t> sequence_rows;
};

// Throws InternalError for a pair that does not fit its row or its sides.
SharedPromptRows shared_prompt_rows(std::span<const SharedPromptPair> pairs, int64_t row_length,
                                    int64_t side_length);

// The expansion's device buffers, owned by the model's activation plan: per slot, the rows
// (int32, as SharedPromptRows, padded to their planned sizes); shared, the expanded q, k, v,
// output and their gradients (2 B side, width), and two (B T, qkv width) buffers for the
// prompt rows' sums.
struct SharedPromptBuffers {
  Tensor source, home_model, home_attention, copy_attention, copy_model;
  Tensor qkv, out, dqkv, dout, prompt_sum, prompt_copy;
};

class SharedPromptAttention {
 public:
  using Attend = std::function<void(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                    const AttentionShape& s)>;
  using AttendBackward =
      std::function<void(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                         const Tensor& lse, const Tensor& qkv, const AttentionShape& s)>;
  SharedPromptAttention(Backend& backend, const SharedPromptBuffers& buffers)
      : backend_(backend), b_(buffers) {}
  // The slot's row counts (its buffers hold the rows themselves).
  struct Counts {
    int64_t homes = 0, copies = 0;
  };
  // out, qkv: the model's rows; lse and `s`: the expanded layout's (s.batch x s.seq rows).
  void forward(const Counts& c, const Tensor& out, const Tensor& lse, const Tensor& qkv,
               const AttentionShape& s, const Attend& attend);
  void backward(const Counts& c, const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                const Tensor& lse, const Tensor& qkv, const AttentionShape& s,
                const AttendBackward& attend_backward);

 private:
  // The first `rows` rows of a shared buffer, `width` wide.
  static Tensor rows(const Tensor& buffer, int64_t rows, int64_t width);

  Backend& backend_;
  const SharedPromptBuffers& b_;
};

}  // namespace tessera
