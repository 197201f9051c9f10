#include "tessera/model/fp8_linears.h"

#include <algorithm>
#include <cmath>

#include "tessera/core/fp8.h"

namespace tessera {
namespace {

constexpr size_t kAlign = 256;

// Offsets of every tensor in the one buffer; the constructor and plan_bytes share it.
struct Fp8Plan {
  size_t bytes = 0;
  size_t add(size_t n) {
    const size_t at = bytes;
    bytes += (n + kAlign - 1) / kAlign * kAlign;
    return at;
  }
};

struct Fp8Offsets {
  size_t fwd_history, fwd_scale, fwd_scale_inv, fwd_scale_inv_gemm, bwd_history, bwd_scale,
      bwd_scale_inv, bwd_scale_inv_gemm, status;
  std::vector<size_t> cache, cache_t;
  size_t weight_scratch = 0, x_codes, dy_codes, dy_codes_t;
  // Blockwise: the scale_inv of every cast (Fp8BlockScales), for the weights per linear with
  // the cache (else of the one weight in flight).
  std::vector<size_t> cache_scales, cache_t_scales;
  size_t weight_scales = 0, weight_t_scales = 0, x_scales = 0, dy_scales = 0, dy_t_scales = 0;
  size_t bytes;
  int64_t max_weight = 0, max_x = 0, max_dy = 0;  // over the linears: what the buffers fit
  int64_t max_w_scales = 0, max_w_t_scales = 0, max_x_scales = 0, max_dy_scales = 0,
          max_dy_t_scales = 0;
};

bool blockwise(const Fp8Options& o) {
  return o.recipe == Fp8Recipe::Blockwise;
}

// Scale counts of a linear's casts under blockwise scaling (core/fp8.h layouts): its weight
// (out, in) and transpose in 128x128 blocks, its input (rows, in) in 1x128 tiles for the
// forward and transposed (in, rows) for the weight gradient, its output gradient (rows, out)
// and transposed (out, rows).
struct BlockScaleCounts {
  int64_t w, w_t, x, x_t, dy, dy_t;
};
BlockScaleCounts block_scale_counts(const Fp8LinearShape& l, int64_t rows) {
  return {fp8_scale_count(Fp8Scaling::Block128x128, l.out, l.in),
          fp8_scale_count(Fp8Scaling::Block128x128, l.in, l.out),
          fp8_scale_count(Fp8Scaling::Tile1x128, rows, l.in),
          fp8_scale_count(Fp8Scaling::Tile1x128, l.in, rows),
          fp8_scale_count(Fp8Scaling::Tile1x128, rows, l.out),
          fp8_scale_count(Fp8Scaling::Tile1x128, l.out, rows)};
}

// Blockwise scaling keeps no history; its (unused) per-tensor state is one row.
int64_t history_rows(const Fp8Options& o) {
  return o.recipe == Fp8Recipe::Delayed ? o.amax_history_len : 1;
}

// Forward columns: (input, weight) per linear, (input, every expert's weight) per expert stack.
int64_t forward_columns(const Fp8LinearShape& l) {
  return l.expert_stack() ? 1 + l.experts : 2;
}

// The codes a linear's weight has on this rank: all of it, or its local experts'.
int64_t weight_elements(const Fp8LinearShape& l) {
  return (l.expert_stack() ? l.local_experts : 1) * l.out * l.in;
}

Fp8Offsets plan_offsets(const Fp8Options& o, const std::vector<Fp8LinearShape>& linears,
                        int64_t rows) {
  Fp8Plan p;
  Fp8Offsets f;
  const size_t L = linears.size(), H = static_cast<size_t>(history_rows(o));
  size_t F = 0;
  for (const auto& l : linears) F += static_cast<size_t>(forward_columns(l));
  f.fwd_history = p.add(H * F * sizeof(float));
  f.fwd_scale = p.add(F * sizeof(float));
  f.fwd_scale_inv = p.add(F * sizeof(float));
  f.fwd_scale_inv_gemm = p.add(F * Fp8Linears::kScaleInvPitch * sizeof(float));
  f.bwd_history = p.add(H * L * sizeof(float));
  f.bwd_scale = p.add(L * sizeof(float));
  f.bwd_scale_inv = p.add(L * sizeof(float));
  f.bwd_scale_inv_gemm = p.add(L * Fp8Linears::kScaleInvPitch * sizeof(float));
  f.status = p.add(sizeof(float));
  const bool blocks = blockwise(o);
  for (const auto& l : linears) {
    const int64_t l_rows = l.rows > 0 ? l.rows : rows;
    f.max_weight = std::max(f.max_weight, weight_elements(l));
    f.max_x = std::max(f.max_x, l_rows * l.in);
    f.max_dy = std::max(f.max_dy, l_rows * l.out);
    const BlockScaleCounts n = block_scale_counts(l, rows);
    f.max_w_scales = std::max(f.max_w_scales, n.w);
    f.max_w_t_scales = std::max(f.max_w_t_scales, n.w_t);
    f.max_x_scales = std::max({f.max_x_scales, n.x, n.x_t});
    f.max_dy_scales = std::max(f.max_dy_scales, n.dy);
    f.max_dy_t_scales = std::max(f.max_dy_t_scales, n.dy_t);
    if (o.weight_cache) {
      f.cache.push_back(p.add(static_cast<size_t>(weight_elements(l))));
      f.cache_t.push_back(p.add(static_cast<size_t>(weight_elements(l))));
      if (blocks) {
        f.cache_scales.push_back(p.add(static_cast<size_t>(n.w) * sizeof(float)));
        f.cache_t_scales.push_back(p.add(static_cast<size_t>(n.w_t) * sizeof(float)));
      }
    }
  }
  if (!o.weight_cache) {
    f.weight_scratch = p.add(static_cast<size_t>(f.max_weight));
    if (blocks) {
      f.weight_scales = p.add(static_cast<size_t>(f.max_w_scales) * sizeof(float));
      f.weight_t_scales = p.add(static_cast<size_t>(f.max_w_t_scales) * sizeof(float));
    }
  }
  f.x_codes = p.add(static_cast<size_t>(f.max_x));
  f.dy_codes = p.add(static_cast<size_t>(f.max_dy));
  f.dy_codes_t = p.add(static_cast<size_t>(f.max_dy));
  if (blocks) {
    f.x_scales = p.add(static_cast<size_t>(f.max_x_scales) * sizeof(float));
    f.dy_scales = p.add(static_cast<size_t>(f.max_dy_scales) * sizeof(float));
    f.dy_t_scales = p.add(static_cast<size_t>(f.max_dy_t_scales) * sizeof(float));
  }
  f.bytes = p.bytes;
  return f;
}

}  // namespace

Fp8Options fp8_options(const TrainingConfig& t) {
  Fp8Options o;
  o.mode = t.fp8;
  o.recipe = t.fp8_recipe;
  o.amax_history_len = t.fp8_amax_history_len;
  o.amax_algo = t.fp8_amax_compute_algo;
  o.margin = static_cast<int>(t.fp8_margin);
  o.lm_head = t.fp8_lm_head;
  o.weight_cache = t.fp8_weight_transpose_cache;
  o.fast_accum_fprop = !t.fp8_gemm_fprop_split_accumulator;
  o.fast_accum_dgrad = !t.fp8_gemm_dgrad_split_accumulator;
  o.fast_accum_wgrad = !t.fp8_gemm_wgrad_split_accumulator;
  // cuBLASLt's block-scaled kernels promote every 128-deep partial sum to fp32 themselves and
  // take no fast-accumulation flag.
  if (t.fp8_recipe == Fp8Recipe::Blockwise)
    o.fast_accum_fprop = o.fast_accum_dgrad = o.fast_accum_wgrad = false;
  return o;
}

std::string fast_accumulation_kinds(const Fp8Options& o, std::string_view separator) {
  std::string kinds;
  for (const auto& [fast, name] :
       {std::pair{o.fast_accum_fprop, "fprop"}, std::pair{o.fast_accum_dgrad, "dgrad"},
        std::pair{o.fast_accum_wgrad, "wgrad"}})
    if (fast) kinds += (kinds.empty() ? "" : std::string(separator)) + name;
  return kinds.empty() ? "none" : kinds;
}

size_t Fp8Linears::plan_bytes(const Fp8Options& options, const std::vector<Fp8LinearShape>& linears,
                              int64_t rows) {
  return plan_offsets(options, linears, rows).bytes;
}

Fp8Linears::Fp8Linears(Backend& backend, const Fp8Options& options,
                       std::vector<Fp8LinearShape> linears, int64_t rows)
    : backend_(backend), options_(options), linears_(std::move(linears)), rows_(rows) {
  // The backend's FP8 GEMMs take dimensions in multiples of fp8_gemm_multiple() (M, N and K of
  // the forward, dgrad and wgrad GEMMs: tokens, in and out; the trainer checks the tokens);
  // block-scaled ones whole blocks.
  const int64_t multiple = blockwise() ? kFp8BlockSize : backend_.fp8_gemm_multiple();
  for (const auto& l : linears_) {
    TS_CHECK(!(blockwise() && l.expert_stack()), "fp8 {}: blockwise scaling has no expert stacks",
             l.name);
    if (l.out % multiple != 0 || l.in % multiple != 0)
      throw ConfigError("model", blockwise() ? "fp8_recipe" : "fp8",
                        blockwise() ? "blockwise" : "on",
                        format_message("FP8 linear layers whose dimensions are multiples of {}; {} "
                                       "is ({}, {}). Change the model width, or fp8: null",
                                       multiple, l.name, l.out, l.in));
  }
  if (blockwise() && rows_ % kFp8BlockSize != 0)
    throw ConfigError("configuration", "fp8_recipe", "blockwise",
                      format_message("tokens per micro batch (and output-head chunk) a multiple of "
                                     "128 with blockwise scaling; the FP8 GEMMs see {} rows",
                                     rows_));
  const Fp8Offsets f = plan_offsets(options_, linears_, rows_);
  buffer_ = DeviceBuffer(backend_, f.bytes, "fp8 scaling state and casts");
  const int64_t L = static_cast<int64_t>(linears_.size()), H = history_rows(options_);
  int64_t F = 0;
  for (const auto& l : linears_) fwd_column_.push_back(F), F += forward_columns(l);
  fwd_ = {buffer_.tensor(DType::F32, {H, F}, f.fwd_history),
          buffer_.tensor(DType::F32, {F}, f.fwd_scale),
          buffer_.tensor(DType::F32, {F}, f.fwd_scale_inv),
          buffer_.tensor(DType::F32, {F, kScaleInvPitch}, f.fwd_scale_inv_gemm), DType::E4M3};
  bwd_ = {buffer_.tensor(DType::F32, {H, L}, f.bwd_history),
          buffer_.tensor(DType::F32, {L}, f.bwd_scale),
          buffer_.tensor(DType::F32, {L}, f.bwd_scale_inv),
          buffer_.tensor(DType::F32, {L, kScaleInvPitch}, f.bwd_scale_inv_gemm),
          options_.grad_format()};
  status_ = buffer_.tensor(DType::F32, {1}, f.status);
  for (const Group* g : {&fwd_, &bwd_}) {  // Transformer Engine's initial state
    backend_.fill(g->history, 0.0f);
    backend_.fill(g->scale, 1.0f);
    backend_.fill(g->scale_inv, 1.0f);
    backend_.fill(g->scale_inv_gemm, 1.0f);
  }
  backend_.fill(status_, 0.0f);
  for (size_t i = 0; i < linears_.size() && options_.weight_cache; ++i) {
    const Fp8LinearShape& l = linears_[i];
    const int64_t n = l.expert_stack() ? l.local_experts : 1;
    weight_cache_.push_back(buffer_.tensor(DType::E4M3, {n * l.out, l.in}, f.cache[i]));
    weight_cache_t_.push_back(buffer_.tensor(DType::E4M3, {n * l.in, l.out}, f.cache_t[i]));
  }
  cache_valid_.assign(linears_.size(), false);
  if (!options_.weight_cache)
    weight_scratch_ = buffer_.tensor(DType::E4M3, {f.max_weight}, f.weight_scratch);
  x_codes_ = buffer_.tensor(DType::E4M3, {f.max_x}, f.x_codes);
  dy_codes_ = buffer_.tensor(options_.grad_format(), {f.max_dy}, f.dy_codes);
  dy_codes_t_ = buffer_.tensor(options_.grad_format(), {f.max_dy}, f.dy_codes_t);
  if (!blockwise()) return;
  for (size_t i = 0; i < linears_.size() && options_.weight_cache; ++i) {
    const BlockScaleCounts n = block_scale_counts(linears_[i], rows_);
    cache_scales_.push_back(buffer_.tensor(DType::F32, {n.w}, f.cache_scales[i]));
    cache_t_scales_.push_back(buffer_.tensor(DType::F32, {n.w_t}, f.cache_t_scales[i]));
  }
  if (!options_.weight_cache) {
    weight_scales_ = buffer_.tensor(DType::F32, {f.max_w_scales}, f.weight_scales);
    weight_t_scales_ = buffer_.tensor(DType::F32, {f.max_w_t_scales}, f.weight_t_scales);
  }
  x_scales_ = buffer_.tensor(DType::F32, {f.max_x_scales}, f.x_scales);
  dy_scales_ = buffer_.tensor(DType::F32, {f.max_dy_scales}, f.dy_scales);
  dy_t_scales_ = buffer_.tensor(DType::F32, {f.max_dy_t_scales}, f.dy_t_scales);
}

std::pair<Tensor, Tensor> Fp8Linears::block_weight(int i, const Tensor& weight, bool transposed) {
  const Fp8LinearShape& l = linears_[i];
  const BlockScaleCounts n = block_scale_counts(l, rows_);
  Fp8BlockCastArgs c;
  c.x = weight;
  c.scaling = Fp8Scaling::Block128x128;
  c.nonfinite = status_;
  if (options_.weight_cache) {
    if (!cache_valid_[i]) {
      c.out = weight_cache_[i];
      c.out_scale_inv = cache_scales_[i];
      c.out_t = weight_cache_t_[i];
      c.out_t_scale_inv = cache_t_scales_[i];
      backend_.fp8_block_cast(c);
      cache_valid_[i] = true;
    }
    return transposed ? std::pair{weight_cache_t_[i], cache_t_scales_[i]}
                      : std::pair{weight_cache_[i], cache_scales_[i]};
  }
  const Tensor codes = weight_scratch_.flat_range(0, l.out * l.in)
                           .view(transposed ? Shape{l.in, l.out} : Shape{l.out, l.in});
  const Tensor scales =
      transposed ? weight_t_scales_.flat_range(0, n.w_t) : weight_scales_.flat_range(0, n.w);
  (transposed ? c.out_t : c.out) = codes;
  (transposed ? c.out_t_scale_inv : c.out_scale_inv) = scales;
  backend_.fp8_block_cast(c);
  return {codes, scales};
}

void Fp8Linears::forward_blockwise(int i, const Tensor& out, const Tensor& in, const Tensor& weight,
                                   const Tensor& bias, float beta, const Tensor& residual) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t rows = in.numel() / l.in;
  const BlockScaleCounts n = block_scale_counts(l, rows);
  Fp8BlockCastArgs c;
  c.x = in.view({rows, l.in});
  c.scaling = Fp8Scaling::Tile1x128;
  c.out = x_codes_.flat_range(0, rows * l.in).view({rows, l.in});
  c.out_scale_inv = x_scales_.flat_range(0, n.x);
  c.nonfinite = status_;
  backend_.fp8_block_cast(c);
  const auto [w, w_scales] = block_weight(i, weight, false);
  Fp8MatmulArgs m;
  m.out = out;
  m.a = c.out;
  m.a_scale_inv = c.out_scale_inv;
  m.a_scaling = Fp8Scaling::Tile1x128;
  m.b = w;
  m.b_scale_inv = w_scales;
  m.b_scaling = Fp8Scaling::Block128x128;
  m.beta = beta;
  m.c = residual;
  m.bias = bias;
  backend_.matmul_fp8(m);  // block-scaled GEMMs accumulate in full fp32
}

