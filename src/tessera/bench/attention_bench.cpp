#include "tessera/bench/attention_bench.h"

#include <algorithm>
#include <array>
#include <cmath>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/core/error.h"
#include "tessera/model/parallel_layers.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::bench {
namespace {

constexpr const char* kUsage =
    R"(usage: tessera bench attention [--seqs 1024,2048,4096,8192,16384,32768]
         [--head_dims 64,128] [--heads 32] [--kv_heads 8] [--masks causal,full,window,packed,cp]
         [--window 4096] [--document_length 2048] [--context_parallel_size 2]
         [--tokens 16384 | --batch B]
         [--passes forward,backward]
         [--attention_backend auto|tessera|cudnn] [--deterministic_mode true|false]
         [--fp8_dot_product_attention true|false]
         [--device auto|cpu|cuda] [--gpu NAME]
         [--warmup 5] [--iters 20] [-o DIR]

The fused attention op over masks, GQA ratios (--kv_heads 32,8,1 sweeps them), head dims and
sequence lengths; batch = max(1, tokens / seq) unless --batch. Window rows are skipped where
the window covers the sequence. packed (not in the default): each sequence holds documents of
--document_length tokens (the last one shorter), attention inside each; rows are skipped where
one document covers the sequence. cp (not in the default): causal attention split over
--context_parallel_size segments as context parallelism runs it on each GPU (Megatron's load
balancing: every segment's keys, one segment's queries), every segment's share timed in turn
on this GPU, so that its TFLOP/s are one GPU's under context parallelism, the exchange of keys
and values aside. --attention_backend picks the kernels and
--deterministic_mode true their bit-reproducible backward, and --fp8_dot_product_attention true
the forward on FP8 codes (heads of 128, the default --head_dims then; backward rows: the bf16
backward after it), as the training keys of those names do. Each row is checked before timing
(T=200 against the CPU reference; forward rows also sampled at full size against a host
softmax).
TFLOP/s: forward 4*B*H*D*pairs with pairs = T^2/2 causal, T^2 full, the exact band for a
window, L^2/2 per document of L tokens packed; backward 2.5x forward. -o DIR writes bench_attention.csv and .md.
)";

constexpr int64_t kSmallSeq = 200;  // not a multiple of any tile
constexpr int kSampledRows = 4;

// qkv, out, lse (+ dout, dqkv for the backward, the document starts when packed) of one
// problem, in one allocation, and the shape that reads them. Under context parallelism qkv,
// out, lse, dout and dqkv hold one set per segment (segment(c) views them), kv_all every
// segment's key and value columns of qkv (as the model's all-gather leaves them), dkv_all their
// gradients, and positions every segment's places.
struct AttentionTensors {
  DeviceBuffer buffer;
  Tensor qkv, out, lse, dout, dqkv, kv_all, dkv_all, positions;
  AttentionShape shape;  // per segment under context parallelism
  int64_t segments = 1;
  // Segment c's qkv, out, lse, dout and dqkv.
  std::array<Tensor, 5> segment(int64_t c) const {
    auto part = [&](const Tensor& t) {
      if (!t.defined()) return t;
      const int64_t n = t.numel() / segments;
      return t.flat_range(c * n, n).view({t.shape[0] / segments, t.shape[1], t.shape[2]});
    };
    return {part(qkv), part(out), part(lse), part(dout), part(dqkv)};
  }
  // kv_all from qkv, as the model gathers it.
  void gather_kv(Backend& b) const {
    if (segments == 1) return;
    const int64_t rows = qkv.numel() / shape.qkv_width();
    const int64_t first = shape.heads * shape.head_dim;
    b.copy_columns(kv_all.view({rows, shape.kv_width()}), 0,
                   qkv.view({rows, shape.qkv_width()}), first, shape.kv_width());
  }
};

