// What each op of the table (ops/op_table.inc) checks of its arguments' placement and shapes,
// what it reports to the profiler and what one call costs; the facade (ops/backend.cpp) runs
// them around the backend's do_<op>. Shapes here are those the table's comments state; a
// failed check is a bug in the caller (InternalError naming the backend, op and argument).
#include "tessera/ops/op_defs.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "tessera/core/fp8.h"

namespace tessera::op_defs {
namespace {

double elements(const Tensor& t) {
  return static_cast<double>(t.numel());
}
// Bytes of a tensor argument; 0 for an undefined (optional) one.
double bytes_of(const Tensor& t) {
  return t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
}

// (query, key) pairs attention computes over T queries and S keys (S >= T, the queries the
// last T positions when causal), causal and within a window (0: none).
double visible_pairs(int64_t T, int64_t S, bool causal, int64_t window) {
  double pairs = 0;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t position = S - T + i;
    int64_t first = 0, last = causal ? position : S - 1;
    if (window > 0) first = std::max<int64_t>(0, position - window + 1);
    if (window > 0 && !causal) last = std::min<int64_t>(S - 1, position + window - 1);
    pairs += static_cast<double>(std::max<int64_t>(0, last - first + 1));
  }
  return pairs;
}

// (query, key) pairs an attention op computes over its whole batch.
double attention_pairs(const AttentionShape& s) {
  if (s.document_starts.defined() && s.document_pairs > 0) return s.document_pairs;
  return static_cast<double>(s.batch) * visible_pairs(s.seq, s.seq, s.causal, s.window);
}

// The rotation of every query and key head: a multiply-add pair per element, in place.
OpCost rope_cost(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  const double n = static_cast<double>(s.tokens()) * (s.heads + s.kv_heads) * s.head_dim;
  return {3 * n, 2 * n * dtype_size(qkv.dtype) + bytes_of(freqs)};
}

OpCost mla_cost(const MlaQkvArgs& a) {
  const double rotated = static_cast<double>(a.s.tokens()) * (a.s.heads + 1) * a.rope_dim;
  return {3 * rotated, 2 * bytes_of(a.qkv)};
}

// Whether an op writing a tensor's FP8 codes (the *_cast ops) takes one of their layouts.
enum class CodeLayout { Absent, Optional, Required };

// The codes an op writes of a tensor of `elements` elements as the FP8 cast would: codes.out
// (row-major) and codes.out_t (transposed) as `rows` and `transposed` say, at least one, of one
// dtype; one scale; an amax where the op records one (`amax`: optional, else absent, the
// tensor's amax recorded before); codes.x undefined (the codes are the op's own result's).
void check_codes(const OpChecks& check, int64_t elements, const Fp8CastArgs& codes,
                 CodeLayout rows, CodeLayout transposed, bool amax = true) {
  check.that(!codes.x.defined(), "codes.x must be undefined (the codes are of the op's result)");
  for (const auto& [t, layout, name] : {std::tuple{&codes.out, rows, "codes.out"},
                                        std::tuple{&codes.out_t, transposed, "codes.out_t"}}) {
    if (layout == CodeLayout::Absent) {
      check.that(!t->defined(), "{} must be undefined (a layout this op does not write)", name);
    } else if (layout == CodeLayout::Required || t->defined()) {
      check.count(*t, elements, name);
    }
  }
  check.that(codes.out.defined() || codes.out_t.defined(), "neither codes.out nor codes.out_t");
  check.that(!codes.out.defined() || !codes.out_t.defined() || codes.out.dtype == codes.out_t.dtype,
             "codes.out {} and codes.out_t {} differ", dtype_name(codes.out.dtype),
             dtype_name(codes.out_t.dtype));
  check.count(codes.scale, 1, "codes.scale");
  if (!amax) {
    check.that(!codes.amax.defined(), "codes.amax must be undefined (recorded before)");
  } else if (codes.amax.defined()) {
    check.count(codes.amax, 1, "codes.amax");
  }
}

// A norm's operands: x (N, C), rstd (N), weight (C); x's dims.
MatrixDims check_norm_operands(const OpChecks& check, const Tensor& x, const Tensor& rstd,
                               const Tensor& weight) {
  check.placed(x, "x");
  const MatrixDims d = matrix_dims(x);
  check.count(rstd, d.rows, "rstd");
  check.count(weight, d.cols, "weight");
  return d;
}

// The SwiGLU's input gate_up (N, 2F); the elements of its output, N x F.
int64_t check_gate_up(const OpChecks& check, const Tensor& gate_up) {
  check.placed(gate_up, "gate_up");
  const MatrixDims d = matrix_dims(gate_up);
  check.that(d.cols % 2 == 0, "gate_up {} has an odd width", gate_up.shape.str());
  return d.rows * d.cols / 2;
}

// The epilogue operands shared by both GEMMs: c (read with beta; undefined or out itself
// means out) and a bias broadcast over rows.
void check_epilogue(const OpChecks& check, const Tensor& out, const Tensor& c, const Tensor& bias,
                    int64_t M, int64_t N) {
  if (c.defined() && c.data != out.data) check.count(c, M * N, "c");
  if (bias.defined()) check.count(bias, N, "bias");
}

// The gathered attention's shape, positions (segments, seq) and segment; returns the segments.
int64_t check_gathered(const OpChecks& check, const Tensor& positions, int64_t segment,
                       const AttentionShape& s) {
  AttentionShape local = s;  // the document starts are the whole sequence's, checked below
  local.document_starts = Tensor{};
  check.attention_shape(local);
  // Context parallelism runs grouped-query attention only (multi-latent attention refuses it).
  check.that(s.v_dim() == s.head_dim,
             "value heads of {} with heads of {}: the gathered attention takes equal head dims",
             s.v_dim(), s.head_dim);
  check.placed(positions, "positions");
  const int64_t segments = s.seq > 0 ? positions.numel() / s.seq : 0;
  check.that(segments >= 1 && positions.numel() == segments * s.seq,
             "positions {} are not (segments, {})", positions.shape.str(), s.seq);
  check.that(segment >= 0 && segment < segments, "segment {} of {}", segment, segments);
  if (s.document_starts.defined()) {
    check.that(s.causal, "document starts with full (non-causal) attention");
    check.count(s.document_starts, s.batch * segments * s.seq, "document_starts");
    check.dtype(s.document_starts, DType::I32, "document_starts");
  }
  return segments;
}

// The (query, key) pairs one segment's queries see over the batch: with documents the caller's
// count; else, as Megatron's balanced chunks give every segment, half of its queries x the
// whole sequence's keys if causal (on average a query sees half of them), all if not.
double gathered_pairs(const Tensor& positions, const AttentionShape& s) {
  if (s.document_starts.defined() && s.document_pairs > 0) return s.document_pairs;
  const double segments = static_cast<double>(positions.numel()) / s.seq;
  const double pairs = s.causal ? s.seq * s.seq * segments / 2 : s.seq * s.seq * segments;
  return s.batch * pairs;
}

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

// The rows in groups where the host knows them; else every row of a (the groups' padding
// and the rows past them too: an upper bound, as op_args::grouped_matmul's M).
double grouped_rows(const Tensor& a, std::span<const int32_t> host_offsets) {
  return host_offsets.empty() ? static_cast<double>(matrix_dims(a).rows) : host_offsets.back();
}

// The groups of a grouped GEMM (offsets, host offsets when given) and the weight each
// multiplies.
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
  // The device's offsets are the caller's to keep in range: reading them here would wait.
  if (host_offsets.empty()) return;
  check.that(static_cast<int64_t>(host_offsets.size()) == groups + 1,
             "{} host offsets for {} groups", host_offsets.size(), groups);
  check.that(host_offsets[0] == 0 && host_offsets.back() <= rows,
             "host offsets [{}, {}] outside the {} rows", host_offsets[0], host_offsets.back(),
             rows);
  for (int64_t g = 0; g < groups; ++g)
    check.that(host_offsets[g] <= host_offsets[g + 1], "host offsets decrease at group {}", g);
}

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