void Fp8Linears::backward_blockwise(int i, const Tensor& din, const Tensor& dout, const Tensor& in,
                                    const Tensor& weight, const Tensor& dweight,
                                    float dweight_beta) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t rows = dout.numel() / l.out;
  const BlockScaleCounts n = block_scale_counts(l, rows);
  // dY in 1x128 tiles along out (dgrad's K) and, transposed, along the tokens (wgrad's K).
  Fp8BlockCastArgs g;
  g.x = dout.view({rows, l.out});
  g.scaling = Fp8Scaling::Tile1x128;
  g.out = dy_codes_.flat_range(0, rows * l.out).view({rows, l.out});
  g.out_scale_inv = dy_scales_.flat_range(0, n.dy);
  g.out_t = dy_codes_t_.flat_range(0, rows * l.out).view({l.out, rows});
  g.out_t_scale_inv = dy_t_scales_.flat_range(0, n.dy_t);
  g.nonfinite = status_;
  backend_.fp8_block_cast(g);
  if (din.defined()) {
    const auto [w_t, w_t_scales] = block_weight(i, weight, true);
    Fp8MatmulArgs d;
    d.out = din;
    d.a = g.out;
    d.a_scale_inv = g.out_scale_inv;
    d.a_scaling = Fp8Scaling::Tile1x128;
    d.b = w_t;
    d.b_scale_inv = w_t_scales;
    d.b_scaling = Fp8Scaling::Block128x128;
    backend_.matmul_fp8(d);
  }
  if (!dweight.defined()) return;  // a frozen weight (LoRA's base)
  // X transposed, in tiles along the tokens, from the stored bf16 input.
  Fp8BlockCastArgs x;
  x.x = in.view({rows, l.in});
  x.scaling = Fp8Scaling::Tile1x128;
  x.out_t = x_codes_.flat_range(0, rows * l.in).view({l.in, rows});
  x.out_t_scale_inv = x_scales_.flat_range(0, n.x_t);
  x.nonfinite = status_;
  backend_.fp8_block_cast(x);
  Fp8MatmulArgs w;
  w.out = dweight;
  w.a = g.out_t;
  w.a_scale_inv = g.out_t_scale_inv;
  w.a_scaling = Fp8Scaling::Tile1x128;
  w.b = x.out_t;
  w.b_scale_inv = x.out_t_scale_inv;
  w.b_scaling = Fp8Scaling::Tile1x128;
  w.beta = dweight_beta;
  backend_.matmul_fp8(w);
}

