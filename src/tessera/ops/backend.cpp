// The op facade: checks, observer and timing once for every backend, then the backend's
// do_<op> (ops/backend.h).
#include "tessera/ops/backend.h"

#include <algorithm>
#include <tuple>

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

void Backend::fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  const OpScope scope(*this, "fp8_grouped_cast", [&] { return op_args::rows_cols(args.x); });
  const OpChecks check(*this, "fp8_grouped_cast");
  check.placed(args.x, "x");
  const MatrixDims d = matrix_dims(args.x);
  check.that((args.group_rows > 0) != args.offsets.defined(),
             "groups need either group_rows ({}) or offsets ({}), not both", args.group_rows,
             args.offsets.defined() ? args.offsets.shape.str() : "undefined");
  int64_t G = 0;
  if (args.group_rows > 0) {
    check.that(d.rows % args.group_rows == 0, "{} rows are not groups of {}", d.rows,
               args.group_rows);
    G = d.rows / args.group_rows;
  } else {
    check.placed(args.offsets, "offsets");
    G = args.offsets.numel() - 1;
    check.that(G >= 0, "no offsets");
  }
  for (const auto& [t, what] : {std::pair{&args.out, "out"}, std::pair{&args.out_t, "out_t"}}) {
    if (!t->defined()) continue;
    check.count(*t, d.rows * d.cols, what);
    check.that(is_fp8(t->dtype), "{} dtype {} is not fp8", what, dtype_name(t->dtype));
  }
  check.that(!args.out.defined() || !args.out_t.defined() || args.out.dtype == args.out_t.dtype,
             "out {} and out_t {} differ", dtype_name(args.out.dtype),
             dtype_name(args.out_t.dtype));
  for (const auto& [t, what, used] :
       {std::tuple{&args.scale, "scale", args.out.defined() || args.out_t.defined()},
        std::tuple{&args.amax, "amax", args.amax.defined()}}) {
    if (!used) continue;
    check.placed(*t, what);
    check.that(t->numel() == 1 || t->numel() == G, "{} has {} values for {} groups (1 or {})", what,
               t->numel(), G, G);
  }
  do_fp8_grouped_cast(args);
}