// ---- fill

void check_fill(const OpChecks& check, const Tensor& dst, float value) {
  check.placed(dst, "dst");
}

OpArgs describe_fill(const Tensor& dst, float value) {
  return op_args::elements(dst);
}

OpCost cost_fill(const Tensor& dst, float value) {
  return {0, bytes_of(dst)};
}

// ---- convert

void check_convert(const OpChecks& check, const Tensor& dst, const Tensor& src) {
  check.placed(src, "src");
  check.count(dst, src.numel(), "dst");
}

OpArgs describe_convert(const Tensor& dst, const Tensor& src) {
  return op_args::convert(dst, src);
}

OpCost cost_convert(const Tensor& dst, const Tensor& src) {
  return {elements(src), bytes_of(dst) + bytes_of(src)};
}

// ---- init_normal

void check_init_normal(const OpChecks& check, const Tensor& dst, uint64_t seed,
                       uint64_t first_index, float mean, float std) {
  check.placed(dst, "dst");
}

OpArgs describe_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                            float std) {
  return op_args::elements(dst);
}

OpCost cost_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index, float mean,
                        float std) {
  // Box-Muller on a counter-based generator: some 20 operations an element.
  return {20 * elements(dst), bytes_of(dst)};
}

// ---- matmul

void check_matmul(const OpChecks& check, const MatmulArgs& args) {
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
}

OpArgs describe_matmul(const MatmulArgs& args) {
  return op_args::matmul(args);
}

OpCost cost_matmul(const MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a);
  const double M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;
  const bool reads_c = args.beta != 0.0f;
  return {2 * M * N * K + (reads_c ? 2 * M * N : 0) + (args.bias.defined() ? M * N : 0),
          bytes_of(args.a) + bytes_of(args.b) + bytes_of(args.out) +
              (reads_c ? bytes_of(args.c.defined() ? args.c : args.out) : 0) + bytes_of(args.bias)};
}

// ---- bias_backward

void check_bias_backward(const OpChecks& check, const Tensor& dbias, const Tensor& dout) {
  check.placed(dout, "dout");
  check.count(dbias, matrix_dims(dout).cols, "dbias");
}

OpArgs describe_bias_backward(const Tensor& dbias, const Tensor& dout) {
  return op_args::rows_cols(dout);
}

OpCost cost_bias_backward(const Tensor& dbias, const Tensor& dout) {
  return {elements(dout), bytes_of(dout) + 2 * bytes_of(dbias)};
}

// ---- fp8_cast_transpose

void check_fp8_cast_transpose(const OpChecks& check, const Fp8CastArgs& args) {
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
}

OpArgs describe_fp8_cast_transpose(const Fp8CastArgs& args) {
  return op_args::rows_cols(args.x);
}

OpCost cost_fp8_cast_transpose(const Fp8CastArgs& args) {
  // Scale, round and the amax: two operations an element.
  return {2 * elements(args.x), bytes_of(args.x) + bytes_of(args.out) + bytes_of(args.out_t)};
}

// ---- fp8_grouped_cast

void check_fp8_grouped_cast(const OpChecks& check, const Fp8GroupedCastArgs& args) {
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
}

OpArgs describe_fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  return op_args::rows_cols(args.x);
}

OpCost cost_fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  return {2 * elements(args.x), bytes_of(args.x) + bytes_of(args.out) + bytes_of(args.out_t)};
}

// ---- matmul_fp8

void check_matmul_fp8(const OpChecks& check, const Fp8MatmulArgs& args) {
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
    // The CPU emulates them; other backends need them in hardware.
    if (!check.backend().supports(Capability::Fp8BlockScaling) &&
        check.backend().device().kind != DeviceKind::CPU)
      check.fail("block-scaled FP8 GEMMs on a backend without them (" +
                 check.backend().description() + ")");
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
}

OpArgs describe_matmul_fp8(const Fp8MatmulArgs& args) {
  return op_args::matmul_fp8(args);
}

OpCost cost_matmul_fp8(const Fp8MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a);
  const double M = o.rows, N = o.cols, K = a.cols;
  const bool reads_c = args.beta != 0.0f;
  return {2 * M * N * K + (reads_c ? 2 * M * N : 0),
          bytes_of(args.a) + bytes_of(args.b) + bytes_of(args.out) +
              (reads_c ? bytes_of(args.c.defined() ? args.c : args.out) : 0) + bytes_of(args.bias)};
}

// ---- fp8_update_scales

void check_fp8_update_scales(const OpChecks& check, const Fp8ScaleUpdateArgs& args) {
  check.placed(args.amax_history, "amax_history");
  const int64_t S = matrix_dims(args.amax_history).cols;
  check.count(args.scale, S, "scale");
  check.count(args.scale_inv, S, "scale_inv");
  if (args.nonfinite.defined()) check.count(args.nonfinite, 1, "nonfinite");
}

OpArgs describe_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  return op_args::elements(args.amax_history);
}

OpCost cost_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  return {2 * elements(args.amax_history),
          2 * bytes_of(args.amax_history) + 2 * bytes_of(args.scale) + bytes_of(args.scale_inv)};
}

// ---- fp8_block_cast

void check_fp8_block_cast(const OpChecks& check, const Fp8BlockCastArgs& args) {
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
}

OpArgs describe_fp8_block_cast(const Fp8BlockCastArgs& args) {
  return op_args::fp8_block_cast(args);
}

OpCost cost_fp8_block_cast(const Fp8BlockCastArgs& args) {
  return {2 * elements(args.x), bytes_of(args.x) + bytes_of(args.out) + bytes_of(args.out_t) +
                                    bytes_of(args.out_scale_inv) + bytes_of(args.out_t_scale_inv)};
}

// ---- embedding_forward

void check_embedding_forward(const OpChecks& check, const Tensor& out, const Tensor& tokens,
                             const Tensor& table) {
  check.placed(tokens, "tokens");
  check.placed(table, "table");
  check.count(out, tokens.numel() * matrix_dims(table).cols, "out");
}

OpArgs describe_embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  return op_args::embedding(tokens, table, table.dtype);
}

OpCost cost_embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  return {0, 2 * bytes_of(out) + bytes_of(tokens)};
}

// ---- embedding_backward

void check_embedding_backward(const OpChecks& check, const Tensor& dtable, const Tensor& dout,
                              const Tensor& tokens) {
  check.placed(tokens, "tokens");
  check.placed(dtable, "dtable");
  check.count(dout, tokens.numel() * matrix_dims(dtable).cols, "dout");
}

OpArgs describe_embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  return op_args::embedding(tokens, dtable, dout.dtype);
}

OpCost cost_embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  // Each token's row of the table is read and written back.
  return {elements(dout),
          bytes_of(dout) + 2 * elements(dout) * dtype_size(dtable.dtype) + bytes_of(tokens)};
}

// ---- embedding_shard_forward

void check_embedding_shard_forward(const OpChecks& check, const Tensor& out, const Tensor& tokens,
                                   const Tensor& table, int64_t first_id) {
  check.placed(tokens, "tokens");
  check.placed(table, "table");
  check.count(out, tokens.numel() * matrix_dims(table).cols, "out");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
}

OpArgs describe_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                        const Tensor& table, int64_t first_id) {
  return op_args::embedding(tokens, table, table.dtype);
}

OpCost cost_embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table,
                                    int64_t first_id) {
  return {0, 2 * bytes_of(out) + bytes_of(tokens)};
}