bool Fp8Linears::just_in_time() const {
  return options_.recipe == Fp8Recipe::Tensorwise || !have_history_;
}

void Fp8Linears::update_scales(const Group& g, int64_t slot, int64_t slots, const Tensor& history,
                               bool most_recent, bool roll) {
  Fp8ScaleUpdateArgs u;
  u.amax_history = history;
  u.scale = g.scale.flat_range(slot, slots);
  u.scale_inv = g.scale_inv.flat_range(slot, slots);
  u.nonfinite = status_;
  u.fp8_max = fp8_max(g.format);
  u.margin = options_.margin;
  u.most_recent = most_recent;
  u.roll = roll;
  backend_.fp8_update_scales(u);
  copy_scale_inv_to_gemm(g, slot, slots);
}

void Fp8Linears::copy_scale_inv_to_gemm(const Group& g, int64_t slot, int64_t slots) {
  backend_.copy_columns(g.scale_inv_gemm.flat_range(slot * kScaleInvPitch, slots * kScaleInvPitch)
                            .view({slots, kScaleInvPitch}),
                        0, g.scale_inv.flat_range(slot, slots).view({slots, 1}), 0, 1);
}

void Fp8Linears::state_restored() {
  have_history_ = true;
  for (const Group* g : {&fwd_, &bwd_}) copy_scale_inv_to_gemm(*g, 0, g->scale_inv.numel());
}

