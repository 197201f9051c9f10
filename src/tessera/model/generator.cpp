#include "tessera/model/generator.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/model/init.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

Generator::Generator(Backend& backend, const ModelSpec& spec, DType compute_dtype,
                     int64_t max_positions, int64_t max_batch)
    : backend_(backend),
      spec_(spec),
      dtype_(compute_dtype),
      max_positions_(max_positions),
      max_batch_(max_batch),
      layers_(make_decoder_layers(spec)),
      layout_(decoder_param_layout(spec, layers_)) {
  param_buffer_ = DeviceBuffer(backend_, layout_.total * dtype_size(dtype_), "parameters");
  params_ = param_buffer_.tensor(dtype_, {layout_.total});
  allocate_state();
}

Generator::Generator(Backend& backend, const ModelSpec& spec, const Tensor& params,
                     const ParamLayout& params_layout, int64_t max_positions, int64_t max_batch,
                     const Tensor& cache_region)
    : backend_(backend),
      spec_(spec),
      dtype_(params.dtype),
      max_positions_(max_positions),
      max_batch_(max_batch),
      layers_(make_decoder_layers(spec)),
      layout_(decoder_param_layout(spec, layers_)),
      params_in_place_(true),
      params_(params) {
  bool same = layout_.params.size() == params_layout.params.size() && params.numel() >= layout_.total;
  for (size_t i = 0; same && i < layout_.params.size(); ++i)
    same = layout_.params[i].offset == params_layout.params[i].offset &&
           layout_.params[i].shape == params_layout.params[i].shape;
  TS_CHECK(same, "generation in place: the weights' layout is not the generator's (a model split "
                 "over tensor-parallel ranks or sharded holds part of them)");
  allocate_state(cache_region);
}

Generator::Sizes Generator::sizes(const ModelSpec& spec, const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                  DType dtype, int64_t max_positions, int64_t max_batch) {
  const size_t e = dtype_size(dtype);
  const int64_t S = max_positions, C = spec.hidden, V = spec.vocab_size, B = max_batch;
  // Rows of the residual states: a prompt's positions, or one token of each sequence.
  const int64_t R = std::max(S, B);
  Sizes z;
  for (const auto& layer : layers)
    for (int64_t w : layer->cache_widths()) z.cache += aligned(B * S * w * e);
  // Two residual states for the layers to ping-pong between, the final norm and logits of each
  // sequence's last position, the tokens (a step's ids then its positions), draw()'s streams,
  // steps and outputs, and the rope tables with a step's rows of each.
  z.state = {aligned(std::max(R, 2 * B) * 4), aligned(R * C * e), aligned(R * C * e), aligned(B * C * e),
             aligned(B * 4), aligned(B * V * e), aligned(B * V * 4), aligned(2 * B * 4), aligned(3 * B * 4)};
  z.table = aligned(S * spec.head_dim * 4);
  z.rows = aligned(B * spec.head_dim * 4);
  z.tables = rope_bases(layers).size();
  for (const auto& layer : layers)
    for (const auto& [name, width] : layer->state_layout()) z.block_state_floats += width;
  for (const auto& layer : layers) z.scratch = std::max(z.scratch, layer->cached_scratch_bytes(R, C, dtype));
  return z;
}

size_t Generator::Sizes::bytes() const {
  size_t total = cache + tables * (table + rows) + block_state_floats * sizeof(float) + scratch;
  for (size_t b : state) total += b;
  return total;
}

size_t Generator::buffer_bytes(const ModelSpec& spec, DType dtype, int64_t max_positions, int64_t max_batch) {
  const auto layers = make_decoder_layers(spec);
  return sizes(spec, layers, dtype, max_positions, max_batch).bytes();
}

size_t Generator::cache_bytes(const ModelSpec& spec, DType dtype, int64_t max_positions, int64_t max_batch) {
  const auto layers = make_decoder_layers(spec);
  return sizes(spec, layers, dtype, max_positions, max_batch).cache;
}