void Backend::matmul_fp8(const Fp8MatmulArgs& args) {
  const OpScope scope(*this, "matmul_fp8", [&] { return op_args::matmul_fp8(args); });
  const OpChecks check(*this, "matmul_fp8");
  check.placed(args.out, "out");
  check.placed(args.a, "a");
  check.placed(args.b, "b");
  const MatrixDims ad = matrix_dims(args.a), bd = matrix_dims(args.b);
  check.count(args.a_scale_inv, fp8_scale_count(args.a_scaling, ad.rows, ad.cols), "a_scale_inv");
  check.count(args.b_scale_inv, fp8_scale_count(args.b_scaling, bd.rows, bd.cols), "b_scale_inv");
  const bool blocks = args.a_scaling != Fp8Scaling::Tensor || args.b_scaling != Fp8Scaling::Tensor;
  if (blocks) {
    check.that(args.a_scaling != Fp8Scaling::Tensor && args.b_scaling != Fp8Scaling::Tensor,
               "block scales on one operand and a tensor scale on the other");
    check.that(
        !(args.a_scaling == Fp8Scaling::Block128x128 && args.b_scaling == Fp8Scaling::Block128x128),
        "128x128 blocks on both operands (block-scaled GEMMs take 1x128 x 1x128, 1x128 x "
        "128x128 or 128x128 x 1x128)");
    check.that(!args.fast_accum, "fast accumulation with block scales");
    check.that(supports(Capability::Fp8BlockScaling) || device().kind == DeviceKind::CPU,
               "block-scaled FP8 GEMMs on a backend without them ({})", description());
  }
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

void Backend::fp8_block_cast(const Fp8BlockCastArgs& args) {
  const OpScope scope(*this, "fp8_block_cast", [&] { return op_args::fp8_block_cast(args); });
  const OpChecks check(*this, "fp8_block_cast");
  check.placed(args.x, "x");
  const MatrixDims d = matrix_dims(args.x);
  check.that(args.scaling != Fp8Scaling::Tensor, "a tensor scale (use fp8_cast_transpose)");
  check.that(args.out.defined() || args.out_t.defined(), "neither out nor out_t is defined");
  for (const auto& [t, s, what, rows, k] :
       {std::tuple{&args.out, &args.out_scale_inv, "out", d.rows, d.cols},
        std::tuple{&args.out_t, &args.out_t_scale_inv, "out_t", d.cols, d.rows}}) {
    if (!t->defined()) continue;
    check.count(*t, d.rows * d.cols, what);
    check.that(is_fp8(t->dtype), "{} dtype {} is not fp8", what, dtype_name(t->dtype));
    check.count(*s, fp8_scale_count(args.scaling, rows, k),
                std::string(what) == "out" ? "out_scale_inv" : "out_t_scale_inv");
  }
  check.that(!args.out.defined() || !args.out_t.defined() || args.out.dtype == args.out_t.dtype,
             "out {} and out_t {} differ", dtype_name(args.out.dtype),
             dtype_name(args.out_t.dtype));
  if (args.nonfinite.defined()) check.count(args.nonfinite, 1, "nonfinite");
  do_fp8_block_cast(args);
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
  check.count(out, s.tokens() * s.out_width(), "out");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_forward(out, lse, qkv, s);
}

void Backend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                 const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  const OpScope scope(*this, "attention_backward",
                      [&] { return op_args::attention(s, qkv.dtype); });
  const OpChecks check(*this, "attention_backward");
  check.attention_shape(s);
  const int64_t width = s.qkv_width(), heads_width = s.out_width();
  check.count(qkv, s.tokens() * width, "qkv");
  check.count(dqkv, s.tokens() * width, "dqkv");
  check.count(out, s.tokens() * heads_width, "out");
  check.count(dout, s.tokens() * heads_width, "dout");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
  do_attention_backward(dqkv, dout, out, lse, qkv, s);
}

namespace {

// The gathered attention's shape, positions (segments, seq) and segment; returns the segments.
int64_t check_gathered(const OpChecks& check, const Tensor& positions, int64_t segment,
                       const AttentionShape& s) {
  check.attention_shape(s);
  // Context parallelism runs grouped-query attention only (multi-latent attention refuses it).
  check.that(s.v_dim() == s.head_dim,
             "value heads of {} with heads of {}: the gathered attention takes equal head dims",
             s.v_dim(), s.head_dim);
  check.placed(positions, "positions");
  const int64_t segments = s.seq > 0 ? positions.numel() / s.seq : 0;
  check.that(segments >= 1 && positions.numel() == segments * s.seq,
             "positions {} are not (segments, {})", positions.shape.str(), s.seq);
  check.that(segment >= 0 && segment < segments, "segment {} of {}", segment, segments);
  return segments;
}

}  // namespace

void Backend::attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                         const Tensor& qkv_all, const Tensor& positions,
                                         int64_t segment, const AttentionShape& s) {
  const OpScope scope(*this, "attention_gathered_forward",
                      [&] { return op_args::attention(s, qkv_all.dtype); });
  const OpChecks check(*this, "attention_gathered_forward");
  const int64_t segments = check_gathered(check, positions, segment, s);
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
  const int64_t segments = check_gathered(check, positions, segment, s);
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
  check.count(q, s.batch * s.heads * s.head_dim, "q");
  check.count(out, s.batch * s.out_width(), "out");
  check.count(kv, s.batch * s.seq * s.kv_heads * (s.head_dim + s.v_dim()), "kv");
  do_attention_decode(out, q, kv, pos, s);
}