void Fp8Linears::cast(const Group& g, int64_t slot, const Tensor& x, const Tensor& out,
                      const Tensor& out_t, bool record) {
  Fp8CastArgs c;
  c.x = x;
  c.scale = g.scale.flat_range(slot, 1);
  const Tensor amax = g.history.flat_range(slot, 1);  // row 0
  if (record && just_in_time()) {
    // Tensorwise: this tensor's amax alone; delayed before the first update: the max over
    // the step so far (micro-batches and recomputes of the same tensor).
    if (options_.recipe == Fp8Recipe::Tensorwise) backend_.fill(amax, 0.0f);
    Fp8CastArgs a;
    a.x = x;
    a.amax = amax;
    backend_.fp8_cast_transpose(a);
    update_scales(g, slot, 1, amax.view({1, 1}), /*most_recent=*/true, /*roll=*/false);
  } else if (record) {
    c.amax = amax;
  }
  c.out = out;
  c.out_t = out_t;
  backend_.fp8_cast_transpose(c);
}

// cast() over row groups: `slots` consecutive scaling slots from `slot`, one per group (an
// expert stack's weights) or one for all groups (activations).
void Fp8Linears::cast_groups(const Group& g, int64_t slot, int64_t slots, Fp8GroupedCastArgs c,
                             bool record) {
  c.scale = g.scale.flat_range(slot, slots);
  const Tensor amax = g.history.flat_range(slot, slots);  // row 0
  if (record && just_in_time()) {
    if (options_.recipe == Fp8Recipe::Tensorwise) backend_.fill(amax, 0.0f);
    Fp8GroupedCastArgs a = c;
    a.out = a.out_t = Tensor{};
    a.amax = amax;
    backend_.fp8_grouped_cast(a);
    update_scales(g, slot, slots, amax.view({1, slots}), /*most_recent=*/true, /*roll=*/false);
  } else if (record) {
    c.amax = amax;
  }
  if (c.out.defined() || c.out_t.defined()) backend_.fp8_grouped_cast(c);
}

