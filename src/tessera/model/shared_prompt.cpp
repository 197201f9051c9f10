#include "tessera/model/shared_prompt.h"

#include "tessera/core/error.h"

namespace tessera {

SharedPromptRows shared_prompt_rows(std::span<const SharedPromptPair> pairs, int64_t row_length,
                                    int64_t side_length) {
  SharedPromptRows r;
  const auto n = static_cast<int64_t>(pairs.size());
  r.source.reserve(static_cast<size_t>(2 * n * side_length));
  r.positions.reserve(r.source.capacity());
  for (int64_t m = 0; m < n; ++m) {
    const SharedPromptPair& p = pairs[static_cast<size_t>(m)];
    const int64_t prompt = p.prompt, chosen = p.chosen_end, rejected = p.rejected_end;
    const int64_t rejected_side = prompt + rejected - chosen;
    TS_CHECK(0 <= prompt && prompt <= chosen && chosen <= rejected && rejected <= row_length &&
                 chosen <= side_length && rejected_side <= side_length,
             "shared-prompt pair {}: prompt {}, chosen end {}, rejected end {} in a row of {} "
             "with sides of {}",
             m, prompt, chosen, rejected, row_length, side_length);
    const auto base = static_cast<int32_t>(m * row_length);
    for (int side = 0; side < 2; ++side) {
      const int64_t real = side == 0 ? chosen : rejected_side;
      for (int64_t k = 0; k < side_length; ++k) {
        const bool own = side == 0 || k < prompt;  // the row at its own index of the pair
        r.source.push_back(k >= real ? base : static_cast<int32_t>(base + (own ? k : chosen + k - prompt)));
        r.positions.push_back(static_cast<int32_t>(k < real ? k : k - real));
      }
    }
    const auto chosen_row = static_cast<int32_t>(2 * m * side_length);
    const auto rejected_row = static_cast<int32_t>((2 * m + 1) * side_length);
    for (int64_t i = 0; i < rejected; ++i) {
      r.home_model.push_back(static_cast<int32_t>(base + i));
      r.home_attention.push_back(static_cast<int32_t>(i < chosen ? chosen_row + i : rejected_row + prompt + i - chosen));
    }
    r.prompts.push_back({chosen_row, rejected_row, prompt});
    if (rejected < row_length) r.padding.emplace_back(base + rejected, base + row_length);
    r.sequence_rows.push_back(base);
    r.sequence_rows.push_back(base + chosen);
  }
  r.sequence_rows.push_back(n * row_length);
  return r;
}

Tensor SharedPromptAttention::rows(const Tensor& buffer, int64_t rows, int64_t width) {
  return buffer.flat_range(0, rows * width).view({rows, width});
}

void SharedPromptAttention::forward(const Layout& l, const Tensor& out, const Tensor& lse,
                                    const Tensor& qkv, const AttentionShape& s) {
  const int64_t n = s.tokens();
  const Tensor qkv_all = rows(b_.qkv, n, qkv.dim(1)), out_all = rows(b_.out, n, out.dim(1));
  backend_.copy_rows(qkv_all, Tensor{}, qkv, b_.source.flat_range(0, n));
  attention_.forward(out_all, lse, qkv_all, s, {});
  // Padding rows take no result; zeros keep them finite for the GEMMs after.
  for (const auto& [begin, end] : l.padding) backend_.fill(out.rows(begin, end), 0.0f);
  backend_.copy_rows(out, b_.home_model.flat_range(0, l.homes), out_all,
                     b_.home_attention.flat_range(0, l.homes));
}

// The expanded rows' outputs other than their own side's (padding, the rejected side's copies
// of the prompt) are read from other rows: their output gradients are zero, so their outputs
// and their log-sum-exps (kept from the forward, finite) give them no gradient to pass on.
void SharedPromptAttention::backward(const Layout& l, const Tensor& dqkv, const Tensor& dout,
                                     const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                     const AttentionShape& s) {
  const int64_t n = s.tokens(), wq = qkv.dim(1), wo = out.dim(1);
  const Tensor source = b_.source.flat_range(0, n);
  const Tensor home_model = b_.home_model.flat_range(0, l.homes);
  const Tensor home_attention = b_.home_attention.flat_range(0, l.homes);
  const Tensor qkv_all = rows(b_.qkv, n, wq), out_all = rows(b_.out, n, wo);
  const Tensor dqkv_all = rows(b_.dqkv, n, wq), dout_all = rows(b_.dout, n, wo);
  backend_.copy_rows(qkv_all, Tensor{}, qkv, source);
  backend_.copy_rows(out_all, Tensor{}, out, source);
  backend_.fill(dout_all, 0.0f);
  backend_.copy_rows(dout_all, home_attention, dout, home_model);
  attention_.backward(dqkv_all, dout_all, out_all, lse, qkv_all, s);
  // The prompt's rows: the chosen side's gradients plus the rejected side's, before they return.
  for (const SharedPromptRows::PromptCopies& p : l.prompts) {
    if (p.rows == 0) continue;
    const Tensor home = dqkv_all.rows(p.chosen, p.chosen + p.rows);
    backend_.add(home, home, dqkv_all.rows(p.rejected, p.rejected + p.rows));
  }
  for (const auto& [begin, end] : l.padding) backend_.fill(dqkv.rows(begin, end), 0.0f);
  backend_.copy_rows(dqkv, home_model, dqkv_all, home_attention);
}

}  // namespace tessera