namespace {

// The tensors of a multi-latent attention packing (MlaQkvArgs) and their column windows.
void check_mla_qkv(const OpChecks& check, const MlaQkvArgs& a) {
  const AttentionShape& s = a.s;
  check.attention_shape(s);
  check.that(s.kv_heads == s.heads,
             "multi-latent attention has a key head per query head, "
             "got {} and {}",
             s.heads, s.kv_heads);
  check.that(a.rope_dim > 0 && a.rope_dim % 2 == 0 && a.rope_dim < s.head_dim,
             "rope dim {} must be even and below head_dim {}", a.rope_dim, s.head_dim);
  const int64_t N = s.tokens(), H = s.heads, Dn = s.head_dim - a.rope_dim;
  check.count(a.qkv, N * s.qkv_width(), "qkv");
  check.count(a.kv, N * H * (Dn + s.v_dim()), "kv");
  for (const auto& [t, col, cols, what] : {std::tuple{&a.q, a.q_col, H * s.head_dim, "q"},
                                           std::tuple{&a.k_rope, a.k_col, a.rope_dim, "k_rope"}}) {
    check.placed(*t, what);
    const MatrixDims d = matrix_dims(*t);
    check.that(d.rows == N && col >= 0 && col + cols <= d.cols,
               "{} {} has no columns [{}, {}) for {} tokens", what, t->shape.str(), col, col + cols,
               N);
  }
  check.dtype(a.freqs, DType::F32, "freqs");
  const MatrixDims f = matrix_dims(a.freqs);
  check.that(f.cols == a.rope_dim && f.rows >= s.seq, "freqs {} must be (T >= {}, rope dim {})",
             a.freqs.shape.str(), s.seq, a.rope_dim);
}

}  // namespace

void Backend::mla_qkv_forward(const MlaQkvArgs& a) {
  const OpScope scope(*this, "mla_qkv_forward", [&] { return op_args::rope(a.s, a.qkv.dtype); });
  check_mla_qkv(OpChecks(*this, "mla_qkv_forward"), a);
  do_mla_qkv_forward(a);
}

void Backend::mla_qkv_backward(const MlaQkvArgs& g) {
  const OpScope scope(*this, "mla_qkv_backward", [&] { return op_args::rope(g.s, g.qkv.dtype); });
  check_mla_qkv(OpChecks(*this, "mla_qkv_backward"), g);
  do_mla_qkv_backward(g);
}

void Backend::copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                           int64_t cols) {
  const OpScope scope(*this, "copy_columns", [&] { return op_args::rows_cols(src); });
  const OpChecks check(*this, "copy_columns");
  check.placed(dst, "dst");
  check.placed(src, "src");
  check.that(dst.dtype == src.dtype, "dst is {}, src {}", dtype_name(dst.dtype),
             dtype_name(src.dtype));
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  check.that(d.rows == r.rows, "dst {} and src {} differ in rows", dst.shape.str(),
             src.shape.str());
  check.that(cols >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + cols <= d.cols &&
                 src_col + cols <= r.cols,
             "columns [{}, {}) of dst {} or [{}, {}) of src {} out of range", dst_col,
             dst_col + cols, dst.shape.str(), src_col, src_col + cols, src.shape.str());
  do_copy_columns(dst, dst_col, src, src_col, cols);
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

void Backend::qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                              const Tensor& q_weight, const Tensor& k_weight,
                              const AttentionShape& s, float eps) {
  const OpScope scope(*this, "qk_norm_forward", [&] { return op_args::rope(s, qkv.dtype); });
  const OpChecks check(*this, "qk_norm_forward");
  check.attention_shape(s);
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(out, s.tokens() * s.qkv_width(), "out");
  check.count(rstd, s.tokens() * (s.heads + s.kv_heads), "rstd");
  check.count(q_weight, s.head_dim, "q_weight");
  check.count(k_weight, s.head_dim, "k_weight");
  do_qk_norm_forward(out, rstd, qkv, q_weight, k_weight, s, eps);
}

void Backend::qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight, const Tensor& dk_weight,
                               const Tensor& dout, const Tensor& qkv, const Tensor& q_weight,
                               const Tensor& k_weight, const Tensor& rstd,
                               const AttentionShape& s) {
  const OpScope scope(*this, "qk_norm_backward", [&] { return op_args::rope(s, qkv.dtype); });
  const OpChecks check(*this, "qk_norm_backward");
  check.attention_shape(s);
  const int64_t n = s.tokens() * s.qkv_width();
  check.count(qkv, n, "qkv");
  check.count(dqkv, n, "dqkv");
  check.count(dout, n, "dout");
  check.count(rstd, s.tokens() * (s.heads + s.kv_heads), "rstd");
  for (const auto& [t, what] :
       {std::pair{&q_weight, "q_weight"}, std::pair{&k_weight, "k_weight"},
        std::pair{&dq_weight, "dq_weight"}, std::pair{&dk_weight, "dk_weight"}})
    check.count(*t, s.head_dim, what);
  do_qk_norm_backward(dqkv, dq_weight, dk_weight, dout, qkv, q_weight, k_weight, rstd, s);
}