// The first token of each token's document, for every sequence (B, T).
std::vector<int32_t> document_starts(const AttentionProblem& p) {
  std::vector<int32_t> starts(static_cast<size_t>(p.batch * p.seq));
  for (int64_t k = 0; k < p.batch * p.seq; ++k) {
    const int64_t t = k % p.seq;
    starts[k] = static_cast<int32_t>(t / p.document_length * p.document_length);
  }
  return starts;
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

size_t set_bytes(const AttentionProblem& p, DType dt) {
  const AttentionShape s = p.shape();
  const int64_t S = p.segments;
  const size_t qkv = aligned(S * s.tokens() * s.qkv_width() * dtype_size(dt));
  const size_t out = aligned(S * s.tokens() * s.heads * s.head_dim * dtype_size(dt));
  const size_t lse = aligned(S * s.batch * s.heads * s.seq * sizeof(float));
  const size_t starts = p.document_length > 0 ? aligned(s.tokens() * sizeof(int32_t)) : 0;
  const size_t positions = S > 1 ? aligned(S * s.seq * sizeof(int32_t)) : 0;
  const size_t kv = S > 1 ? aligned(S * s.tokens() * s.kv_width() * dtype_size(dt)) : 0;
  return qkv + out + lse + starts + positions + kv + (p.backward ? qkv + out + kv : 0);
}

AttentionTensors allocate(Backend& b, const AttentionProblem& p, DType dt, uint64_t seed) {
  const AttentionShape s = p.shape();
  AttentionTensors t;
  t.buffer = DeviceBuffer(b, set_bytes(p, dt), "attention benchmark tensors");
  size_t at = 0;
  auto take = [&](DType d, Shape shape) {
    const Tensor x = t.buffer.tensor(d, shape, at);
    at += aligned(x.nbytes());
    return x;
  };
  const int64_t S = p.segments;
  t.segments = S;
  t.qkv = take(dt, {S * s.batch, s.seq, s.qkv_width()});
  t.out = take(dt, {S * s.batch, s.seq, s.heads * s.head_dim});
  t.lse = take(DType::F32, {S * s.batch, s.heads, s.seq});
  t.shape = s;
  if (p.document_length > 0) {
    t.shape.document_starts = take(DType::I32, {s.tokens()});
    b.upload(t.shape.document_starts, document_starts(p).data());
  }
  if (S > 1) {
    t.positions = take(DType::I32, {S, s.seq});
    b.upload(t.positions, context_parallel_positions(s.seq, static_cast<int>(S)).data());
  }
  b.init_normal(t.qkv, seed, 0, 0.0f, 1.0f);
  if (S > 1) {
    t.kv_all = take(dt, {S * s.batch, s.seq, s.kv_width()});
    t.gather_kv(b);
  }
  if (p.backward) {
    t.dout = take(dt, {S * s.batch, s.seq, s.heads * s.head_dim});
    t.dqkv = take(dt, {S * s.batch, s.seq, s.qkv_width()});
    b.init_normal(t.dout, seed + 1, 0, 0.0f, 1.0f);
    if (S > 1) {
      // The gathered backward writes dqkv's query columns only: the rest compare as zeros.
      b.fill(t.dqkv, 0.0f);
      t.dkv_all = take(dt, {S * s.batch, s.seq, s.kv_width()});
    }
  }
  return t;
}

void forward(Backend& b, const AttentionTensors& t) {
  if (t.segments == 1) return b.attention_forward(t.out, t.lse, t.qkv, t.shape);
  for (int64_t c = 0; c < t.segments; ++c) {
    const auto [qkv, out, lse, dout, dqkv] = t.segment(c);
    b.attention_gathered_forward(out, lse, qkv, t.kv_all, t.positions, c, t.shape);
  }
}

// Under context parallelism dkv_all holds the last segment's key and value gradients.
void backward(Backend& b, const AttentionTensors& t) {
  if (t.segments == 1) return b.attention_backward(t.dqkv, t.dout, t.out, t.lse, t.qkv, t.shape);
  for (int64_t c = 0; c < t.segments; ++c) {
    const auto [qkv, out, lse, dout, dqkv] = t.segment(c);
    b.attention_gathered_backward(dqkv, t.dkv_all, dout, out, lse, qkv, t.kv_all, t.positions, c,
                                  t.shape);
  }
}

void run(Backend& b, const AttentionProblem& p, const AttentionTensors& t) {
  p.backward ? backward(b, t) : forward(b, t);
}

// Output row and log-sum-exp of query (b, t, h), in double, from the host copy of qkv.
void host_attention_row(const AttentionProblem& p, const std::vector<float>& qkv, int64_t b,
                        int64_t t, int64_t h, std::vector<double>& out, double& lse) {
  const AttentionShape s = p.shape();
  const int64_t W = s.qkv_width(), D = s.head_dim, kvh = h / (s.heads / s.kv_heads);
  const float* q = &qkv[(b * s.seq + t) * W + h * D];
  int64_t first = s.window > 0 ? std::max<int64_t>(0, t - s.window + 1) : 0;
  if (p.document_length > 0) first = std::max(first, t / p.document_length * p.document_length);
  const int64_t last = s.causal ? t : s.seq - 1;
  std::vector<double> score;
  double max = -INFINITY;
  for (int64_t j = first; j <= last; ++j) {
    const float* k = &qkv[(b * s.seq + j) * W + (s.heads + kvh) * D];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
    score.push_back(dot * s.scale);
    max = std::max(max, score.back());
  }
  double sum = 0;
  for (double& x : score) sum += (x = std::exp(x - max));
  out.assign(D, 0.0);
  for (int64_t j = first; j <= last; ++j) {
    const float* v = &qkv[(b * s.seq + j) * W + (s.heads + s.kv_heads + kvh) * D];
    for (int64_t d = 0; d < D; ++d) out[d] += score[j - first] / sum * v[d];
  }
  lse = max + std::log(sum);
}

}  // namespace