// ---- embedding_shard_backward

void check_embedding_shard_backward(const OpChecks& check, const Tensor& dtable, const Tensor& dout,
                                    const Tensor& tokens, int64_t first_id) {
  check.placed(tokens, "tokens");
  check.placed(dtable, "dtable");
  check.count(dout, tokens.numel() * matrix_dims(dtable).cols, "dout");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
}

OpArgs describe_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                         const Tensor& tokens, int64_t first_id) {
  return op_args::embedding(tokens, dtable, dout.dtype);
}

OpCost cost_embedding_shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens,
                                     int64_t first_id) {
  return {elements(dout),
          bytes_of(dout) + 2 * elements(dout) * dtype_size(dtable.dtype) + bytes_of(tokens)};
}

// ---- rmsnorm_forward

void check_rmsnorm_forward(const OpChecks& check, const Tensor& out, const Tensor& rstd,
                           const Tensor& x, const Tensor& weight, float eps) {
  check.count(out, check_norm_operands(check, x, rstd, weight).elements(), "out");
}

OpArgs describe_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                const Tensor& weight, float eps) {
  return op_args::rows_cols(x);
}

OpCost cost_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                            const Tensor& weight, float eps) {
  return {4 * elements(x), bytes_of(x) + bytes_of(out) + bytes_of(weight) + bytes_of(rstd)};
}

// ---- rmsnorm_forward_cast

void check_rmsnorm_forward_cast(const OpChecks& check, const Tensor& out, const Tensor& rstd,
                                const Tensor& x, const Tensor& weight, float eps,
                                const Fp8CastArgs& codes) {
  const int64_t n = check_norm_operands(check, x, rstd, weight).elements();
  if (out.defined()) check.count(out, n, "out");
  check_codes(check, n, codes, CodeLayout::Required, CodeLayout::Absent);
}

OpArgs describe_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                     const Tensor& weight, float eps,
                                     const Fp8CastArgs& /*codes*/) {
  return op_args::rows_cols(x).add_bool("out_unwritten", !out.defined());
}

OpCost cost_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                 const Tensor& weight, float eps, const Fp8CastArgs& codes) {
  // The norm's four operations an element, then the cast's scale, rounding and amax.
  const OpCost norm = cost_rmsnorm_forward(out, rstd, x, weight, eps);
  return {norm.flops + 2 * elements(x), norm.bytes + bytes_of(codes.out)};
}

// ---- rmsnorm_transposed_codes

void check_rmsnorm_transposed_codes(const OpChecks& check, const Fp8CastArgs& codes,
                                    const Tensor& x, const Tensor& rstd, const Tensor& weight,
                                    float eps) {
  check_codes(check, check_norm_operands(check, x, rstd, weight).elements(), codes,
              CodeLayout::Absent, CodeLayout::Required, /*amax=*/false);
}

OpArgs describe_rmsnorm_transposed_codes(const Fp8CastArgs& /*codes*/, const Tensor& x,
                                         const Tensor& rstd, const Tensor& weight, float eps) {
  return op_args::rows_cols(x);
}

OpCost cost_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x, const Tensor& rstd,
                                     const Tensor& weight, float eps) {
  // The norm's two multiplications an element, then the cast's scale and rounding.
  return {4 * elements(x), bytes_of(x) + bytes_of(rstd) + bytes_of(weight) + bytes_of(codes.out_t)};
}

// ---- rmsnorm_backward

void check_rmsnorm_backward(const OpChecks& check, const Tensor& dx, const Tensor& dweight,
                            const Tensor& dout, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd) {
  check.placed(x, "x");
  const MatrixDims d = matrix_dims(x);
  check.count(dx, d.rows * d.cols, "dx");
  check.count(dout, d.rows * d.cols, "dout");
  check.count(dweight, d.cols, "dweight");
  check.count(weight, d.cols, "weight");
  check.count(rstd, d.rows, "rstd");
}

OpArgs describe_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                                 const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  return op_args::rows_cols(x);
}

OpCost cost_rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dout,
                             const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  return {8 * elements(x), bytes_of(x) + bytes_of(dout) + 2 * bytes_of(dx) + bytes_of(weight) +
                               2 * bytes_of(dweight) + bytes_of(rstd)};
}

// ---- rope_forward

void check_rope_forward(const OpChecks& check, const Tensor& qkv, const Tensor& freqs,
                        const AttentionShape& s) {
  check.rope(qkv, freqs, s);
}

OpArgs describe_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  return op_args::rope(s, qkv.dtype);
}

OpCost cost_rope_forward(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) {
  return rope_cost(qkv, freqs, s);
}

// ---- rope_backward

void check_rope_backward(const OpChecks& check, const Tensor& dqkv, const Tensor& freqs,
                         const AttentionShape& s) {
  check.rope(dqkv, freqs, s);
}

OpArgs describe_rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s) {
  return op_args::rope(s, dqkv.dtype);
}

OpCost cost_rope_backward(const Tensor& dqkv, const Tensor& freqs, const AttentionShape& s) {
  return rope_cost(dqkv, freqs, s);
}

// ---- attention_forward

void check_attention_forward(const OpChecks& check, const Tensor& out, const Tensor& lse,
                             const Tensor& qkv, const AttentionShape& s) {
  check.attention_shape(s);
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(out, s.tokens() * s.out_width(), "out");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
}

OpArgs describe_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                  const AttentionShape& s) {
  return op_args::attention(s, qkv.dtype);
}

OpCost cost_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                              const AttentionShape& s) {
  return {2 * s.heads * attention_pairs(s) * (s.head_dim + s.v_dim()),
          bytes_of(qkv) + bytes_of(out) + bytes_of(lse)};
}

// ---- attention_forward_cast

void check_attention_forward_cast(const OpChecks& check, const Tensor& out, const Tensor& lse,
                                  const Tensor& qkv, const AttentionShape& s,
                                  const Fp8CastArgs& codes) {
  check_attention_forward(check, out, lse, qkv, s);
  check_codes(check, out.numel(), codes, CodeLayout::Required, CodeLayout::Absent);
}

OpArgs describe_attention_forward_cast(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const AttentionShape& s, const Fp8CastArgs& /*codes*/) {
  return describe_attention_forward(out, lse, qkv, s);
}

OpCost cost_attention_forward_cast(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                   const AttentionShape& s, const Fp8CastArgs& codes) {
  const OpCost attention = cost_attention_forward(out, lse, qkv, s);
  return {attention.flops + 2 * elements(out), attention.bytes + bytes_of(codes.out)};
}

// ---- attention_backward

void check_attention_backward(const OpChecks& check, const Tensor& dqkv, const Tensor& dout,
                              const Tensor& out, const Tensor& lse, const Tensor& qkv,
                              const AttentionShape& s) {
  check.attention_shape(s);
  const int64_t width = s.qkv_width(), heads_width = s.out_width();
  check.count(qkv, s.tokens() * width, "qkv");
  check.count(dqkv, s.tokens() * width, "dqkv");
  check.count(out, s.tokens() * heads_width, "out");
  check.count(dout, s.tokens() * heads_width, "dout");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
}

OpArgs describe_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                   const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  return op_args::attention(s, qkv.dtype);
}

OpCost cost_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                               const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  // Five GEMMs over the visible pairs: the scores again, dV, dP, dQ and dK.
  return {2 * s.heads * attention_pairs(s) * (3 * s.head_dim + 2 * s.v_dim()),
          bytes_of(qkv) + bytes_of(dqkv) + bytes_of(out) + bytes_of(dout) + bytes_of(lse)};
}

// ---- attention_gathered_forward