// Weight i's codes, (out, in) or transposed (in, out). The weight's amax counts once per
// cast of its values; a transposed re-cast (no cache) reuses the forward's scale.
Tensor Fp8Linears::weight_codes(int i, const Tensor& weight, bool transposed) {
  const Fp8LinearShape& l = linears_[i];
  if (options_.weight_cache) {
    if (!cache_valid_[i]) {
      cast(fwd_, weight_slot(i), weight, weight_cache_[i], weight_cache_t_[i], true);
      cache_valid_[i] = true;
    }
    return transposed ? weight_cache_t_[i] : weight_cache_[i];
  }
  const Tensor dst = weight_scratch_.flat_range(0, l.out * l.in)
                         .view(transposed ? Shape{l.in, l.out} : Shape{l.out, l.in});
  cast(fwd_, weight_slot(i), weight, transposed ? Tensor{} : dst, transposed ? dst : Tensor{},
       !transposed);
  return dst;
}

void Fp8Linears::forward(int i, const Tensor& out, const LinearOperand& in, const Tensor& weight,
                         const Tensor& bias, float beta, const Tensor& residual) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t rows = in.x.numel() / l.in;
  TS_CHECK(rows <= rows_ && in.x.numel() == rows * l.in,
           "fp8 {}: input {} is not (rows <= {}, {})", l.name, in.x.shape.str(), rows_, l.in);
  TS_CHECK(!in.cast || input_cast(i, rows).out.defined(),
           "fp8 {}: an input cast by its producer where the forward casts its own", l.name);
  if (blockwise()) return forward_blockwise(i, out, in.x, weight, bias, beta, residual);
  const Tensor x = x_codes_.flat_range(0, rows * l.in).view({rows, l.in});
  if (!in.cast) cast(fwd_, input_slot(i), in.x, x, {}, true);
  const Tensor w = weight_codes(i, weight, false);
  Fp8MatmulArgs m;
  m.out = out;
  m.a = x;
  m.b = w;
  m.a_scale_inv = scale_inv(fwd_, input_slot(i));
  m.b_scale_inv = scale_inv(fwd_, weight_slot(i));
  m.beta = beta;
  m.c = residual;
  m.bias = bias;
  m.fast_accum = options_.fast_accum_fprop;
  backend_.matmul_fp8(m);
}

