// The op facade: checks, observer and timing once for every backend, then the backend's
// do_<op> (ops/backend.h).
#include "tessera/ops/backend.h"

#include <algorithm>

#include "tessera/core/fp8.h"
#include "tessera/ops/op_checks.h"
#include "tessera/ops/op_observer.h"

namespace tessera {

// Brackets one op: a timing event pair while op timing is on, and op_begin(name, make_args())
// / op_end() to the observer when one is set. Without either it costs two tests: make_args is
// never called.
template <class MakeArgs>
class OpScope {
 public:
  OpScope(Backend& b, const char* name, MakeArgs&& make_args) : b_(b), name_(name) {
    if (b_.timing_) [[unlikely]] {
      start_ = b_.take_event();
      b_.record_event(start_);
    }
    if (b_.op_observer_ != nullptr) [[unlikely]]
      b_.op_observer_->op_begin(name, make_args());
  }
  ~OpScope() {
    if (b_.op_observer_ != nullptr) [[unlikely]]
      b_.op_observer_->op_end();
    if (start_.defined()) [[unlikely]] {
      const EventHandle end = b_.take_event();
      b_.record_event(end);
      b_.timed_.push_back({name_, start_, end});
    }
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  Backend& b_;
  const char* name_;
  EventHandle start_;
};

template <class MakeArgs>
OpScope(Backend&, const char*, MakeArgs&&) -> OpScope<MakeArgs>;

// ---- timing ----

EventHandle Backend::take_event() {
  if (spare_events_.empty()) return create_event();
  const EventHandle e = spare_events_.back();
  spare_events_.pop_back();
  return e;
}

void Backend::fold_timed_ops() {
  for (const TimedOp& t : timed_) {
    const double ms = elapsed_ms(t.start, t.end);
    auto it = std::find_if(op_totals_ms_.begin(), op_totals_ms_.end(),
                           [&](const auto& total) { return total.first == t.name; });
    if (it == op_totals_ms_.end()) {
      op_totals_ms_.emplace_back(t.name, ms);
    } else {
      it->second += ms;
    }
    spare_events_.push_back(t.start);
    spare_events_.push_back(t.end);
  }
  timed_.clear();
}

void Backend::enable_op_timing(bool on) {
  if (on && !timing_) {  // a fresh measurement: drop totals and pairs from earlier ones
    for (const TimedOp& t : timed_) {
      spare_events_.push_back(t.start);
      spare_events_.push_back(t.end);
    }
    timed_.clear();
    op_totals_ms_.clear();
  }
  timing_ = on;
}

std::vector<std::pair<std::string, double>> Backend::op_times_ms() {
  synchronize();
  fold_timed_ops();
  auto totals = op_totals_ms_;
  std::sort(totals.begin(), totals.end());
  return totals;
}

// ---- memory and ranges ----

void Backend::upload(const Tensor& dst, const void* host_src) {
  const OpScope scope(*this, "upload", [&] { return op_args::transfer(dst); });
  OpChecks(*this, "upload").placed(dst, "dst");
  do_upload(dst, host_src);
}

void Backend::download(void* host_dst, const Tensor& src) {
  const OpScope scope(*this, "download", [&] { return op_args::transfer(src); });
  OpChecks(*this, "download").placed(src, "src");
  do_download(host_dst, src);
}

void Backend::copy(const Tensor& dst, const Tensor& src) {
  const OpScope scope(*this, "copy", [&] { return op_args::transfer(src); });
  const OpChecks check(*this, "copy");
  check.placed(dst, "dst");
  check.placed(src, "src");
  check.that(dst.dtype == src.dtype && dst.numel() == src.numel(), "dst {} {} and src {} {} differ",
             dtype_name(dst.dtype), dst.shape.str(), dtype_name(src.dtype), src.shape.str());
  if (dst.data == src.data || dst.nbytes() == 0) return;
  do_copy(dst, src);
}

void Backend::range_push(const char* name) {
  do_range_push(name);
  if (op_observer_ != nullptr) op_observer_->range_begin(name);
}

void Backend::range_pop() {
  if (op_observer_ != nullptr) op_observer_->range_end();
  do_range_pop();
}

// ---- elementwise and init ----

void Backend::fill(const Tensor& dst, float value) {
  const OpScope scope(*this, "fill", [&] { return op_args::elements(dst); });
  OpChecks(*this, "fill").placed(dst, "dst");
  do_fill(dst, value);
}

void Backend::convert(const Tensor& dst, const Tensor& src) {
  const OpScope scope(*this, "convert", [&] { return op_args::convert(dst, src); });
  const OpChecks check(*this, "convert");
  check.placed(src, "src");
  check.count(dst, src.numel(), "dst");
  do_convert(dst, src);
}

void Backend::init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                          float std) {
  const OpScope scope(*this, "init_normal", [&] { return op_args::elements(dst); });
  OpChecks(*this, "init_normal").placed(dst, "dst");
  do_init_normal(dst, seed, first_index, mean, std);
}

// ---- linear algebra ----

namespace {

// The epilogue operands shared by both GEMMs: c (read with beta; undefined or out itself
// means out) and a bias broadcast over rows.
void check_epilogue(const OpChecks& check, const Tensor& out, const Tensor& c, const Tensor& bias,
                    int64_t M, int64_t N) {
  if (c.defined() && c.data != out.data) check.count(c, M * N, "c");
  if (bias.defined()) check.count(bias, N, "bias");
}

}  // namespace

void Backend::matmul(const MatmulArgs& args) {
  const OpScope scope(*this, "matmul", [&] { return op_args::matmul(args); });
  const OpChecks check(*this, "matmul");
  check.placed(args.out, "out");
  check.placed(args.a, "a");
  check.placed(args.b, "b");
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  const int64_t M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;
  check.that((args.trans_a ? a.cols : a.rows) == M,
             "a {} (trans_a={}) does not have the {} rows of out {}", args.a.shape.str(),
             args.trans_a, M, args.out.shape.str());
  check.that((args.trans_b ? b.cols : b.rows) == K && (args.trans_b ? b.rows : b.cols) == N,
             "b {} (trans_b={}) is not (K={}, N={})", args.b.shape.str(), args.trans_b, K, N);
  check.that(args.out.data != args.a.data && args.out.data != args.b.data, "out aliases an input");
  check_epilogue(check, args.out, args.c, args.bias, M, N);
  do_matmul(args);
}

void Backend::bias_backward(const Tensor& dbias, const Tensor& dout) {
  const OpScope scope(*this, "bias_backward", [&] { return op_args::rows_cols(dout); });
  const OpChecks check(*this, "bias_backward");
  check.placed(dout, "dout");
  check.count(dbias, matrix_dims(dout).cols, "dbias");
  do_bias_backward(dbias, dout);
}

void Backend::fp8_cast_transpose(const Fp8CastArgs& args) {
  const OpScope scope(*this, "fp8_cast_transpose", [&] { return op_args::rows_cols(args.x); });
  const OpChecks check(*this, "fp8_cast_transpose");
  check.placed(args.x, "x");
  const int64_t n = args.x.numel();
  for (const auto& [t, what] : {std::pair{&args.out, "out"}, std::pair{&args.out_t, "out_t"}}) {
    if (!t->defined()) continue;
    check.count(*t, n, what);
    check.that(is_fp8(t->dtype), "{} dtype {} is not fp8", what, dtype_name(t->dtype));
  }
  check.that(!args.out.defined() || !args.out_t.defined() || args.out.dtype == args.out_t.dtype,
             "out {} and out_t {} differ", dtype_name(args.out.dtype),
             dtype_name(args.out_t.dtype));
  if (args.out.defined() || args.out_t.defined()) check.count(args.scale, 1, "scale");
  if (args.amax.defined()) check.count(args.amax, 1, "amax");
  do_fp8_cast_transpose(args);
}

void Backend::matmul_fp8(const Fp8MatmulArgs& args) {
  const OpScope scope(*this, "matmul_fp8", [&] { return op_args::matmul_fp8(args); });
  const OpChecks check(*this, "matmul_fp8");
  check.placed(args.out, "out");
  check.placed(args.a, "a");
  check.placed(args.b, "b");
  check.count(args.a_scale_inv, 1, "a_scale_inv");
  check.count(args.b_scale_inv, 1, "b_scale_inv");
  check.that(is_fp8(args.a.dtype) && is_fp8(args.b.dtype), "a {} and b {} must be fp8",
             dtype_name(args.a.dtype), dtype_name(args.b.dtype));
  check.that(!(args.a.dtype == DType::E5M2 && args.b.dtype == DType::E5M2),
             "e5m2 x e5m2 is not an FP8 GEMM tensor cores have");
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a), b = matrix_dims(args.b);
  check.that(a.rows == o.rows && b.rows == o.cols && b.cols == a.cols,
             "a {} and b {} do not give out {} (out = a @ b^T)", args.a.shape.str(),
             args.b.shape.str(), args.out.shape.str());
  check.that(args.out.data != args.a.data && args.out.data != args.b.data, "out aliases an input");
  check_epilogue(check, args.out, args.c, args.bias, o.rows, o.cols);
  do_matmul_fp8(args);
}