AttentionShape AttentionProblem::shape() const {
  AttentionShape s;
  s.batch = batch, s.seq = seq / segments, s.heads = heads, s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.causal = causal;
  s.window = window;
  s.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  s.fp8 = fp8;
  return s;
}

std::string AttentionProblem::mask() const {
  const std::string precision = fp8 ? " fp8" : "";
  if (segments > 1) return fmt::format("causal cp {}", segments) + precision;
  if (window > 0) return fmt::format("window {}", window) + precision;
  if (document_length > 0) return fmt::format("packed {}", document_length) + precision;
  return (causal ? "causal" : "full") + precision;
}

double visible_pairs(int64_t seq, bool causal, int64_t window, int64_t document_length) {
  if (document_length > 0 && document_length < seq) {
    double pairs = 0;
    for (int64_t begin = 0; begin < seq; begin += document_length)
      pairs += visible_pairs(std::min(document_length, seq - begin), causal, window);
    return pairs;
  }
  const double T = static_cast<double>(seq);
  if (window <= 0 || window >= seq) return causal ? T * T / 2 : T * T;  // the convention
  double pairs = 0;  // the exact band: query i sees keys (i - window, i] (or to T - 1 if full)
  for (int64_t i = 0; i < seq; ++i)
    pairs += static_cast<double>((causal ? i : seq - 1) - std::max<int64_t>(0, i - window + 1) + 1);
  return pairs;
}

double AttentionProblem::forward_flops() const {
  return 4.0 * batch * heads * head_dim * visible_pairs(seq, causal, window, document_length);
}