void check_attention_gathered_forward(const OpChecks& check, const Tensor& out, const Tensor& lse,
                                      const Tensor& qkv, const Tensor& kv_all,
                                      const Tensor& positions, int64_t segment,
                                      const AttentionShape& s) {
  const int64_t segments = check_gathered(check, positions, segment, s);
  if (s.fp8)
    check.fail("FP8 attention (AttentionShape::fp8) does not run under context parallelism");
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(kv_all, segments * s.tokens() * s.kv_width(), "kv_all");
  check.count(out, s.tokens() * s.heads * s.head_dim, "out");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
}

OpArgs describe_attention_gathered_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                           const Tensor& kv_all, const Tensor& positions,
                                           int64_t segment, const AttentionShape& s) {
  return op_args::attention(s, qkv.dtype);
}

OpCost cost_attention_gathered_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const Tensor& kv_all, const Tensor& positions,
                                       int64_t segment, const AttentionShape& s) {
  const double pairs = gathered_pairs(positions, s);
  return {2 * s.heads * pairs * (s.head_dim + s.v_dim()),
          bytes_of(qkv) + bytes_of(kv_all) + bytes_of(out) + bytes_of(lse)};
}

// ---- attention_gathered_backward

void check_attention_gathered_backward(const OpChecks& check, const Tensor& dqkv,
                                       const Tensor& dkv_all, const Tensor& dout,
                                       const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const Tensor& kv_all, const Tensor& positions,
                                       int64_t segment, const AttentionShape& s) {
  const int64_t segments = check_gathered(check, positions, segment, s);
  const int64_t heads_width = s.heads * s.head_dim;
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(dqkv, s.tokens() * s.qkv_width(), "dqkv");
  check.count(kv_all, segments * s.tokens() * s.kv_width(), "kv_all");
  check.count(dkv_all, segments * s.tokens() * s.kv_width(), "dkv_all");
  check.count(out, s.tokens() * heads_width, "out");
  check.count(dout, s.tokens() * heads_width, "dout");
  check.count(lse, s.batch * s.heads * s.seq, "lse");
}

OpArgs describe_attention_gathered_backward(const Tensor& dqkv, const Tensor& dkv_all,
                                            const Tensor& dout, const Tensor& out,
                                            const Tensor& lse, const Tensor& qkv,
                                            const Tensor& kv_all, const Tensor& positions,
                                            int64_t segment, const AttentionShape& s) {
  return op_args::attention(s, qkv.dtype);
}

OpCost cost_attention_gathered_backward(const Tensor& dqkv, const Tensor& dkv_all,
                                        const Tensor& dout, const Tensor& out, const Tensor& lse,
                                        const Tensor& qkv, const Tensor& kv_all,
                                        const Tensor& positions, int64_t segment,
                                        const AttentionShape& s) {
  const double pairs = gathered_pairs(positions, s);
  return {2 * s.heads * pairs * (3 * s.head_dim + 2 * s.v_dim()),
          bytes_of(qkv) + bytes_of(dqkv) + bytes_of(kv_all) + bytes_of(dkv_all) + bytes_of(out) +
              bytes_of(dout) + bytes_of(lse)};
}

// ---- attention_decode

void check_attention_decode(const OpChecks& check, const Tensor& out, const Tensor& q,
                            const Tensor& kv, const Tensor& positions, int64_t pos,
                            const AttentionShape& s) {
  check.attention_shape(s);
  check.that(s.causal, "generation's attention is causal");
  check.that(pos >= 0 && pos < s.seq, "position {} outside the cache's {} positions", pos, s.seq);
  check.count(q, s.batch * s.heads * s.head_dim, "q");
  check.count(out, s.batch * s.out_width(), "out");
  check.count(kv, s.batch * s.seq * s.kv_heads * (s.head_dim + s.v_dim()), "kv");
  if (positions.defined()) check.count(positions, s.batch, "positions");
}

OpArgs describe_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                 const Tensor& positions, int64_t pos, const AttentionShape& s) {
  return op_args::attention(s, q.dtype);
}

// With per-sequence positions (on the device), every sequence is counted at the largest.
OpCost cost_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                             const Tensor& positions, int64_t pos, const AttentionShape& s) {
  const double keys = s.window > 0 ? std::min<double>(pos + 1, s.window) : pos + 1;
  const double cache_bytes =
      s.batch * keys * s.kv_heads * (s.head_dim + s.v_dim()) * dtype_size(kv.dtype);
  return {2 * s.batch * s.heads * keys * (s.head_dim + s.v_dim()),
          bytes_of(q) + cache_bytes + bytes_of(out) + bytes_of(positions)};
}

// ---- cache_write

void check_cache_write(const OpChecks& check, const Tensor& cache, const Tensor& src,
                       int64_t src_col, const Tensor& positions) {
  check.placed(cache, "cache");
  check.that(cache.shape.rank() == 3, "cache is not (B, S, W)");
  const MatrixDims d = matrix_dims(src);
  const int64_t B = cache.dim(0), W = cache.dim(2);
  check.that(d.rows == B, "src has {} rows for {} sequences", d.rows, B);
  check.that(src_col >= 0 && src_col + W <= d.cols, "columns [{}, {}) outside src's {}", src_col,
             src_col + W, d.cols);
  check.count(positions, B, "positions");
}

OpArgs describe_cache_write(const Tensor& cache, const Tensor& src, int64_t src_col,
                            const Tensor& positions) {
  return op_args::elements(src);
}

OpCost cost_cache_write(const Tensor& cache, const Tensor& src, int64_t src_col,
                        const Tensor& positions) {
  const double bytes = static_cast<double>(cache.dim(0) * cache.dim(2)) * dtype_size(cache.dtype);
  return {0, 2 * bytes + bytes_of(positions)};
}

// ---- mla_qkv_forward

void check_mla_qkv_forward(const OpChecks& check, const MlaQkvArgs& a) {
  check_mla_qkv(check, a);
}

OpArgs describe_mla_qkv_forward(const MlaQkvArgs& a) {
  return op_args::rope(a.s, a.qkv.dtype);
}

OpCost cost_mla_qkv_forward(const MlaQkvArgs& a) {
  return mla_cost(a);
}

// ---- mla_qkv_backward

void check_mla_qkv_backward(const OpChecks& check, const MlaQkvArgs& g) {
  check_mla_qkv(check, g);
}

OpArgs describe_mla_qkv_backward(const MlaQkvArgs& g) {
  return op_args::rope(g.s, g.qkv.dtype);
}

OpCost cost_mla_qkv_backward(const MlaQkvArgs& g) {
  return mla_cost(g);
}

// ---- copy_columns

void check_copy_columns(const OpChecks& check, const Tensor& dst, int64_t dst_col,
                        const Tensor& src, int64_t src_col, int64_t cols) {
  check.placed(dst, "dst");
  check.placed(src, "src");
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  check.that(d.rows == r.rows, "dst {} and src {} differ in rows", dst.shape.str(),
             src.shape.str());
  check.that(cols >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + cols <= d.cols &&
                 src_col + cols <= r.cols,
             "columns [{}, {}) of dst {} or [{}, {}) of src {} out of range", dst_col,
             dst_col + cols, dst.shape.str(), src_col, src_col + cols, src.shape.str());
}

OpArgs describe_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                             int64_t cols) {
  return op_args::rows_cols(src);
}

OpCost cost_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                         int64_t cols) {
  return {0, 2 * static_cast<double>(matrix_dims(src).rows) * cols * dtype_size(src.dtype)};
}

// ---- copy_rows

namespace {
int64_t copied_rows(const Tensor& dst_rows, const Tensor& src_rows) {
  return dst_rows.defined() ? dst_rows.numel() : src_rows.defined() ? src_rows.numel() : 0;
}
}  // namespace