bool Fp8Linears::producer_casts(int i, int64_t rows) const {
  return !blockwise() && !just_in_time() && !linears_[i].expert_stack() && rows <= rows_;
}

Fp8CastArgs Fp8Linears::input_cast(int i, int64_t rows) const {
  const Fp8LinearShape& l = linears_[i];
  if (!producer_casts(i, rows)) return {};
  Fp8CastArgs c;
  c.out = x_codes_.flat_range(0, rows * l.in).view({rows, l.in});
  c.scale = fwd_.scale.flat_range(input_slot(i), 1);
  c.amax = fwd_.history.flat_range(input_slot(i), 1);  // row 0, as cast() records it
  return c;
}

Fp8CastArgs Fp8Linears::output_grad_cast(int i, int64_t rows) const {
  const Fp8LinearShape& l = linears_[i];
  if (!producer_casts(i, rows)) return {};
  Fp8CastArgs c;
  c.out = dy_codes_.flat_range(0, rows * l.out).view({rows, l.out});
  c.out_t = dy_codes_t_.flat_range(0, rows * l.out).view({l.out, rows});
  c.scale = bwd_.scale.flat_range(i, 1);
  c.amax = bwd_.history.flat_range(i, 1);  // row 0, as cast() records it
  return c;
}

void Fp8Linears::backward(int i, const Tensor& din, const LinearOperand& dout,
                          const LinearOperand& in, const Tensor& weight, const Tensor& dweight,
                          float dweight_beta) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t rows = dout.x.numel() / l.out;
  const Tensor& x = in.codes_t.defined() ? in.codes_t : in.x;
  TS_CHECK(rows <= rows_ && dout.x.numel() == rows * l.out && x.numel() == rows * l.in,
           "fp8 {}: dout {} / in {} are not ({} rows of {} / {})", l.name, dout.x.shape.str(),
           x.shape.str(), rows, l.out, l.in);
  TS_CHECK(!dout.cast || output_grad_cast(i, rows).out.defined(),
           "fp8 {}: an output gradient cast by its producer where the backward casts its own",
           l.name);
  TS_CHECK(!in.codes_t.defined() || (input_cast(i, rows).out.defined() && x.dtype == DType::E4M3 &&
                                     x.shape == Shape{l.in, rows}),
           "fp8 {}: transposed input codes {} {} where the backward casts its input itself", l.name,
           dtype_name(x.dtype), x.shape.str());
  if (blockwise()) return backward_blockwise(i, din, dout.x, in.x, weight, dweight, dweight_beta);
  const Tensor dy = dy_codes_.flat_range(0, rows * l.out).view({rows, l.out});
  const Tensor dy_t = dy_codes_t_.flat_range(0, rows * l.out).view({l.out, rows});
  if (!dout.cast) cast(bwd_, i, dout.x, dy, dy_t, true);
  if (din.defined()) {
    Fp8MatmulArgs d;
    d.out = din;
    d.a = dy;
    d.b = weight_codes(i, weight, true);
    d.a_scale_inv = scale_inv(bwd_, i);
    d.b_scale_inv = scale_inv(fwd_, weight_slot(i));
    d.fast_accum = options_.fast_accum_dgrad;
    backend_.matmul_fp8(d);
  }
  if (!dweight.defined()) return;  // a frozen weight (LoRA's base)
  // The input's transpose with the scale its forward cast used (same values, same codes):
  // kept from the forward, or cast now from the kept input.
  Tensor x_t = in.codes_t;
  if (!x_t.defined()) {
    x_t = x_codes_.flat_range(0, rows * l.in).view({l.in, rows});
    cast(fwd_, input_slot(i), in.x, {}, x_t, false);
  }
  Fp8MatmulArgs w;
  w.out = dweight;
  w.a = dy_t;
  w.b = x_t;
  w.a_scale_inv = scale_inv(bwd_, i);
  w.b_scale_inv = scale_inv(fwd_, input_slot(i));
  w.beta = dweight_beta;
  w.fast_accum = options_.fast_accum_wgrad;
  backend_.matmul_fp8(w);
}