void Backend::fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const OpScope scope(*this, "fp8_update_scales",
                      [&] { return op_args::elements(args.amax_history); });
  const OpChecks check(*this, "fp8_update_scales");
  check.placed(args.amax_history, "amax_history");
  const int64_t S = matrix_dims(args.amax_history).cols;
  check.count(args.scale, S, "scale");
  check.count(args.scale_inv, S, "scale_inv");
  if (args.nonfinite.defined()) check.count(args.nonfinite, 1, "nonfinite");
  do_fp8_update_scales(args);
}

// ---- model ops ----

void Backend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  const OpScope scope(*this, "embedding_forward",
                      [&] { return op_args::embedding(tokens, table, table.dtype); });
  const OpChecks check(*this, "embedding_forward");
  check.placed(tokens, "tokens");
  check.placed(table, "table");
  check.count(out, tokens.numel() * matrix_dims(table).cols, "out");
  do_embedding_forward(out, tokens, table);
}

void Backend::embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  const OpScope scope(*this, "embedding_backward",
                      [&] { return op_args::embedding(tokens, dtable, dout.dtype); });
  const OpChecks check(*this, "embedding_backward");
  check.placed(tokens, "tokens");
  check.placed(dtable, "dtable");
  check.count(dout, tokens.numel() * matrix_dims(dtable).cols, "dout");
  do_embedding_backward(dtable, dout, tokens);
}