void check_copy_rows(const OpChecks& check, const Tensor& dst, const Tensor& dst_rows,
                     const Tensor& src, const Tensor& src_rows) {
  check.placed(dst, "dst");
  check.placed(src, "src");
  check.that(dst_rows.defined() || src_rows.defined(), "neither dst_rows nor src_rows given");
  const int64_t count = copied_rows(dst_rows, src_rows);
  if (dst_rows.defined()) check.placed(dst_rows, "dst_rows");
  if (src_rows.defined()) check.count(src_rows, count, "src_rows");
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  check.that(d.cols == r.cols, "dst {} and src {} differ in width", dst.shape.str(),
             src.shape.str());
  check.that(dst_rows.defined() || count <= d.rows, "{} rows into dst {}", count, dst.shape.str());
  check.that(src_rows.defined() || count <= r.rows, "{} rows from src {}", count, src.shape.str());
}

OpArgs describe_copy_rows(const Tensor& dst, const Tensor& dst_rows, const Tensor& src,
                          const Tensor& src_rows) {
  return op_args::rows_cols(src);
}

OpCost cost_copy_rows(const Tensor& dst, const Tensor& dst_rows, const Tensor& src,
                      const Tensor& src_rows) {
  const double row_bytes = static_cast<double>(matrix_dims(src).cols) * dtype_size(src.dtype);
  const int64_t count = copied_rows(dst_rows, src_rows);
  return {0, 2 * count * row_bytes + (dst_rows.defined() + src_rows.defined()) * 4.0 * count};
}

// ---- add

void check_add(const OpChecks& check, const Tensor& out, const Tensor& a, const Tensor& b) {
  check.placed(a, "a");
  check.count(b, a.numel(), "b");
  check.count(out, a.numel(), "out");
}

OpArgs describe_add(const Tensor& out, const Tensor& a, const Tensor& b) {
  return op_args::elements(a);
}

OpCost cost_add(const Tensor& out, const Tensor& a, const Tensor& b) {
  return {elements(a), bytes_of(a) + bytes_of(b) + bytes_of(out)};
}

// ---- scale

void check_scale(const OpChecks& check, const Tensor& out, const Tensor& x, float alpha) {
  check.placed(x, "x");
  check.count(out, x.numel(), "out");
}

OpArgs describe_scale(const Tensor& out, const Tensor& x, float alpha) {
  return op_args::elements(x);
}

OpCost cost_scale(const Tensor& out, const Tensor& x, float alpha) {
  return {elements(x), bytes_of(x) + bytes_of(out)};
}

// ---- sample_tokens

void check_sample_tokens(const OpChecks& check, const Tensor& tokens, const Tensor& logps,
                         const Tensor& entropy, const Tensor& logits, const Tensor& streams,
                         const Tensor& steps, int64_t vocab, float temperature, float min_p,
                         uint64_t seed) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  for (const auto& [t, name] : {std::pair{&tokens, "tokens"}, std::pair{&logps, "logps"},
                                std::pair{&entropy, "entropy"}, std::pair{&streams, "streams"},
                                std::pair{&steps, "steps"}})
    check.count(*t, d.rows, name);
  check.that(vocab >= 1 && vocab <= d.cols, "vocab {} outside [1, {}]", vocab, d.cols);
  check.that(temperature >= 0 && std::isfinite(temperature), "temperature {} is not 0 or more", temperature);
  check.that(min_p >= 0 && min_p <= 1, "min_p {} outside [0, 1]", min_p);
}

OpArgs describe_sample_tokens(const Tensor& tokens, const Tensor& logps, const Tensor& entropy,
                              const Tensor& logits, const Tensor& streams, const Tensor& steps,
                              int64_t vocab, float temperature, float min_p, uint64_t seed) {
  return op_args::elements(logits);
}

OpCost cost_sample_tokens(const Tensor& tokens, const Tensor& logps, const Tensor& entropy,
                          const Tensor& logits, const Tensor& streams, const Tensor& steps,
                          int64_t vocab, float temperature, float min_p, uint64_t seed) {
  // Per logit: its exponential twice (entropy and log-probability) and the noise's two logs.
  return {8 * elements(logits), 2 * bytes_of(logits)};
}

// ---- softcap

void check_softcap(const OpChecks& check, const Tensor& out, const Tensor& x, float cap) {
  check.placed(x, "x");
  check.count(out, x.numel(), "out");
  check.that(cap > 0, "cap {} is not positive", cap);
}

OpArgs describe_softcap(const Tensor& out, const Tensor& x, float cap) {
  return op_args::elements(x);
}

OpCost cost_softcap(const Tensor& out, const Tensor& x, float cap) {
  // A division, a tanh (an exponential and a division) and a multiplication.
  return {5 * elements(x), bytes_of(x) + bytes_of(out)};
}

// ---- softcap_backward

void check_softcap_backward(const OpChecks& check, const Tensor& dx, const Tensor& dy,
                            const Tensor& y, float cap) {
  check.placed(y, "y");
  check.count(dy, y.numel(), "dy");
  check.count(dx, y.numel(), "dx");
  check.that(cap > 0, "cap {} is not positive", cap);
}

OpArgs describe_softcap_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, float cap) {
  return op_args::elements(y);
}

OpCost cost_softcap_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, float cap) {
  return {4 * elements(y), bytes_of(y) + bytes_of(dy) + bytes_of(dx)};
}

// ---- swiglu_forward

void check_swiglu_forward(const OpChecks& check, const Tensor& out, const Tensor& gate_up) {
  check.count(out, check_gate_up(check, gate_up), "out");
}

OpArgs describe_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  return op_args::rows_cols(gate_up);
}

OpCost cost_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  // silu(g) * u: an exponential, a division and two multiplications.
  return {5 * elements(out), bytes_of(gate_up) + bytes_of(out)};
}

// ---- swiglu_forward_cast

void check_swiglu_forward_cast(const OpChecks& check, const Tensor& out, const Tensor& gate_up,
                               const Fp8CastArgs& codes) {
  const int64_t n = check_gate_up(check, gate_up);
  if (out.defined()) check.count(out, n, "out");
  check_codes(check, n, codes, CodeLayout::Optional, CodeLayout::Optional);
}

// What it writes, for the bandwidth report: out or not, and one or two code layouts.
OpArgs describe_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up,
                                    const Fp8CastArgs& codes) {
  return op_args::rows_cols(gate_up)
      .add_bool("out_unwritten", !out.defined())
      .add("code_layouts", int64_t{codes.out.defined()} + int64_t{codes.out_t.defined()});
}

OpCost cost_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up, const Fp8CastArgs& codes) {
  // The SwiGLU's five operations an element, then the cast's scale, rounding and amax.
  return {3.5 * elements(gate_up),
          bytes_of(gate_up) + bytes_of(out) + bytes_of(codes.out) + bytes_of(codes.out_t)};
}

// ---- swiglu_backward

void check_swiglu_backward(const OpChecks& check, const Tensor& dgate_up, const Tensor& dout,
                           const Tensor& gate_up) {
  const int64_t n = check_gate_up(check, gate_up);
  check.count(dgate_up, 2 * n, "dgate_up");
  check.count(dout, n, "dout");
}

OpArgs describe_swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  return op_args::rows_cols(gate_up);
}

OpCost cost_swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  return {10 * elements(dout), bytes_of(gate_up) + bytes_of(dout) + bytes_of(dgate_up)};
}

// ---- swiglu_backward_cast

void check_swiglu_backward_cast(const OpChecks& check, const Tensor& dgate_up, const Tensor& dout,
                                const Tensor& gate_up, const Fp8CastArgs& codes) {
  check_swiglu_backward(check, dgate_up, dout, gate_up);
  check_codes(check, dgate_up.numel(), codes, CodeLayout::Required, CodeLayout::Required);
}