// ---- mixture of experts ----

namespace {

// A routing that moe ops can run: topk within the experts, groups that divide them and can
// supply the top-k.
void check_routing(const OpChecks& check, const MoeRouting& r, int64_t experts) {
  check.that(r.experts == experts, "routing for {} experts, logits have {}", r.experts, experts);
  check.that(r.topk >= 1 && r.topk <= r.experts, "topk {} outside [1, {}]", r.topk, r.experts);
  if (r.num_groups > 0) {
    check.that(r.experts % r.num_groups == 0 && r.group_topk >= 1 && r.group_topk <= r.num_groups &&
                   r.group_topk <= r.topk && r.topk <= r.group_topk * (r.experts / r.num_groups),
               "{} groups choosing {} cannot route {} experts top-{}", r.num_groups, r.group_topk,
               r.experts, r.topk);
  }
}

// (N, K) int32 of routing slots, as indices, rows and weights are.
void check_slots(const OpChecks& check, const Tensor& t, int64_t N, int64_t K, const char* what) {
  check.placed(t, what);
  const MatrixDims d = matrix_dims(t);
  check.that(d.rows == N && d.cols == K, "{} {} is not ({}, {})", what, t.shape.str(), N, K);
}

// The groups of a grouped GEMM (offsets, host offsets) and the weight each multiplies.
void check_groups(const OpChecks& check, const Tensor& offsets,
                  std::span<const int32_t> host_offsets, std::span<const int32_t> group_weights,
                  int64_t weights, int64_t rows) {
  check.placed(offsets, "offsets");
  const int64_t groups = offsets.numel() - 1;
  check.that(groups >= 0, "no offsets");
  if (group_weights.empty()) {
    check.that(groups == weights, "{} groups for {} weights without group_weights", groups,
               weights);
  } else {
    check.that(static_cast<int64_t>(group_weights.size()) == groups,
               "{} group weights for {} groups", group_weights.size(), groups);
    for (int32_t w : group_weights)
      check.that(w >= 0 && w < weights, "group weight {} outside the {} weights", w, weights);
  }
  check.that(static_cast<int64_t>(host_offsets.size()) == groups + 1,
             "{} host offsets for {} groups", host_offsets.size(), groups);
  check.that(host_offsets[0] == 0 && host_offsets.back() <= rows,
             "host offsets [{}, {}] outside the {} rows", host_offsets[0], host_offsets.back(),
             rows);
  for (int64_t g = 0; g < groups; ++g)
    check.that(host_offsets[g] <= host_offsets[g + 1], "host offsets decrease at group {}", g);
}

}  // namespace

void Backend::moe_router_forward(const Tensor& indices, const Tensor& weights, const Tensor& logits,
                                 const Tensor& bias, const MoeRouting& r) {
  const OpScope scope(*this, "moe_router_forward", [&] { return op_args::moe_routing(logits, r); });
  const OpChecks check(*this, "moe_router_forward");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check_routing(check, r, d.cols);
  check_slots(check, indices, d.rows, r.topk, "indices");
  check_slots(check, weights, d.rows, r.topk, "weights");
  if (bias.defined()) {
    check.count(bias, d.cols, "bias");
    check.that(r.sigmoid, "an expert bias needs sigmoid scores");
  }
  do_moe_router_forward(indices, weights, logits, bias, r);
}