void Backend::embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table,
                                      int64_t first_id) {
  const OpScope scope(*this, "embedding_shard_forward",
                      [&] { return op_args::embedding(tokens, table, table.dtype); });
  const OpChecks check(*this, "embedding_shard_forward");
  check.placed(tokens, "tokens");
  check.placed(table, "table");
  check.count(out, tokens.numel() * matrix_dims(table).cols, "out");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
  do_embedding_shard_forward(out, tokens, table, first_id);
}

void Backend::embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                       const Tensor& tokens, int64_t first_id) {
  const OpScope scope(*this, "embedding_shard_backward",
                      [&] { return op_args::embedding(tokens, dtable, dout.dtype); });
  const OpChecks check(*this, "embedding_shard_backward");
  check.placed(tokens, "tokens");
  check.placed(dtable, "dtable");
  check.count(dout, tokens.numel() * matrix_dims(dtable).cols, "dout");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
  do_embedding_shard_backward(dtable, dout, tokens, first_id);
}

void Backend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                              const Tensor& weight, float eps) {
  const OpScope scope(*this, "rmsnorm_forward", [&] { return op_args::rows_cols(x); });
  const OpChecks check(*this, "rmsnorm_forward");
  check.placed(x, "x");
  const MatrixDims d = matrix_dims(x);
  check.count(out, d.rows * d.cols, "out");
  check.count(rstd, d.rows, "rstd");
  check.count(weight, d.cols, "weight");
  do_rmsnorm_forward(out, rstd, x, weight, eps);
}

void Backend::rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                               const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  const OpScope scope(*this, "rmsnorm_backward", [&] { return op_args::rows_cols(x); });
  const OpChecks check(*this, "rmsnorm_backward");
  check.placed(x, "x");
  const MatrixDims d = matrix_dims(x);
  check.count(dx, d.rows * d.cols, "dx");
  check.count(dout, d.rows * d.cols, "dout");
  check.count(dweight, d.cols, "dweight");
  check.count(weight, d.cols, "weight");
  check.count(rstd, d.rows, "rstd");
  do_rmsnorm_backward(dx, dweight, dout, x, weight, rstd);
}

void Backend::rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  const OpScope scope(*this, "rope_forward", [&] { return op_args::rope(s, qkv.dtype); });
  OpChecks(*this, "rope_forward").rope(qkv, freqs, s);
  do_rope_forward(qkv, freqs, s);
}