AttentionCheck check_attention(BenchContext& ctx, const AttentionProblem& p) {
  Backend& dev = *ctx.device;
  AttentionCheck r;
  {  // The same kind at T=200 against the CPU reference, forward and backward on both.
    AttentionProblem small = p;
    small.batch = 1;
    // Under context parallelism: chunks of 128 tokens, the GPU's warpgroup kernels' smallest.
    small.seq = p.segments > 1 ? 256 * p.segments : kSmallSeq;
    small.kv_heads = std::min<int64_t>(p.kv_heads, 2);
    small.heads = small.kv_heads * (p.heads / p.kv_heads);
    if (p.window > 0) small.window = std::min<int64_t>(p.window, 64);
    if (p.document_length > 0) small.document_length = std::min<int64_t>(p.document_length, 64);
    small.backward = true;
    const AttentionTensors d = allocate(dev, small, ctx.dtype, 31);
    const AttentionShape& s = d.shape;
    forward(dev, d);
    backward(dev, d);
    Backend& ref = *ctx.reference;
    const AttentionTensors h = allocate(ref, small, DType::F32, 31);
    upload_floats(ref, h.qkv, download_floats(dev, d.qkv));
    h.gather_kv(ref);
    upload_floats(ref, h.dout, download_floats(dev, d.dout));
    forward(ref, h);
    backward(ref, h);
    // The op-test registry's tolerances for bf16 attention (tests/common/op_registry.cpp).
    const double out_err = relative_error(download_floats(dev, d.out), download_floats(ref, h.out));
    const double lse_err = relative_error(download_floats(dev, d.lse), download_floats(ref, h.lse));
    double dqkv_err = relative_error(download_floats(dev, d.dqkv), download_floats(ref, h.dqkv));
    if (d.dkv_all.defined()) {
      dqkv_err = std::max(dqkv_err, relative_error(download_floats(dev, d.dkv_all),
                                                   download_floats(ref, h.dkv_all)));
    }
    r.rel_err = p.backward ? dqkv_err : out_err;
    if (!(out_err <= 2e-2 && lse_err <= 1e-3 && dqkv_err <= 3e-2)) {
      r.failure = fmt::format(
          "T={} H={} KV={} against the CPU reference: out {:.3g} (max 2e-2), "
          "lse {:.3g} (1e-3), dqkv {:.3g} (3e-2)",
          s.seq, s.heads, s.kv_heads, out_err, lse_err, dqkv_err);
      return r;
    }
  }
  if (!p.backward && p.segments == 1) {  // full size: sampled query rows against the host, in double
    const AttentionTensors d = allocate(dev, p, ctx.dtype, 41);
    const AttentionShape& s = d.shape;
    dev.attention_forward(d.out, d.lse, d.qkv, s);
    const std::vector<float> qkv = download_floats(dev, d.qkv), out = download_floats(dev, d.out);
    const std::vector<float> lse = download_floats(dev, d.lse);
    for (int i = 0; i < kSampledRows; ++i) {
      // Rows spread over the sequence (first and last tokens included) and over heads.
      const int64_t b = i % s.batch, h = (i * 7) % s.heads;
      const int64_t t = i == 0 ? 0 : i == kSampledRows - 1 ? s.seq - 1 : s.seq * i / kSampledRows;
      std::vector<double> want;
      double want_lse = 0;
      host_attention_row(p, qkv, b, t, h, want, want_lse);
      std::vector<float> got(s.head_dim), ref(s.head_dim);
      for (int64_t k = 0; k < s.head_dim; ++k) {
        got[k] = out[(b * s.seq + t) * s.heads * s.head_dim + h * s.head_dim + k];
        ref[k] = static_cast<float>(want[k]);
      }
      const double err = relative_error(got, ref);
      const double lse_err = std::fabs(lse[(b * s.heads + h) * s.seq + t] - want_lse);
      // FP8 attention against exact attention: its codes keep 3 mantissa bits (up to 6% a
      // value), so a score (the lse of a row that sees one key) is off by a few percent of the
      // products' sum: about 0.04 nats at one standard deviation on these inputs.
      const double max_err = p.fp8 ? 8e-2 : 3e-2, max_lse_err = p.fp8 ? 0.25 : 1e-2;
      if (!(err <= max_err && lse_err <= max_lse_err)) {
        r.failure = fmt::format(
            "full size: query (b={}, t={}, h={}) output off by {:.3g} "
            "(relative), lse by {:.3g}",
            b, t, h, err, lse_err);
        return r;
      }
    }
  }
  r.ok = true;
  return r;
}