void Backend::moe_router_backward(const Tensor& dlogits, const Tensor& dweights,
                                  const Tensor& logits, const Tensor& indices,
                                  const MoeRouting& r) {
  const OpScope scope(*this, "moe_router_backward",
                      [&] { return op_args::moe_routing(logits, r); });
  const OpChecks check(*this, "moe_router_backward");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check_routing(check, r, d.cols);
  check.count(dlogits, d.rows * d.cols, "dlogits");
  check_slots(check, dweights, d.rows, r.topk, "dweights");
  check_slots(check, indices, d.rows, r.topk, "indices");
  do_moe_router_backward(dlogits, dweights, logits, indices, r);
}

void Backend::moe_aux_loss(const MoeAuxLossArgs& a) {
  const OpScope scope(*this, "moe_aux_loss",
                      [&] { return op_args::moe_routing(a.logits, a.routing); });
  const OpChecks check(*this, "moe_aux_loss");
  check.placed(a.logits, "logits");
  const MatrixDims d = matrix_dims(a.logits);
  check_routing(check, a.routing, d.cols);
  check_slots(check, a.indices, d.rows, a.routing.topk, "indices");
  check.that(a.seq >= 0 && (a.seq == 0 || d.rows % a.seq == 0), "{} tokens are not sequences of {}",
             d.rows, a.seq);
  if (a.loss.defined()) check.count(a.loss, 1, "loss");
  if (a.dlogits.defined()) check.count(a.dlogits, d.rows * d.cols, "dlogits");
  do_moe_aux_loss(a);
}

void Backend::moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                         float grad_scale) {
  const OpScope scope(*this, "moe_z_loss", [&] { return op_args::rows_cols(logits); });
  const OpChecks check(*this, "moe_z_loss");
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  if (loss.defined()) check.count(loss, 1, "loss");
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
  do_moe_z_loss(loss, dlogits, logits, grad_scale);
}

void Backend::moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  const OpScope scope(*this, "moe_expert_counts", [&] { return op_args::rows_cols(indices); });
  const OpChecks check(*this, "moe_expert_counts");
  check.placed(counts, "counts");
  check.placed(indices, "indices");
  do_moe_expert_counts(counts, indices);
}

void Backend::moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) {
  const OpScope scope(*this, "moe_expert_bias_update", [&] { return op_args::elements(bias); });
  const OpChecks check(*this, "moe_expert_bias_update");
  check.placed(bias, "bias");
  check.count(counts, bias.numel(), "counts");
  do_moe_expert_bias_update(bias, counts, rate);
}

void Backend::moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                          const Tensor& x, const Tensor& indices, int64_t align,
                          const MoeCapacity& capacity) {
  const OpScope scope(*this, "moe_permute", [&] { return op_args::moe_permute(x, indices, xp); });
  const OpChecks check(*this, "moe_permute");
  check.placed(x, "x");
  check.placed(indices, "indices");
  check.placed(offsets, "offsets");
  const MatrixDims xd = matrix_dims(x), id = matrix_dims(indices), pd = matrix_dims(xp);
  const int64_t N = xd.rows, C = xd.cols, K = id.cols, E = offsets.numel() - 1;
  check.that(id.rows == N, "indices {} and x {} differ in tokens", indices.shape.str(),
             x.shape.str());
  check.that(E >= 1 && align >= 1, "{} experts, alignment {}", E, align);
  check.placed(xp, "xp");
  check.that(capacity.capacity >= 0, "capacity {}", capacity.capacity);
  const int64_t kept = capacity.capacity > 0 ? std::min(N * K, E * capacity.capacity) : N * K;
  check.that(pd.cols == C && pd.rows >= kept + E * (align - 1),
             "xp {} cannot hold {} of {} tokens x {} copies in {} groups aligned to {} rows of {}",
             xp.shape.str(), kept, N, K, E, align, C);
  check_slots(check, rows, N, K, "rows");
  if (capacity.dropped.defined()) {
    check.that(capacity.capacity > 0, "a dropped count without a capacity");
    check.count(capacity.dropped, 1, "capacity.dropped");
  }
  if (capacity.capacity > 0 && !capacity.by_position) {
    check.placed(capacity.weights, "capacity.weights");
    check_slots(check, capacity.weights, N, K, "capacity.weights");
  }
  do_moe_permute(xp, rows, offsets, x, indices, align, capacity);
}