void Backend::rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s) {
  const OpScope scope(*this, "rope_backward", [&] { return op_args::rope(s, dqkv.dtype); });
  OpChecks(*this, "rope_backward").rope(dqkv, freqs, s);
  do_rope_backward(dqkv, freqs, s);
}

void Backend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                const AttentionShape& s) {
  const OpScope scope(*this, "attention_forward", [&] { return op_args::attention(s, qkv.dtype); });
  const OpChecks check(*this, "attention_forward");
  check.attention_shape(s);
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(out, s.tokens() * s.heads * s.head_dim, "out");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_forward(out, lse, qkv, s);
}

void Backend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                 const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  const OpScope scope(*this, "attention_backward",
                      [&] { return op_args::attention(s, qkv.dtype); });
  const OpChecks check(*this, "attention_backward");
  check.attention_shape(s);
  const int64_t width = s.qkv_width(), heads_width = s.heads * s.head_dim;
  check.count(qkv, s.tokens() * width, "qkv");
  check.count(dqkv, s.tokens() * width, "dqkv");
  check.count(out, s.tokens() * heads_width, "out");
  check.count(dout, s.tokens() * heads_width, "dout");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_backward(dqkv, dout, out, lse, qkv, s);
}

void Backend::attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                         const Tensor& qkv_all, const Tensor& positions,
                                         int64_t segment, const AttentionShape& s) {
  const OpScope scope(*this, "attention_gathered_forward",
                      [&] { return op_args::attention(s, qkv_all.dtype); });
  const OpChecks check(*this, "attention_gathered_forward");
  check.attention_shape(s);
  check.placed(positions, "positions");
  const int64_t segments = s.seq > 0 ? positions.numel() / s.seq : 0;
  check.that(segments >= 1 && positions.numel() == segments * s.seq,
             "positions {} are not (segments, {})", positions.shape.str(), s.seq);
  check.that(segment >= 0 && segment < segments, "segment {} of {}", segment, segments);
  check.count(qkv_all, segments * s.tokens() * s.qkv_width(), "qkv_all");
  check.count(out, s.tokens() * s.heads * s.head_dim, "out");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_gathered_forward(out, lse, qkv_all, positions, segment, s);
}

void Backend::attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout,
                                          const Tensor& out, const Tensor& lse,
                                          const Tensor& qkv_all, const Tensor& positions,
                                          int64_t segment, const AttentionShape& s) {
  const OpScope scope(*this, "attention_gathered_backward",
                      [&] { return op_args::attention(s, qkv_all.dtype); });
  const OpChecks check(*this, "attention_gathered_backward");
  check.attention_shape(s);
  check.placed(positions, "positions");
  const int64_t segments = s.seq > 0 ? positions.numel() / s.seq : 0;
  check.that(segments >= 1 && positions.numel() == segments * s.seq,
             "positions {} are not (segments, {})", positions.shape.str(), s.seq);
  check.that(segment >= 0 && segment < segments, "segment {} of {}", segment, segments);
  const int64_t width = s.qkv_width(), heads_width = s.heads * s.head_dim;
  check.count(qkv_all, segments * s.tokens() * width, "qkv_all");
  check.count(dqkv_all, segments * s.tokens() * width, "dqkv_all");
  check.count(out, s.tokens() * heads_width, "out");
  check.count(dout, s.tokens() * heads_width, "dout");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_gathered_backward(dqkv_all, dout, out, lse, qkv_all, positions, segment, s);
}

void Backend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv, int64_t pos,
                               const AttentionShape& s) {
  const OpScope scope(*this, "attention_decode", [&] { return op_args::attention(s, q.dtype); });
  const OpChecks check(*this, "attention_decode");
  check.attention_shape(s);
  check.that(s.causal, "generation's attention is causal");
  check.that(pos >= 0 && pos < s.seq, "position {} outside the cache's {} positions", pos, s.seq);
  const int64_t heads_width = s.heads * s.head_dim;
  check.count(q, s.batch * heads_width, "q");
  check.count(out, s.batch * heads_width, "out");
  check.count(kv, s.batch * s.seq * 2 * s.kv_heads * s.head_dim, "kv");
  do_attention_decode(out, q, kv, pos, s);
}