void Generator::allocate_state(const Tensor& cache_region) {
  TS_CHECK(max_positions_ > 0, "generation needs room for at least one position");
  TS_CHECK(max_batch_ >= 1, "generation needs room for at least one sequence");
  const size_t e = dtype_size(dtype_);
  const int64_t S = max_positions_, C = spec_.hidden, V = spec_.vocab_size, B = max_batch_;
  const int64_t R = std::max(S, B);
  const Sizes z = sizes(spec_, layers_, dtype_, S, B);
  if (cache_region.defined()) {
    TS_CHECK(cache_region.dtype == DType::U8 && cache_region.nbytes() >= z.cache,
             "generation: a KV cache of {} bytes in a region of {}", z.cache, cache_region.nbytes());
  } else {
    cache_buffer_ = DeviceBuffer(backend_, z.cache, "KV cache");
  }
  char* const cache = static_cast<char*>(cache_region.defined() ? cache_region.data : cache_buffer_.data());
  size_t at = 0;
  for (const auto& layer : layers_) {
    caches_.emplace_back();
    for (int64_t w : layer->cache_widths()) {
      caches_.back().push_back(w > 0 ? Tensor{cache + at, dtype_, {B, S, w}, backend_.device()} : Tensor{});
      at += aligned(B * S * w * e);
    }
  }

  const auto& sizes = z.state;
  for (double base : rope_bases(layers_)) rope_.tables.push_back({base, Tensor{}});
  step_rope_ = rope_;
  size_t total = z.tables * (z.table + z.rows);
  for (size_t b : sizes) total += b;
  state_buffer_ = DeviceBuffer(backend_, total, "generation state");
  at = 0;
  auto next = [&](DType dtype, Shape shape, size_t bytes) {
    const Tensor t = state_buffer_.tensor(dtype, shape, at);
    at += bytes;
    return t;
  };
  tokens_ = next(DType::I32, {std::max(R, 2 * B)}, sizes[0]);
  state_a_ = next(dtype_, {R, C}, sizes[1]);
  state_b_ = next(dtype_, {R, C}, sizes[2]);
  final_norm_ = next(dtype_, {B, C}, sizes[3]);
  final_rstd_ = next(DType::F32, {B}, sizes[4]);
  logits_ = next(dtype_, {B, V}, sizes[5]);
  logits_f32_ = next(DType::F32, {B * V}, sizes[6]);
  draw_streams_ = next(DType::I32, {2 * B}, sizes[7]);
  draw_out_ = next(DType::F32, {3 * B}, sizes[8]);
  for (size_t i = 0; i < rope_.tables.size(); ++i) {
    auto& [base, table] = rope_.tables[i];
    table = next(DType::F32, {S, spec_.head_dim}, z.table);
    backend_.upload(table, tessera::rope_table(spec_, S, base).data());
    step_rope_.tables[i].second = next(DType::F32, {B, spec_.head_dim}, z.rows);
  }
  positions_.assign(static_cast<size_t>(B), 0);
  captures_steps_ = backend_.supports(Capability::CapturesWork) &&
                    std::none_of(layers_.begin(), layers_.end(), [&](const auto& l) {
                      return l->decode_reads_host(backend_, B, dtype_);
                    });

  // The blocks' state (the expert bias): fp32, zero until load() sets it.
  const auto state_total = static_cast<int64_t>(z.block_state_floats);
  if (state_total > 0) {
    block_state_buffer_ = DeviceBuffer(backend_, state_total * sizeof(float), "block state");
    const Tensor all = block_state_buffer_.tensor(DType::F32, {state_total});
    backend_.fill(all, 0.0f);
    int64_t offset = 0;
    for (auto& layer : layers_) {
      std::vector<Tensor> mine;
      for (const auto& [name, width] : layer->state_layout()) {
        mine.push_back(all.flat_range(offset, width));
        block_state_.emplace_back(name, mine.back());
        offset += width;
      }
      layer->bind_state(mine);
    }
  }

  scratch_ = ScratchArena(backend_, z.scratch);
}

Generator::~Generator() = default;

Tensor Generator::param(int index) const {
  const ParamInfo& p = layout_.params[index];
  return params_.flat_range(p.offset, p.numel()).view(p.shape);
}