void Backend::moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) {
  const OpScope scope(*this, "moe_permute_backward",
                      [&] { return op_args::moe_permute(dx, rows, dxp); });
  const OpChecks check(*this, "moe_permute_backward");
  check.placed(dx, "dx");
  check.placed(dxp, "dxp");
  const MatrixDims xd = matrix_dims(dx), pd = matrix_dims(dxp);
  check.that(pd.cols == xd.cols, "dxp {} and dx {} differ in width", dxp.shape.str(),
             dx.shape.str());
  check_slots(check, rows, xd.rows, matrix_dims(rows).cols, "rows");
  do_moe_permute_backward(dx, dxp, rows);
}

void Backend::moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                            const Tensor& weights) {
  const OpScope scope(*this, "moe_unpermute", [&] { return op_args::moe_permute(out, rows, yp); });
  const OpChecks check(*this, "moe_unpermute");
  check.placed(out, "out");
  check.placed(yp, "yp");
  const MatrixDims od = matrix_dims(out), pd = matrix_dims(yp);
  const int64_t K = matrix_dims(rows).cols;
  check.that(pd.cols == od.cols, "yp {} and out {} differ in width", yp.shape.str(),
             out.shape.str());
  check_slots(check, rows, od.rows, K, "rows");
  check_slots(check, weights, od.rows, K, "weights");
  do_moe_unpermute(out, yp, rows, weights);
}

void Backend::moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights, const Tensor& dout,
                                     const Tensor& yp, const Tensor& rows, const Tensor& weights) {
  const OpScope scope(*this, "moe_unpermute_backward",
                      [&] { return op_args::moe_permute(dout, rows, yp); });
  const OpChecks check(*this, "moe_unpermute_backward");
  check.placed(dout, "dout");
  check.placed(yp, "yp");
  const MatrixDims od = matrix_dims(dout), pd = matrix_dims(yp);
  const int64_t K = matrix_dims(rows).cols;
  check.that(pd.cols == od.cols, "yp {} and dout {} differ in width", yp.shape.str(),
             dout.shape.str());
  check.count(dyp, pd.rows * pd.cols, "dyp");
  check_slots(check, rows, od.rows, K, "rows");
  check_slots(check, weights, od.rows, K, "weights");
  check_slots(check, dweights, od.rows, K, "dweights");
  do_moe_unpermute_backward(dyp, dweights, dout, yp, rows, weights);
}

void Backend::grouped_matmul(const GroupedMatmulArgs& a) {
  const OpScope scope(*this, "grouped_matmul", [&] { return op_args::grouped_matmul(a); });
  const OpChecks check(*this, "grouped_matmul");
  check.placed(a.out, "out");
  check.placed(a.a, "a");
  check.placed(a.b, "b");
  check.that(a.b.shape.rank() == 3, "b {} is not (groups, rows, cols)", a.b.shape.str());
  const MatrixDims o = matrix_dims(a.out), ad = matrix_dims(a.a);
  const int64_t W = a.b.dim(0), N = a.trans_b ? a.b.dim(1) : a.b.dim(2),
                K = a.trans_b ? a.b.dim(2) : a.b.dim(1);
  check.that(o.rows == ad.rows && ad.cols == K && o.cols == N,
             "a {} and b {} (trans_b={}) do not give out {}", a.a.shape.str(), a.b.shape.str(),
             a.trans_b, a.out.shape.str());
  check.that(a.out.data != a.a.data && a.out.data != a.b.data, "out aliases an input");
  check_groups(check, a.offsets, a.host_offsets, a.group_weights, W, o.rows);
  do_grouped_matmul(a);
}