AttentionResult run_attention(BenchContext& ctx, const AttentionProblem& p) {
  AttentionResult r;
  try {
    r.check = check_attention(ctx, p);
    if (!r.check.ok) return r;
    const int sets = rotation_sets(set_bytes(p, ctx.dtype), ctx.cache_bytes, ctx.budget_bytes);
    std::vector<AttentionTensors> tensors;
    for (int s = 0; s < sets; ++s) {
      tensors.push_back(allocate(*ctx.device, p, ctx.dtype, 100 + 10 * s));
      const AttentionTensors& t = tensors.back();
      if (p.backward) forward(*ctx.device, t);  // its input
    }
    r.timing = measure(
        *ctx.device, [&](int i) { run(*ctx.device, p, tensors[i % sets]); }, ctx.warmup, ctx.iters);
    r.tflops = p.flops() / (r.timing.median_ms * 1e-3) / 1e12;
  } catch (const Error& e) {
    r.check.ok = false;
    r.check.failure = e.what();
  }
  return r;
}

int attention_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print("{}", kUsage);
    return 0;
  }
  std::set<std::string> valued = kCommonOptions;
  valued.insert({"seqs", "head_dims", "heads", "kv_heads", "masks", "window", "document_length",
                 "tokens", "batch", "passes", "attention_backend", "deterministic_mode",
                 "context_parallel_size", "fp8_dot_product_attention"});
  const CommandArgs a(args, valued, {}, false);
  BenchContext ctx = make_context(context_options(a));
  const int64_t heads = a.get_int("heads", 32), window = a.get_int("window", 4096);
  const int64_t document_length = a.get_int("document_length", 2048);
  if (document_length <= 0)
    throw ConfigError("command line", "document_length", std::to_string(document_length), "a positive token count");
  const int64_t tokens = a.get_int("tokens", 16384);
  const int64_t segments = a.get_int("context_parallel_size", 2);
  const std::string fp8_text = a.get("fp8_dot_product_attention", "false");
  if (fp8_text != "true" && fp8_text != "false")
    throw ConfigError("command line", "fp8_dot_product_attention", fp8_text, "true or false");
  const bool fp8 = fp8_text == "true";
  if (segments < 2)
    throw ConfigError("command line", "context_parallel_size", std::to_string(segments), "2 or more");
  std::vector<AttentionProblem> problems;
  for (const std::string& pass : a.get_list("passes", {"forward", "backward"})) {
    if (pass != "forward" && pass != "backward")
      throw ConfigError("command line", "passes", pass, "forward and/or backward");
    for (int64_t kv : a.get_int_list("kv_heads", {8})) {
      if (heads % kv != 0)
        throw ConfigError("command line", "kv_heads", std::to_string(kv),
                          fmt::format("a divisor of --heads {}", heads));
      // FP8 attention takes heads of 128 only.
      for (int64_t d : a.get_int_list(
               "head_dims", fp8 ? std::vector<int64_t>{128} : std::vector<int64_t>{64, 128})) {
        if (fp8 && d != 128)
          throw ConfigError("command line", "head_dims", std::to_string(d),
                            "128 with --fp8_dot_product_attention true");
        for (const std::string& mask : a.get_list("masks", {"causal", "full", "window"})) {
          if (mask != "causal" && mask != "full" && mask != "window" && mask != "packed" && mask != "cp")
            throw ConfigError("command line", "masks", mask, "causal, full, window, packed and/or cp");
          for (int64_t t : a.get_int_list("seqs", {1024, 2048, 4096, 8192, 16384, 32768})) {
            if (mask == "window" && window >= t) continue;
            if (mask == "packed" && document_length >= t) continue;
            if (mask == "cp" && fp8)
              throw ConfigError("command line", "fp8_dot_product_attention", fp8_text,
                                "false with the cp mask: context parallelism's attention is bf16");
            if (mask == "cp" && t % (2 * segments) != 0)
              throw ConfigError("command line", "seqs", std::to_string(t),
                                fmt::format("multiples of 2 x --context_parallel_size = {} with cp", 2 * segments));
            AttentionProblem p;
            p.batch = a.get_int("batch", std::max<int64_t>(1, tokens / t));
            p.seq = t, p.heads = heads, p.kv_heads = kv, p.head_dim = d;
            p.causal = mask != "full";
            p.window = mask == "window" ? window : 0;
            p.document_length = mask == "packed" ? document_length : 0;
            p.segments = mask == "cp" ? segments : 1;
            p.fp8 = fp8;
            p.backward = pass == "backward";
            problems.push_back(p);
          }
        }
      }
    }
  }

  const double peak = ctx.spec ? analysis::peak_tflops(*ctx.spec, dtype_name(ctx.dtype)) : 0;
  analysis::Table t;
  t.name = "bench_attention";
  t.title = fmt::format("Attention ({} kernels) on {}", a.get("attention_backend", "auto"),
                        ctx.description);
  t.note = fmt::format(
      "{} q/k/v; median of {} samples after {} warm-up calls; TFLOP/s with forward = 4*B*H*D*"
      "pairs (causal T^2/2, full T^2, window: exact band, packed: L^2/2 per document; cp: the "
      "whole sequence's, over every segment's share), backward "
      "= 2.5x forward; {}.",
      dtype_name(ctx.dtype), ctx.iters, ctx.warmup,
      peak_note(ctx, peak, std::string(dtype_name(ctx.dtype)) + " peak", "TFLOP/s"));
  t.columns = {{"pass", true},  {"mask", true},     {"batch", true},    {"seq", true},
               {"heads", true}, {"kv_heads", true}, {"head_dim", true}, {"median_ms"},
               {"tflops"},      {"pct_of_peak"},    {"check_rel_err"},  {"status"}};
  analysis::StatusLine status(static_cast<int>(problems.size()));
  int failures = 0;
  for (const AttentionProblem& p : problems) {
    const std::string pass = p.backward ? "backward" : "forward";
    status.step(fmt::format("{} {} B={} T={} H={} KV={} D={}", pass, p.mask(), p.batch, p.seq,
                            p.heads, p.kv_heads, p.head_dim));
    std::vector<analysis::Cell> row = {pass,    p.mask(),   p.batch,   p.seq,
                                       p.heads, p.kv_heads, p.head_dim};
    const AttentionResult r = run_attention(ctx, p);
    if (!r.check.ok) {
      ++failures;
      row.insert(row.end(), {analysis::Cell{}, analysis::Cell{}, analysis::Cell{}, r.check.rel_err,
                             "FAILED: " + r.check.failure});
    } else {
      row.insert(row.end(),
                 {r.timing.median_ms, r.tflops, analysis::cell_or_empty(percent_of(r.tflops, peak)),
                  r.check.rel_err, std::string("ok")});
    }
    t.rows.push_back(row);
  }
  const double seconds = status.finish();
  std::string md = analysis::markdown_table(t);
  md += fmt::format(
      "\n{} attention problems checked and timed in {:.1f} s{}.\n", problems.size(), seconds,
      failures ? fmt::format("; {} FAILED their check (no timing reported)", failures) : "");
  analysis::print_and_write(a.get("output", ""), {t}, "bench_attention.md", md);
  return failures ? kExitRuntimeFailure : 0;
}

}  // namespace tessera::bench