void Generator::load(const std::function<std::vector<float>(const ParamInfo&)>& weights,
                     const std::function<std::vector<float>(const std::string&)>& state) {
  TS_CHECK(!params_in_place_, "generation in place: its weights are loaded where they live");
  for (const auto& [name, tensor] : block_state_) {
    const std::vector<float> v = state ? state(name) : std::vector<float>();
    if (v.empty()) continue;
    TS_CHECK(static_cast<int64_t>(v.size()) == tensor.numel(), "{}: {} values for {} elements",
             name, v.size(), tensor.numel());
    backend_.upload(tensor, v.data());
  }
  DeviceBuffer staging(backend_, 0, "staging");
  for (const ParamInfo& p : layout_.params) {
    const std::vector<float> w = weights(p);
    TS_CHECK(static_cast<int64_t>(w.size()) == p.numel(), "{}: {} values for {} elements", p.name,
             w.size(), p.numel());
    const Tensor dst = params_.flat_range(p.offset, p.numel());
    if (dtype_ == DType::F32) {
      backend_.upload(dst, w.data());
      continue;
    }
    // Through an fp32 copy on the device, rounded to nearest even as everywhere else.
    if (staging.bytes() < w.size() * 4) staging = DeviceBuffer(backend_, w.size() * 4, "staging");
    const Tensor f32 = staging.tensor(DType::F32, {p.numel()});
    backend_.upload(f32, w.data());
    backend_.convert(dst, f32);
  }
  backend_.synchronize();
}

void Generator::init_random(uint64_t seed) {
  TS_CHECK(!params_in_place_, "generation in place: its weights are initialised where they live");
  DeviceBuffer f32(backend_, layout_.total * sizeof(float), "initial weights (fp32)");
  init_parameters(backend_, spec_, layout_, f32.tensor(DType::F32, {layout_.total}), seed);
  backend_.convert(params_, f32.tensor(DType::F32, {layout_.total}));
  backend_.synchronize();
}

void Generator::copy_state(const std::vector<std::pair<std::string, Tensor>>& state) {
  for (const auto& mine : block_state_) {
    const auto from = std::find_if(state.begin(), state.end(), [&](const auto& s) { return s.first == mine.first; });
    TS_CHECK(from != state.end() && from->second.numel() == mine.second.numel(), "{}: no such state to copy",
             mine.first);
    backend_.copy(mine.second, from->second);
  }
}

void Generator::linear(const Tensor& out, const LinearOperand& input, int weight, int bias,
                       const Tensor& residual) {
  TS_CHECK(!input.cast, "generation's linears are bf16: an input cast to FP8");
  const Tensor& in = input.x;
  MatmulArgs m;
  m.out = out;
  m.a = in;
  m.b = param(weight);
  m.trans_b = true;
  if (residual.defined()) m.beta = 1.0f, m.c = residual;
  if (bias >= 0) m.bias = param(bias);
  backend_.matmul(m);
  if (adapters_ && adapters_->adapts(weight)) adapters_->forward(out, in, weight);
}

std::vector<float> Generator::prefill(const std::vector<int32_t>& prompt) {
  prefill_slot(0, prompt);
  return logits(1);
}

std::vector<float> Generator::step(int32_t token) {
  step_slots({token});
  return logits(1);
}

std::vector<Tensor> Generator::caches_of(size_t layer, int64_t first, int64_t count) const {
  std::vector<Tensor> out;
  for (const Tensor& cache : caches_[layer]) {
    if (!cache.defined()) {
      out.push_back(cache);
      continue;
    }
    const int64_t S = cache.dim(1), w = cache.dim(2);
    if (count == 0) {
      out.push_back(cache.flat_range(first * S * w, S * w).view({S, w}));
    } else {
      out.push_back(cache.flat_range(first * S * w, count * S * w).view({count, S, w}));
    }
  }
  return out;
}

