#pragma once
// `tessera bench attention`: the fused attention op (forward and backward) over masks
// (causal, full, causal sliding window, packed documents), GQA ratios, head dims and sequence
// lengths.
//
// FLOPs convention (as dev/attention/attention_lab and docs/performance.md): forward
// 4 * B * H * D * visible query-key pairs, where plain causal counts T^2 / 2 (half of full),
// full counts T^2, a window counts its exact band and packed documents L^2 / 2 for each
// document of L tokens; backward counts 2.5x the forward.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/bench/measure.h"

namespace tessera::bench {

struct AttentionProblem {
  int64_t batch = 1, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  int64_t window = 0;     // > 0: causal sliding window
  // > 0: causal, each sequence packed with documents of this many tokens (the last one
  // shorter), attention kept inside each (reset_attention_mask).
  int64_t document_length = 0;
  bool backward = false;  // time the backward (the forward runs once to produce out and lse)
  // > 1: causal attention under context parallelism over this many segments of seq tokens
  // (each segment's share timed in turn; the pairs are the whole sequence's).
  int64_t segments = 1;
  // fp8_dot_product_attention: the forward on e4m3 codes (AttentionShape::fp8); the backward
  // rows time the bf16 backward after it.
  bool fp8 = false;

  AttentionShape shape() const;  // without the document starts (allocate() adds them)
  std::string mask() const;      // "causal", "full", "window 4096", "packed 2048" (+ " fp8")
  double forward_flops() const;
  double flops() const { return backward ? 2.5 * forward_flops() : forward_flops(); }
};

// Query-key pairs attention computes for a sequence of T tokens (the convention above).
double visible_pairs(int64_t seq, bool causal, int64_t window, int64_t document_length = 0);

struct AttentionCheck {
  bool ok = false;
  double rel_err = 0;  // small case vs the CPU reference (out for forward, dqkv for backward)
  std::string failure;
};

// The same mask, GQA ratio and head dim at T=200 against ctx.reference; for the forward also
// sampled query rows of the full-size problem against a host softmax in double.
AttentionCheck check_attention(BenchContext& ctx, const AttentionProblem& p);

struct AttentionResult {
  AttentionCheck check;
  Timing timing;  // only when check.ok
  double tflops = 0;
};

// check_attention, then (if it passed) the median time over rotated input sets. An error of
// the backend (an unsupported shape, out of memory) is reported as a failed check.
AttentionResult run_attention(BenchContext& ctx, const AttentionProblem& p);

int attention_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