OpArgs describe_swiglu_backward_cast(const Tensor& dgate_up, const Tensor& dout,
                                     const Tensor& gate_up, const Fp8CastArgs& /*codes*/) {
  return op_args::rows_cols(gate_up);
}

OpCost cost_swiglu_backward_cast(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up,
                                 const Fp8CastArgs& codes) {
  // The backward's operations, then the cast's scale, rounding and amax of both halves; the
  // bytes of the folded kernel (d(gate_up) itself not stored).
  return {14 * elements(dout),
          bytes_of(gate_up) + bytes_of(dout) + bytes_of(codes.out) + bytes_of(codes.out_t)};
}

// ---- cross_entropy

void check_cross_entropy(const OpChecks& check, const Tensor& losses, const Tensor& logits,
                         const Tensor& targets, const Tensor& dlogits, float grad_scale) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(losses, d.rows, "losses");
  check.count(targets, d.rows, "targets");
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
}

OpArgs describe_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                              const Tensor& dlogits, float grad_scale) {
  return op_args::cross_entropy(logits, dlogits);
}

OpCost cost_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                          const Tensor& dlogits, float grad_scale) {
  // The max, the sum of exponentials, and with the gradient the softmax again.
  const bool grad = dlogits.defined();
  return {(grad ? 6 : 4) * elements(logits),
          (grad ? 2 : 1) * bytes_of(logits) + bytes_of(targets) + bytes_of(losses)};
}

// ---- log_softmax_gather

void check_log_softmax_gather(const OpChecks& check, const Tensor& logps, const Tensor& lse,
                              const Tensor& logits, const Tensor& targets) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(logps, d.rows, "logps");
  check.count(lse, d.rows, "lse");
  check.count(targets, d.rows, "targets");
}

OpArgs describe_log_softmax_gather(const Tensor& logps, const Tensor& lse, const Tensor& logits,
                                   const Tensor& targets) {
  return op_args::cross_entropy(logits, Tensor{});
}

OpCost cost_log_softmax_gather(const Tensor& logps, const Tensor& lse, const Tensor& logits,
                               const Tensor& targets) {
  return {3 * elements(logits),
          bytes_of(logits) + bytes_of(targets) + bytes_of(logps) + bytes_of(lse)};
}

// ---- log_softmax_gather_backward

void check_log_softmax_gather_backward(const OpChecks& check, const Tensor& dlogits,
                                       const Tensor& dlogps, const Tensor& logits,
                                       const Tensor& lse, const Tensor& targets) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(dlogits, d.rows * d.cols, "dlogits");
  check.count(dlogps, d.rows, "dlogps");
  check.count(lse, d.rows, "lse");
  check.count(targets, d.rows, "targets");
}

OpArgs describe_log_softmax_gather_backward(const Tensor& dlogits, const Tensor& dlogps,
                                            const Tensor& logits, const Tensor& lse,
                                            const Tensor& targets) {
  return op_args::cross_entropy(logits, dlogits);
}

OpCost cost_log_softmax_gather_backward(const Tensor& dlogits, const Tensor& dlogps,
                                        const Tensor& logits, const Tensor& lse,
                                        const Tensor& targets) {
  return {3 * elements(logits), bytes_of(logits) + bytes_of(dlogits) + bytes_of(targets) +
                                    bytes_of(dlogps) + bytes_of(lse)};
}

// ---- qk_norm_forward

void check_qk_norm_forward(const OpChecks& check, const Tensor& out, const Tensor& rstd,
                           const Tensor& qkv, const Tensor& q_weight, const Tensor& k_weight,
                           const AttentionShape& s, float eps) {
  check.attention_shape(s);
  check.count(qkv, s.tokens() * s.qkv_width(), "qkv");
  check.count(out, s.tokens() * s.qkv_width(), "out");
  check.count(rstd, s.tokens() * (s.heads + s.kv_heads), "rstd");
  check.count(q_weight, s.head_dim, "q_weight");
  check.count(k_weight, s.head_dim, "k_weight");
}

OpArgs describe_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                                const Tensor& q_weight, const Tensor& k_weight,
                                const AttentionShape& s, float eps) {
  return op_args::rope(s, qkv.dtype);
}

OpCost cost_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                            const Tensor& q_weight, const Tensor& k_weight, const AttentionShape& s,
                            float eps) {
  const double n = s.tokens() * (s.heads + s.kv_heads) * s.head_dim;
  return {4 * n,
          bytes_of(qkv) + bytes_of(out) + bytes_of(q_weight) + bytes_of(k_weight) + bytes_of(rstd)};
}

// ---- qk_norm_backward

void check_qk_norm_backward(const OpChecks& check, const Tensor& dqkv, const Tensor& dq_weight,
                            const Tensor& dk_weight, const Tensor& dout, const Tensor& qkv,
                            const Tensor& q_weight, const Tensor& k_weight, const Tensor& rstd,
                            const AttentionShape& s) {
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
}

OpArgs describe_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight,
                                 const Tensor& dk_weight, const Tensor& dout, const Tensor& qkv,
                                 const Tensor& q_weight, const Tensor& k_weight, const Tensor& rstd,
                                 const AttentionShape& s) {
  return op_args::rope(s, qkv.dtype);
}

OpCost cost_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight, const Tensor& dk_weight,
                             const Tensor& dout, const Tensor& qkv, const Tensor& q_weight,
                             const Tensor& k_weight, const Tensor& rstd, const AttentionShape& s) {
  const double n = s.tokens() * (s.heads + s.kv_heads) * s.head_dim;
  return {8 * n, bytes_of(qkv) + bytes_of(dout) + bytes_of(dqkv) + bytes_of(q_weight) +
                     bytes_of(k_weight) + 2 * bytes_of(dq_weight) + 2 * bytes_of(dk_weight) +
                     bytes_of(rstd)};
}

// ---- moe_router_forward

void check_moe_router_forward(const OpChecks& check, const Tensor& indices, const Tensor& weights,
                              const Tensor& logits, const Tensor& bias, const MoeRouting& r) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check_routing(check, r, d.cols);
  check_slots(check, indices, d.rows, r.topk, "indices");
  check_slots(check, weights, d.rows, r.topk, "weights");
  if (bias.defined()) {
    check.count(bias, d.cols, "bias");
    check.that(r.sigmoid, "an expert bias needs sigmoid scores");
  }
}

OpArgs describe_moe_router_forward(const Tensor& indices, const Tensor& weights,
                                   const Tensor& logits, const Tensor& bias, const MoeRouting& r) {
  return op_args::moe_routing(logits, r);
}

OpCost cost_moe_router_forward(const Tensor& indices, const Tensor& weights, const Tensor& logits,
                               const Tensor& bias, const MoeRouting& r) {
  // Scores, then a top-k pass over the experts per slot.
  return {elements(logits) * (4 + r.topk),
          bytes_of(logits) + bytes_of(indices) + bytes_of(weights) + bytes_of(bias)};
}

// ---- moe_router_backward

void check_moe_router_backward(const OpChecks& check, const Tensor& dlogits, const Tensor& dweights,
                               const Tensor& logits, const Tensor& indices, const MoeRouting& r) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check_routing(check, r, d.cols);
  check.count(dlogits, d.rows * d.cols, "dlogits");
  check_slots(check, dweights, d.rows, r.topk, "dweights");
  check_slots(check, indices, d.rows, r.topk, "indices");
}

OpArgs describe_moe_router_backward(const Tensor& dlogits, const Tensor& dweights,
                                    const Tensor& logits, const Tensor& indices,
                                    const MoeRouting& r) {
  return op_args::moe_routing(logits, r);
}