Tensor Fp8Linears::expert_codes(int i, const Tensor& weight, int64_t first_expert,
                                bool transposed) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t E = l.local_experts, n = l.out * l.in;
  TS_CHECK(weight.numel() == E * n && first_expert >= 0 && first_expert + E <= l.experts,
           "fp8 {}: weight {} from expert {} is not {} of the {} experts' ({}, {})", l.name,
           weight.shape.str(), first_expert, E, l.experts, l.out, l.in);
  // One launch for all experts: the stack as E groups of `out` rows, each expert with its
  // own slot; the transposes (E, in, out) are the groups' transposed blocks.
  auto cast_all = [&](const Tensor& codes, const Tensor& codes_t, bool record) {
    Fp8GroupedCastArgs c;
    c.x = weight.view({E * l.out, l.in});
    c.group_rows = l.out;
    if (codes.defined()) c.out = codes.flat_range(0, E * n).view({E * l.out, l.in});
    if (codes_t.defined()) c.out_t = codes_t.flat_range(0, E * n);
    cast_groups(fwd_, expert_slot(i, first_expert), E, c, record);
  };
  const Shape shape = transposed ? Shape{E, l.in, l.out} : Shape{E, l.out, l.in};
  if (options_.weight_cache) {
    if (!cache_valid_[i]) {
      cast_all(weight_cache_[i], weight_cache_t_[i], true);
      cache_valid_[i] = true;
    }
    return (transposed ? weight_cache_t_[i] : weight_cache_[i]).view(shape);
  }
  // Without the cache: cast for the GEMM at hand; a transposed re-cast reuses the forward's
  // scales (the weights' amaxes count once per forward).
  const Tensor dst = weight_scratch_.flat_range(0, E * n);
  cast_all(transposed ? Tensor{} : dst, transposed ? dst : Tensor{}, !transposed);
  return dst.view(shape);
}

// Only the rows in groups are cast (and count towards the amaxes): rows past them are
// padding the grouped GEMMs never read, and under expert parallelism may hold stale values.
// The casts find them from the device's offsets, so that nothing here waits for the routing.
void Fp8Linears::expert_forward(int i, const Tensor& out, const Tensor& in, const Tensor& weight,
                                const ExpertGroups& groups) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t R = in.dim(0);
  TS_CHECK(l.expert_stack() && R * l.in <= x_codes_.numel() && in.numel() == R * l.in,
           "fp8 {}: input {} is not (rows <= {}, {}) of an expert stack", l.name, in.shape.str(),
           l.rows, l.in);
  const Tensor x = x_codes_.flat_range(0, R * l.in).view({R, l.in});
  {
    Fp8GroupedCastArgs c;
    c.x = in.view({R, l.in});
    c.offsets = groups.offsets;
    c.out = x;
    cast_groups(fwd_, input_slot(i), 1, c, true);
  }
  GroupedFp8MatmulArgs m;
  m.out = out;
  m.a = x;
  m.b = expert_codes(i, weight, groups.first_expert, false);
  m.a_scale_inv = scale_inv(fwd_, input_slot(i));
  m.b_scale_inv = fwd_.scale_inv.flat_range(expert_slot(i, groups.first_expert), l.local_experts);
  m.offsets = groups.offsets;
  m.host_offsets = groups.host_offsets;
  m.group_weights = groups.group_weights;
  m.fast_accum = options_.fast_accum_fprop;
  backend_.grouped_matmul_fp8(m);
}