void Generator::copy_slot(int64_t from, int64_t to) {
  TS_CHECK(from >= 0 && from < max_batch_ && to >= 0 && to < max_batch_, "generation: slots {} and {} of {}", from,
           to, max_batch_);
  if (from == to) return;
  const int64_t length = positions_[static_cast<size_t>(from)];
  for (const auto& layer : caches_)
    for (const Tensor& cache : layer) {
      if (!cache.defined()) continue;
      const int64_t S = cache.dim(1), w = cache.dim(2);
      if (length > 0) backend_.copy(cache.flat_range(to * S * w, length * w), cache.flat_range(from * S * w, length * w));
    }
  backend_.copy(logits_.rows(to, to + 1), logits_.rows(from, from + 1));
  positions_[static_cast<size_t>(to)] = length;
}

void Generator::upload_ids(const int32_t* tokens, int64_t n, int64_t more) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= spec_.vocab_size)
      throw DataError(fmt::format("generation: token id {} outside the vocabulary [0, {})", tokens[i],
                                  spec_.vocab_size));
  backend_.upload(tokens_.flat_range(0, n + more), tokens);
}

Tensor Generator::embed(int64_t n) {
  const Tensor x = state_a_.rows(0, n);
  backend_.embedding_forward(x, tokens_.flat_range(0, n), param(layout_.embedding));
  if (spec_.embedding_scale != 0) backend_.scale(x, x, static_cast<float>(spec_.embedding_scale));
  return x;
}

void Generator::run_layers(Tensor x, Tensor y, const std::function<std::vector<Tensor>(size_t)>& caches,
                           const CachePosition& at, int64_t from, int64_t last, int64_t to) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l]->forward_cached(*this, scratch_, x, y, caches(l), at);
    std::swap(x, y);
  }
  const Tensor norm = final_norm_.rows(0, last), logits = logits_.rows(to, to + last);
  backend_.rmsnorm_forward(norm, final_rstd_.flat_range(0, last), x.rows(from, from + last),
                           param(layout_.final_norm), spec_.norm_eps);
  linear(logits, norm, layout_.lm_head, -1, {});
  if (spec_.logit_softcap > 0) backend_.softcap(logits, logits, static_cast<float>(spec_.logit_softcap));
}

void Generator::prefill_slot(int64_t slot, std::span<const int32_t> prompt) {
  TS_CHECK(slot >= 0 && slot < max_batch_, "generation: slot {} of {}", slot, max_batch_);
  TS_CHECK(!prompt.empty(), "generation needs a prompt of at least one token");
  const auto n = static_cast<int64_t>(prompt.size());
  if (n > max_positions_)
    throw Error(fmt::format("generation: a prompt of {} tokens does not fit the {} positions the generator has "
                            "room for (raise the room for new tokens or shorten the prompt)",
                            n, max_positions_));
  upload_ids(prompt.data(), n);
  run_layers(embed(n), state_b_.rows(0, n), [&](size_t l) { return caches_of(l, slot, 0); }, CachePosition{}, n - 1, 1,
             slot);
  positions_[static_cast<size_t>(slot)] = n;
}

int64_t Generator::step_rows(int64_t busy) const {
  if (!captures_steps()) return busy;
  int64_t rows = 1;
  while (rows < busy && rows < 8) rows *= 2;
  if (busy > 8) rows = (busy + 7) / 8 * 8;
  return std::min(rows, max_batch_);
}