OpCost cost_moe_router_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& logits,
                                const Tensor& indices, const MoeRouting& r) {
  return {4 * elements(logits),
          bytes_of(logits) + bytes_of(dlogits) + bytes_of(dweights) + bytes_of(indices)};
}

// ---- moe_aux_loss

void check_moe_aux_loss(const OpChecks& check, const MoeAuxLossArgs& a) {
  check.placed(a.logits, "logits");
  const MatrixDims d = matrix_dims(a.logits);
  check_routing(check, a.routing, d.cols);
  check_slots(check, a.indices, d.rows, a.routing.topk, "indices");
  check.that(a.seq >= 0 && (a.seq == 0 || d.rows % a.seq == 0), "{} tokens are not sequences of {}",
             d.rows, a.seq);
  if (a.loss.defined()) check.count(a.loss, 1, "loss");
  if (a.dlogits.defined()) check.count(a.dlogits, d.rows * d.cols, "dlogits");
}

OpArgs describe_moe_aux_loss(const MoeAuxLossArgs& a) {
  return op_args::moe_routing(a.logits, a.routing);
}

OpCost cost_moe_aux_loss(const MoeAuxLossArgs& a) {
  return {4 * elements(a.logits),
          bytes_of(a.logits) + bytes_of(a.indices) + 2 * bytes_of(a.dlogits) + bytes_of(a.loss)};
}

// ---- moe_z_loss

void check_moe_z_loss(const OpChecks& check, const Tensor& loss, const Tensor& dlogits,
                      const Tensor& logits, float grad_scale) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  if (loss.defined()) check.count(loss, 1, "loss");
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
}

OpArgs describe_moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                           float grad_scale) {
  return op_args::rows_cols(logits);
}

OpCost cost_moe_z_loss(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                       float grad_scale) {
  return {4 * elements(logits), bytes_of(logits) + 2 * bytes_of(dlogits) + bytes_of(loss)};
}

// ---- moe_expert_counts

void check_moe_expert_counts(const OpChecks& check, const Tensor& counts, const Tensor& indices) {
  check.placed(counts, "counts");
  check.placed(indices, "indices");
}

OpArgs describe_moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  return op_args::rows_cols(indices);
}

OpCost cost_moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  return {elements(indices), bytes_of(indices) + 2 * bytes_of(counts)};
}

// ---- moe_expert_bias_update

void check_moe_expert_bias_update(const OpChecks& check, const Tensor& bias, const Tensor& counts,
                                  float rate) {
  check.placed(bias, "bias");
  check.count(counts, bias.numel(), "counts");
}

OpArgs describe_moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) {
  return op_args::elements(bias);
}

OpCost cost_moe_expert_bias_update(const Tensor& bias, const Tensor& counts, float rate) {
  return {3 * elements(bias), 2 * bytes_of(bias) + bytes_of(counts)};
}

// ---- moe_permute

void check_moe_permute(const OpChecks& check, const Tensor& xp, const Tensor& rows,
                       const Tensor& offsets, const Tensor& x, const Tensor& indices, int64_t align,
                       const MoeCapacity& capacity) {
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
}

OpArgs describe_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                            const Tensor& x, const Tensor& indices, int64_t align,
                            const MoeCapacity& capacity) {
  return op_args::moe_permute(x, indices, xp);
}

OpCost cost_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                        const Tensor& x, const Tensor& indices, int64_t align,
                        const MoeCapacity& capacity) {
  // Every kept (token, slot) copies its token's row; the padding rows are zeroed.
  return {0, elements(indices) * matrix_dims(x).cols * dtype_size(x.dtype) + bytes_of(xp) +
                 bytes_of(indices) + bytes_of(rows) + bytes_of(offsets)};
}

// ---- moe_permute_backward

void check_moe_permute_backward(const OpChecks& check, const Tensor& dx, const Tensor& dxp,
                                const Tensor& rows) {
  check.placed(dx, "dx");
  check.placed(dxp, "dxp");
  const MatrixDims xd = matrix_dims(dx), pd = matrix_dims(dxp);
  check.that(pd.cols == xd.cols, "dxp {} and dx {} differ in width", dxp.shape.str(),
             dx.shape.str());
  check_slots(check, rows, xd.rows, matrix_dims(rows).cols, "rows");
}

OpArgs describe_moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) {
  return op_args::moe_permute(dx, rows, dxp);
}

OpCost cost_moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& rows) {
  const double copies = elements(rows) * matrix_dims(dx).cols;
  return {copies, copies * dtype_size(dxp.dtype) + 2 * bytes_of(dx) + bytes_of(rows)};
}

// ---- moe_unpermute

void check_moe_unpermute(const OpChecks& check, const Tensor& out, const Tensor& yp,
                         const Tensor& rows, const Tensor& weights) {
  check.placed(out, "out");
  check.placed(yp, "yp");
  const MatrixDims od = matrix_dims(out), pd = matrix_dims(yp);
  const int64_t K = matrix_dims(rows).cols;
  check.that(pd.cols == od.cols, "yp {} and out {} differ in width", yp.shape.str(),
             out.shape.str());
  check_slots(check, rows, od.rows, K, "rows");
  check_slots(check, weights, od.rows, K, "weights");
}

OpArgs describe_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                              const Tensor& weights) {
  return op_args::moe_permute(out, rows, yp);
}

OpCost cost_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                          const Tensor& weights) {
  const double copies = elements(rows) * matrix_dims(out).cols;
  return {2 * copies,
          copies * dtype_size(yp.dtype) + 2 * bytes_of(out) + bytes_of(rows) + bytes_of(weights)};
}

// ---- moe_unpermute_backward

void check_moe_unpermute_backward(const OpChecks& check, const Tensor& dyp, const Tensor& dweights,
                                  const Tensor& dout, const Tensor& yp, const Tensor& rows,
                                  const Tensor& weights) {
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
}

OpArgs describe_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights,
                                       const Tensor& dout, const Tensor& yp, const Tensor& rows,
                                       const Tensor& weights) {
  return op_args::moe_permute(dout, rows, yp);
}

OpCost cost_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights, const Tensor& dout,
                                   const Tensor& yp, const Tensor& rows, const Tensor& weights) {
  const double copies = elements(rows) * matrix_dims(dout).cols;
  return {4 * copies, 2 * copies * dtype_size(yp.dtype) + bytes_of(dyp) + bytes_of(dout) +
                          bytes_of(rows) + bytes_of(weights) + bytes_of(dweights)};
}

// ---- grouped_matmul

void check_grouped_matmul(const OpChecks& check, const GroupedMatmulArgs& a) {
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
}

OpArgs describe_grouped_matmul(const GroupedMatmulArgs& a) {
  return op_args::grouped_matmul(a);
}

OpCost cost_grouped_matmul(const GroupedMatmulArgs& a) {
  const double rows = grouped_rows(a.a, a.host_offsets);
  const double N = a.trans_b ? a.b.dim(1) : a.b.dim(2), K = a.trans_b ? a.b.dim(2) : a.b.dim(1);
  return {2 * rows * N * K, bytes_of(a.out) + rows * K * dtype_size(a.a.dtype) + bytes_of(a.b)};
}

// ---- grouped_matmul_wgrad

void check_grouped_matmul_wgrad(const OpChecks& check, const GroupedMatmulWgradArgs& a) {
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
}

OpArgs describe_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  return op_args::grouped_matmul_wgrad(a);
}

OpCost cost_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  const double rows = grouped_rows(a.a, a.host_offsets);
  const double M = a.out.dim(1), N = a.out.dim(2);
  return {2 * rows * M * N,
          rows * (M + N) * dtype_size(a.a.dtype) + (a.beta != 0.0f ? 2 : 1) * bytes_of(a.out)};
}