void Backend::swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const OpScope scope(*this, "swiglu_forward", [&] { return op_args::rows_cols(gate_up); });
  const OpChecks check(*this, "swiglu_forward");
  check.placed(gate_up, "gate_up");
  const MatrixDims d = matrix_dims(gate_up);
  check.that(d.cols % 2 == 0, "gate_up {} has an odd width", gate_up.shape.str());
  check.count(out, d.rows * d.cols / 2, "out");
  do_swiglu_forward(out, gate_up);
}

void Backend::swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  const OpScope scope(*this, "swiglu_backward", [&] { return op_args::rows_cols(gate_up); });
  const OpChecks check(*this, "swiglu_backward");
  check.placed(gate_up, "gate_up");
  const MatrixDims d = matrix_dims(gate_up);
  check.that(d.cols % 2 == 0, "gate_up {} has an odd width", gate_up.shape.str());
  check.count(dgate_up, d.rows * d.cols, "dgate_up");
  check.count(dout, d.rows * d.cols / 2, "dout");
  do_swiglu_backward(dgate_up, dout, gate_up);
}

void Backend::cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                            const Tensor& dlogits, float grad_scale) {
  const OpScope scope(*this, "cross_entropy",
                      [&] { return op_args::cross_entropy(logits, dlogits); });
  const OpChecks check(*this, "cross_entropy");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(losses, d.rows, "losses");
  check.count(targets, d.rows, "targets");
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
  do_cross_entropy(losses, logits, targets, dlogits, grad_scale);
}

void Backend::cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                        const Tensor& targets, int64_t first_id) {
  const OpScope scope(*this, "cross_entropy_shard_stats",
                      [&] { return op_args::cross_entropy(logits, Tensor{}); });
  const OpChecks check(*this, "cross_entropy_shard_stats");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(stats, 2 * d.rows, "stats");
  check.count(targets, d.rows, "targets");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
  do_cross_entropy_shard_stats(stats, logits, targets, first_id);
}

void Backend::cross_entropy_shard(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                  const Tensor& all_stats, int64_t first_id, const Tensor& dlogits,
                                  float grad_scale) {
  const OpScope scope(*this, "cross_entropy_shard",
                      [&] { return op_args::cross_entropy(logits, dlogits); });
  const OpChecks check(*this, "cross_entropy_shard");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(losses, d.rows, "losses");
  check.count(targets, d.rows, "targets");
  check.placed(all_stats, "all_stats");
  check.that(all_stats.numel() > 0 && all_stats.numel() % (2 * d.rows) == 0,
             "all_stats {} is not (shards, {}, 2)", all_stats.shape.str(), d.rows);
  check.that(first_id >= 0, "first_id {} is negative", first_id);
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
  do_cross_entropy_shard(losses, logits, targets, all_stats, first_id, dlogits, grad_scale);
}

// ---- reductions and optimizer ----

void Backend::sum(const Tensor& out, const Tensor& x, bool accumulate) {
  const OpScope scope(*this, "sum", [&] { return op_args::reduction(x, accumulate); });
  const OpChecks check(*this, "sum");
  check.placed(x, "x");
  check.count(out, 1, "out");
  do_sum(out, x, accumulate);
}

void Backend::sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  const OpScope scope(*this, "sum_squares", [&] { return op_args::reduction(x, accumulate); });
  const OpChecks check(*this, "sum_squares");
  check.placed(x, "x");
  check.count(out, 1, "out");
  do_sum_squares(out, x, accumulate);
}

void Backend::adamw_step(const AdamWArgs& args) {
  const OpScope scope(*this, "adamw_step", [&] { return op_args::adamw(args); });
  const OpChecks check(*this, "adamw_step");
  check.placed(args.master, "master");
  const int64_t P = args.master.numel();
  check.count(args.grad, P, "grad");
  check.count(args.exp_avg, P, "exp_avg");
  check.count(args.exp_avg_sq, P, "exp_avg_sq");
  check.count(args.grad_norm_sq, 1, "grad_norm_sq");
  if (args.params.defined() && args.params.data != args.master.data)
    check.count(args.params, P, "params");
  check.that(args.step >= 1, "step {} is not 1-based", args.step);
  for (const ParamSegment& seg : args.segments)
    check.that(seg.offset >= 0 && seg.count >= 0 && seg.offset + seg.count <= P,
               "segment [{}, +{}) outside the {} parameters", seg.offset, seg.count, P);
  do_adamw_step(args);
}

}  // namespace tessera