void Generator::step_slots(const std::vector<int32_t>& tokens) {
  const auto busy = static_cast<int64_t>(tokens.size());
  TS_CHECK(busy >= 1 && busy <= max_batch_, "generation: {} tokens for {} slots", busy, max_batch_);
  const int64_t B = step_rows(busy);
  // The ids then the positions, one upload; an idle slot reads token 0 at position 0.
  std::vector<int32_t> ids(static_cast<size_t>(2 * B), 0);
  int64_t last = 0;
  for (int64_t b = 0; b < busy; ++b) {
    if (tokens[b] < 0) continue;
    const int64_t pos = positions_[static_cast<size_t>(b)];
    if (pos == 0) throw InternalError(fmt::format("generation: slot {} steps before its prefill", b));
    if (pos >= max_positions_)
      throw Error(fmt::format("generation: {} positions do not fit the {} the generator has room for (raise the "
                              "room for new tokens or shorten the prompt)",
                              pos + 1, max_positions_));
    ids[b] = tokens[b];
    ids[B + b] = static_cast<int32_t>(pos);
    last = std::max(last, pos);
  }
  upload_ids(ids.data(), B, B);
  CachePosition at;
  at.pos = last;
  at.positions = tokens_.flat_range(B, B);
  at.rope = &step_rope_;
  // Everything after the upload reads only device memory at places fixed for B rows: what a
  // captured step replays. Each rotary table's rows at the slots' positions are gathered as an
  // embedding's rows are.
  const auto step = [&] {
    for (size_t i = 0; i < rope_.tables.size(); ++i)
      backend_.embedding_forward(step_rope_.tables[i].second.rows(0, B), at.positions, rope_.tables[i].second);
    run_layers(
        embed(B), state_b_.rows(0, B),
        [&](size_t l) { return caches_of(l, 0, B); }, at, 0, B, 0);
  };
  const auto captured = captured_steps_.find(B);
  if (captured == captured_steps_.end() || !captured->second->replay()) {
    if (captures_steps() && steps_run_.count(B) > 0) {
      // Its first run, op by op, settled what capture cannot do itself (the GEMMs' tuning, the
      // kernel scratch); a capture that the scratch outgrew since is taken again.
      std::unique_ptr<CapturedWork> graph = backend_.capture(step);
      if (graph && graph->replay())
        captured_steps_[B] = std::move(graph);
      else
        captured_steps_.erase(B), step();
    } else {
      step();
      steps_run_.insert(B);
    }
  }
  for (int64_t b = 0; b < busy; ++b)
    if (tokens[b] >= 0) ++positions_[static_cast<size_t>(b)];
}

std::vector<float> Generator::logits(int64_t rows) {
  const int64_t V = spec_.vocab_size;
  TS_CHECK(rows >= 1 && rows <= max_batch_, "generation: logits of {} slots of {}", rows, max_batch_);
  const Tensor f32 = logits_f32_.flat_range(0, rows * V);
  backend_.convert(f32, logits_.rows(0, rows));
  std::vector<float> out(static_cast<size_t>(rows * V));
  backend_.download(out.data(), f32);
  return out;
}

Generator::Draw Generator::draw(const std::vector<int32_t>& streams, const std::vector<int32_t>& steps,
                                int64_t vocab, double temperature, double min_p, uint64_t seed) {
  const auto B = static_cast<int64_t>(streams.size());
  TS_CHECK(B >= 1 && B <= max_batch_ && steps.size() == streams.size(), "generation: {} streams and {} steps for {} slots",
           B, steps.size(), max_batch_);
  std::vector<int32_t> keys = streams;
  keys.insert(keys.end(), steps.begin(), steps.end());
  backend_.upload(draw_streams_.flat_range(0, 2 * B), keys.data());
  // Tokens, log-probabilities and entropies side by side in one buffer: one download a step.
  Tensor tokens = draw_out_.flat_range(0, B);
  tokens.dtype = DType::I32;  // 4 bytes, as the fp32 beside them
  backend_.sample_tokens(tokens, draw_out_.flat_range(B, B), draw_out_.flat_range(2 * B, B), logits_.rows(0, B),
                         draw_streams_.flat_range(0, B), draw_streams_.flat_range(B, B), vocab,
                         static_cast<float>(temperature), static_cast<float>(min_p), seed);
  std::vector<float> out(static_cast<size_t>(3 * B));
  backend_.download(out.data(), draw_out_.flat_range(0, 3 * B));
  Draw d;
  d.tokens.resize(static_cast<size_t>(B));
  std::memcpy(d.tokens.data(), out.data(), static_cast<size_t>(B) * sizeof(int32_t));
  d.logps.assign(out.begin() + B, out.begin() + 2 * B);
  d.entropy.assign(out.begin() + 2 * B, out.end());
  return d;
}

}  // namespace tessera