// ---- grouped_matmul_fp8

void check_grouped_matmul_fp8(const OpChecks& check, const GroupedFp8MatmulArgs& a) {
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
}

OpArgs describe_grouped_matmul_fp8(const GroupedFp8MatmulArgs& a) {
  return op_args::grouped_matmul_fp8(a);
}

OpCost cost_grouped_matmul_fp8(const GroupedFp8MatmulArgs& a) {
  const double rows = grouped_rows(a.a, a.host_offsets);
  const double N = a.b.dim(1), K = a.b.dim(2);
  return {2 * rows * N * K, bytes_of(a.out) + rows * K + bytes_of(a.b)};
}

// ---- grouped_matmul_fp8_wgrad

void check_grouped_matmul_fp8_wgrad(const OpChecks& check, const GroupedFp8MatmulWgradArgs& a) {
  check.placed(a.out, "out");
  check.placed(a.a_t, "a_t");
  check.placed(a.b_t, "b_t");
  check.that(a.out.shape.rank() == 3, "out {} is not (weights, M, N)", a.out.shape.str());
  const int64_t W = a.out.dim(0), M = a.out.dim(1), N = a.out.dim(2);
  const MatrixDims ad = matrix_dims(a.a_t), bd = matrix_dims(a.b_t);
  check.that(ad.rows == M && bd.rows == N && ad.cols == bd.cols,
             "a_t {} and b_t {} are not ({}, rows) and ({}, rows) for out {}", a.a_t.shape.str(),
             a.b_t.shape.str(), M, N, a.out.shape.str());
  check_fp8_operands(check, a.a_t, a.b_t, a.a_scale_inv, a.b_scale_inv, 1);
  check_groups(check, a.offsets, a.host_offsets, a.group_weights, W, ad.cols);
}

OpArgs describe_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& a) {
  return op_args::grouped_matmul_fp8_wgrad(a);
}

OpCost cost_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& a) {
  const double rows =
      a.host_offsets.empty() ? static_cast<double>(matrix_dims(a.a_t).cols) : a.host_offsets.back();
  const double M = a.out.dim(1), N = a.out.dim(2);
  return {2 * rows * M * N, rows * (M + N) + (a.beta != 0.0f ? 2 : 1) * bytes_of(a.out)};
}

// ---- cross_entropy_shard_stats

void check_cross_entropy_shard_stats(const OpChecks& check, const Tensor& stats,
                                     const Tensor& logits, const Tensor& targets,
                                     int64_t first_id) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(stats, 2 * d.rows, "stats");
  check.count(targets, d.rows, "targets");
  check.that(first_id >= 0, "first_id {} is negative", first_id);
}

OpArgs describe_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                          const Tensor& targets, int64_t first_id) {
  return op_args::cross_entropy(logits, Tensor{});
}

OpCost cost_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                      const Tensor& targets, int64_t first_id) {
  return {3 * elements(logits), bytes_of(logits) + bytes_of(targets) + bytes_of(stats)};
}

// ---- cross_entropy_shard

void check_cross_entropy_shard(const OpChecks& check, const Tensor& losses, const Tensor& logits,
                               const Tensor& targets, const Tensor& all_stats, int64_t first_id,
                               const Tensor& dlogits, float grad_scale) {
  check.placed(logits, "logits");
  const MatrixDims d = matrix_dims(logits);
  check.count(losses, d.rows, "losses");
  check.count(targets, d.rows, "targets");
  check.placed(all_stats, "all_stats");
  check.that(all_stats.numel() > 0 && all_stats.numel() % (2 * d.rows) == 0,
             "all_stats {} is not (shards, {}, 2)", all_stats.shape.str(), d.rows);
  check.that(first_id >= 0, "first_id {} is negative", first_id);
  if (dlogits.defined()) check.count(dlogits, d.rows * d.cols, "dlogits");
}

OpArgs describe_cross_entropy_shard(const Tensor& losses, const Tensor& logits,
                                    const Tensor& targets, const Tensor& all_stats,
                                    int64_t first_id, const Tensor& dlogits, float grad_scale) {
  return op_args::cross_entropy(logits, dlogits);
}

OpCost cost_cross_entropy_shard(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                const Tensor& all_stats, int64_t first_id, const Tensor& dlogits,
                                float grad_scale) {
  const bool grad = dlogits.defined();
  return {(grad ? 4 : 1) * elements(logits), (grad ? 2 : 0) * bytes_of(logits) + bytes_of(targets) +
                                                 bytes_of(all_stats) + bytes_of(losses)};
}

// ---- sum

void check_sum(const OpChecks& check, const Tensor& out, const Tensor& x, bool accumulate) {
  check.placed(x, "x");
  check.count(out, 1, "out");
}

OpArgs describe_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  return op_args::reduction(x, accumulate);
}

OpCost cost_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  return {elements(x), bytes_of(x) + bytes_of(out)};
}

// ---- sum_squares

void check_sum_squares(const OpChecks& check, const Tensor& out, const Tensor& x, bool accumulate) {
  check.placed(x, "x");
  check.count(out, 1, "out");
}

OpArgs describe_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  return op_args::reduction(x, accumulate);
}

OpCost cost_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  return {2 * elements(x), bytes_of(x) + bytes_of(out)};
}

// ---- adamw_step

void check_adamw_step(const OpChecks& check, const AdamWArgs& args) {
  check.that(args.master.defined() || args.params.defined(),
             "neither master nor params is defined: nothing to update");
  const Tensor& updated = args.master.defined() ? args.master : args.params;
  check.placed(updated, args.master.defined() ? "master" : "params");
  const int64_t P = updated.numel();
  if (args.master.defined()) {
    check.that(args.master.dtype == DType::F32 || args.master.dtype == DType::U16,
               "master has dtype {}, expected fp32 or uint16 (split)", dtype_name(args.master.dtype));
    if (args.master.dtype == DType::U16)
      check.that(args.params.defined() && args.params.dtype == DType::BF16,
                 "a split master (uint16 low halves) needs bf16 params, its high halves");
  }
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
}

OpArgs describe_adamw_step(const AdamWArgs& args) {
  return op_args::adamw(args);
}

OpCost cost_adamw_step(const AdamWArgs& args) {
  // Clipping, the moments, bias correction, decay and the update: some 15 operations a
  // parameter; the state is read and written, the gradient read, the parameters written.
  const Tensor& updated = args.master.defined() ? args.master : args.params;
  const double state = bytes_of(args.exp_avg) + bytes_of(args.exp_avg_sq) + bytes_of(args.master);
  // The parameters are only written beside an fp32 master; read too when they are the
  // master or its high halves.
  const bool params_read = !args.master.defined() || args.master.dtype == DType::U16;
  return {15 * elements(updated),
          2 * state + bytes_of(args.grad) + bytes_of(args.params) * (params_read ? 2 : 1)};
}

// ---- split_master

void check_split_master(const OpChecks& check, const Tensor& high, const Tensor& low,
                        const Tensor& master) {
  check.placed(master, "master");
  check.count(high, master.numel(), "high");
  check.count(low, master.numel(), "low");
  check.that(high.dtype == DType::BF16, "high has dtype {}, expected bf16", dtype_name(high.dtype));
  check.that(low.dtype == DType::U16, "low has dtype {}, expected uint16", dtype_name(low.dtype));
}

OpArgs describe_split_master(const Tensor& high, const Tensor& low, const Tensor& master) {
  return op_args::convert(high, master);
}

OpCost cost_split_master(const Tensor& high, const Tensor& low, const Tensor& master) {
  return {0, bytes_of(master) + bytes_of(high) + bytes_of(low)};
}

}  // namespace tessera::op_defs