void Backend::grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  const OpScope scope(*this, "grouped_matmul_wgrad",
                      [&] { return op_args::grouped_matmul_wgrad(a); });
  const OpChecks check(*this, "grouped_matmul_wgrad");
  check.placed(a.out, "out");
  check.placed(a.a, "a");
  check.placed(a.b, "b");
  check.that(a.out.shape.rank() == 3, "out {} is not (groups, rows, cols)", a.out.shape.str());
  const MatrixDims ad = matrix_dims(a.a), bd = matrix_dims(a.b);
  const int64_t W = a.out.dim(0);
  check.that(ad.rows == bd.rows && a.out.dim(1) == ad.cols && a.out.dim(2) == bd.cols,
             "a {} and b {} do not give out {} per group", a.a.shape.str(), a.b.shape.str(),
             a.out.shape.str());
  check_groups(check, a.offsets, a.host_offsets, a.group_weights, W, ad.rows);
  do_grouped_matmul_wgrad(a);
}

namespace {

// The FP8 operand rules matmul_fp8 states, for the grouped GEMMs.
void check_fp8_operands(const OpChecks& check, const Tensor& a, const Tensor& b,
                        const Tensor& a_scale_inv, const Tensor& b_scale_inv, int64_t b_scales) {
  check.that(is_fp8(a.dtype) && is_fp8(b.dtype), "a {} and b {} must be fp8", dtype_name(a.dtype),
             dtype_name(b.dtype));
  check.that(!(a.dtype == DType::E5M2 && b.dtype == DType::E5M2),
             "e5m2 x e5m2 is not an FP8 GEMM tensor cores have");
  check.count(a_scale_inv, 1, "a_scale_inv");
  check.count(b_scale_inv, b_scales, "b_scale_inv");
}

}  // namespace

void Backend::grouped_matmul_fp8(const GroupedFp8MatmulArgs& a) {
  const OpScope scope(*this, "grouped_matmul_fp8", [&] { return op_args::grouped_matmul_fp8(a); });
  const OpChecks check(*this, "grouped_matmul_fp8");
  check.placed(a.out, "out");
  check.placed(a.a, "a");
  check.placed(a.b, "b");
  check.that(a.b.shape.rank() == 3, "b {} is not (weights, N, K)", a.b.shape.str());
  const MatrixDims o = matrix_dims(a.out), ad = matrix_dims(a.a);
  const int64_t W = a.b.dim(0), N = a.b.dim(1), K = a.b.dim(2);
  check.that(o.rows == ad.rows && ad.cols == K && o.cols == N,
             "a {} and b {} do not give out {} (out = a @ b[w]^T)", a.a.shape.str(),
             a.b.shape.str(), a.out.shape.str());
  check_fp8_operands(check, a.a, a.b, a.a_scale_inv, a.b_scale_inv, W);
  check_groups(check, a.offsets, a.host_offsets, a.group_weights, W, o.rows);
  do_grouped_matmul_fp8(a);
}

void Backend::grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& a) {
  const OpScope scope(*this, "grouped_matmul_fp8_wgrad",
                      [&] { return op_args::grouped_matmul_fp8_wgrad(a); });
  const OpChecks check(*this, "grouped_matmul_fp8_wgrad");
  check.placed(a.out, "out");
  check.placed(a.a_t, "a_t");
  check.placed(a.b_t, "b_t");
  check.that(a.out.shape.rank() == 3, "out {} is not (weights, M, N)", a.out.shape.str());
  const int64_t W = a.out.dim(0), M = a.out.dim(1), N = a.out.dim(2);
  check.that(M > 0 && N > 0 && a.a_t.numel() % M == 0 && a.b_t.numel() % N == 0 &&
                 a.a_t.numel() / M == a.b_t.numel() / N,
             "a_t ({} values) and b_t ({}) are not the same rows of {} and {} columns",
             a.a_t.numel(), a.b_t.numel(), M, N);
  check_fp8_operands(check, a.a_t, a.b_t, a.a_scale_inv, a.b_scale_inv, 1);
  check_groups(check, a.offsets, a.host_offsets, a.group_weights, W, M > 0 ? a.a_t.numel() / M : 0);
  do_grouped_matmul_fp8_wgrad(a);
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
  check.that(args.master.defined() || args.params.defined(),
             "neither master nor params is defined: nothing to update");
  const Tensor& updated = args.master.defined() ? args.master : args.params;
  check.placed(updated, args.master.defined() ? "master" : "params");
  const int64_t P = updated.numel();
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