void Fp8Linears::expert_backward(int i, const Tensor& din, const Tensor& dout, const Tensor& in,
                                 const Tensor& weight, const Tensor& dweight,
                                 const ExpertGroups& groups, float dweight_beta) {
  const Fp8LinearShape& l = linears_[i];
  const int64_t R = dout.dim(0);
  TS_CHECK(l.expert_stack() && R * l.out <= dy_codes_.numel() && dout.numel() == R * l.out &&
               in.numel() == R * l.in,
           "fp8 {}: dout {} / in {} are not ({} rows of {} / {})", l.name, dout.shape.str(),
           in.shape.str(), R, l.out, l.in);
  // dY in one pass: row-major for the data gradient, and transposed for the weights'.
  const Tensor dy = dy_codes_.flat_range(0, R * l.out).view({R, l.out});
  const Tensor dy_t = dy_codes_t_.flat_range(0, R * l.out).view({l.out, R});
  {
    Fp8GroupedCastArgs c;
    c.x = dout.view({R, l.out});
    c.offsets = groups.offsets;
    c.out = dy;
    c.out_t = dy_t;
    cast_groups(bwd_, i, 1, c, true);
  }
  if (din.defined()) {
    GroupedFp8MatmulArgs d;
    d.out = din;
    d.a = dy;
    d.b = expert_codes(i, weight, groups.first_expert, true);
    d.a_scale_inv = scale_inv(bwd_, i);
    d.b_scale_inv = fwd_.scale_inv.flat_range(expert_slot(i, groups.first_expert), l.local_experts);
    d.offsets = groups.offsets;
    d.host_offsets = groups.host_offsets;
    d.group_weights = groups.group_weights;
    d.fast_accum = options_.fast_accum_dgrad;
    backend_.grouped_matmul_fp8(d);
  }
  // The input transposed, with the scale its forward cast used.
  const Tensor x_t = x_codes_.flat_range(0, R * l.in).view({l.in, R});
  {
    Fp8GroupedCastArgs c;
    c.x = in.view({R, l.in});
    c.offsets = groups.offsets;
    c.out_t = x_t;
    cast_groups(fwd_, input_slot(i), 1, c, false);
  }
  GroupedFp8MatmulWgradArgs w;
  w.out = dweight;
  w.a_t = dy_t;
  w.b_t = x_t;
  w.a_scale_inv = scale_inv(bwd_, i);
  w.b_scale_inv = scale_inv(fwd_, input_slot(i));
  w.beta = dweight_beta;
  w.offsets = groups.offsets;
  w.host_offsets = groups.host_offsets;
  w.group_weights = groups.group_weights;
  w.fast_accum = options_.fast_accum_wgrad;
  backend_.grouped_matmul_fp8_wgrad(w);
}

void Fp8Linears::weights_changed() { cache_valid_.assign(linears_.size(), false); }

void Fp8Linears::clear_status() { backend_.fill(status_, 0.0f); }

void Fp8Linears::attach(StepCollectives& collectives) {
  collectives_ = &collectives;
  // Transformer Engine's rule: amaxes are reduced over the data- and tensor-parallel ranks,
  // so every rank derives the same scales and the replicas stay identical.
  set_amax_reducer([&collectives](const Tensor& amaxes) { collectives.max_over_replicas(amaxes); });
}

void Fp8Linears::read_step(int64_t) {
  backend_.download(&read_status_, status_);
}

std::string Fp8Linears::non_finite_cause() const {
  return std::isfinite(read_status_) ? ""
                                     : "FP8 amax (an activation, weight or gradient held NaN or Inf)";
}

void Fp8Linears::end_step(const Tensor& grad_norm_sq) {
  // A non-finite amax on any rank skips the step on every rank (NaN survives the sum).
  if (collectives_) collectives_->sum_over_job(status_);
  if (options_.recipe == Fp8Recipe::Delayed) {
    const bool most_recent = options_.amax_algo == Fp8AmaxAlgo::MostRecent;
    for (const Group* g : {&fwd_, &bwd_}) {
      if (amax_reducer_) amax_reducer_(g->history.flat_range(0, g->history.dim(1)));
      update_scales(*g, 0, g->scale_inv.numel(), g->history, most_recent, /*roll=*/true);
    }
    have_history_ = true;
  }
  backend_.sum(grad_norm_sq, status_, /*accumulate=*/true);
}

std::vector<std::pair<std::string, Tensor>> Fp8Linears::state_tensors() const {
  if (blockwise()) return {};  // every scale comes from the step's own values
  return {{"fp8.forward.amax_history", fwd_.history}, {"fp8.forward.scale", fwd_.scale},
          {"fp8.forward.scale_inv", fwd_.scale_inv},  {"fp8.backward.amax_history", bwd_.history},
          {"fp8.backward.scale", bwd_.scale},         {"fp8.backward.scale_inv", bwd_.scale_inv}};
}

}  // namespace tessera
