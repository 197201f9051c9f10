#include "tessera/model/blocks/moe_mlp.h"

#include "tessera/core/error.h"

namespace tessera {

void MoeMlp::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden, E = s_.moe.experts, F = s_.moe.ffn, S = s_.moe.shared_ffn;
  router_ = b.add("mlp.router.weight", {E, C}, ParamInit::Normal, true);
  // Under expert parallelism the layout keeps this rank's experts of each stack.
  gate_up_ = b.add("mlp.experts.gate_up_proj.weight", {E, 2 * F, C}, ParamInit::Normal, true,
                   TensorParallelStyle::Expert);
  down_ = b.add("mlp.experts.down_proj.weight", {E, C, F}, ParamInit::ScaledNormal, true,
                TensorParallelStyle::Expert);
  if (S > 0) {
    shared_gate_up_ = b.add("mlp.shared_expert.gate_up_proj.weight", {2 * S, C}, ParamInit::Normal,
                            true, TensorParallelStyle::Column, {S, S});
    shared_down_ = b.add("mlp.shared_expert.down_proj.weight", {C, S}, ParamInit::ScaledNormal,
                         true, TensorParallelStyle::Row);
  }
}

std::vector<std::pair<int, Fp8LinearShape>> MoeMlp::expert_linears(const ModelRuntime& rt) const {
  const int64_t C = s_.hidden, E = s_.moe.experts, F = s_.moe.ffn;
  const int ep = rt.expert_parallel_size;
  const int64_t rows = expert_rows(rt.tokens(), rt);
  Fp8LinearShape up, down;
  up.out = 2 * F, up.in = C, down.out = C, down.in = F;
  for (Fp8LinearShape* s : {&up, &down}) s->experts = E, s->local_experts = E / ep, s->rows = rows;
  return {{gate_up_, up}, {down_, down}};
}

std::vector<int> MoeMlp::linear_weights() const {
  if (s_.moe.shared_ffn == 0) return {};
  return {shared_gate_up_, shared_down_};
}

void MoeMlp::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens(), C = s_.hidden, E = s_.moe.experts, K = s_.moe.topk;
  const int64_t F = s_.moe.ffn, S = s_.moe.shared_ffn, R = permuted_rows(N, s_.moe);
  const DType dt = rt.compute_dtype;
  ep_ = rt.expert_parallel_size;
  host_routing_.resize(static_cast<size_t>(std::max(rt.pipeline_slots, 1)));
  const int64_t Re = expert_rows(N, rt);
  plan.add(&logits_, dt, {N, E});
  plan.add(&indices_, DType::I32, {N, K});
  plan.add(&weights_, DType::F32, {N, K});
  plan.add(&rows_, DType::I32, {N, K});
  plan.add(&offsets_, DType::I32, {E + 1});
  if (s_.moe.capacity_factor > 0) plan.add(&dropped_, DType::F32, {1});
  plan.add(&xp_, dt, {R, C});
  plan.add(&h1_, dt, {Re, 2 * F});
  plan.add(&h_, dt, {Re, F}, Keep::Recomputable);
  plan.add(&yp_, dt, {R, C});
  if (ep_ > 1) {
    plan.add(&xr_, dt, {Re, C});
    plan.add(&yr_, dt, {Re, C});
    plan.add(&expert_offsets_, DType::I32, {E + 1});  // ep x (E / ep) groups
  }
  if (S > 0) {
    plan.add(&shared_gu_, dt, {N, 2 * S});
    plan.add(&shared_h_, dt, {N, S}, Keep::Recomputable);
  }
}

void MoeMlp::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens(), C = s_.hidden, E = s_.moe.experts, K = s_.moe.topk;
  const int64_t F = s_.moe.ffn, S = s_.moe.shared_ffn, R = permuted_rows(N, s_.moe);
  const int64_t Re = expert_rows(N, rt);
  const DType dt = rt.compute_dtype;
  plan.add(&dyp_, dt, {R, C});
  plan.add(&dweights_, DType::F32, {N, K});
  plan.add(&dh_, dt, {Re, F});
  plan.add(&dh1_, dt, {Re, 2 * F});
  if (rt.expert_parallel_size > 1) plan.add(&dyr_, dt, {Re, C});
  plan.add(&dlogits_, DType::F32, {N, E});
  plan.add(&dlogits_c_, dt, {N, E});
  if (S > 0) {
    plan.add(&dshared_h_, dt, {N, S});
    plan.add(&dshared_gu_, dt, {N, 2 * S});
  }
}

MoeRouting MoeMlp::routing(bool force_balance) const {
  const MoeSpec& m = s_.moe;
  MoeRouting r;
  r.experts = m.experts;
  r.topk = m.topk;
  r.sigmoid = m.sigmoid;
  r.pre_softmax = m.pre_softmax;
  r.num_groups = m.num_groups;
  r.group_topk = m.group_topk;
  r.scaling = static_cast<float>(m.topk_scaling);
  r.force_balance = force_balance;
  return r;
}

int64_t MoeMlp::expert_rows(int64_t n, const ModelRuntime& rt) const {
  const int ep = rt.expert_parallel_size;
  if (ep == 1) return permuted_rows(n, s_.moe);
  // Each rank of the group sends at most its routed rows for this rank's experts (with token
  // dropping, its experts' capacity each), padded. Force-balanced routing sends each expert
  // ceil(n topk / experts) pairs at most: round-robin over any run of n topk slots.
  const MoeSpec& m = s_.moe;
  const int64_t local = m.experts / ep;
  int64_t per_expert = m.capacity(n);
  if (rt.moe_force_balance) {
    const int64_t balanced = (n * m.topk + m.experts - 1) / m.experts;
    per_expert = per_expert > 0 ? std::min(per_expert, balanced) : balanced;
  }
  return ep * aligned_rows(kept_pairs(n, local, per_expert, m.topk) + local * (kGroupAlign - 1));
}

ExpertGroups MoeMlp::expert_groups(const ExpertExchange* ex, const Tensor& offsets,
                                   const HostRouting& host) const {
  if (ex == nullptr) return {offsets, host.offsets, {}, 0};
  return {expert_offsets_, host.expert_offsets, host.group_weights, ex->rank() * local_count(*ex)};
}

MoeAuxLossArgs MoeMlp::aux_loss_args(const ModelRuntime& rt) const {
  MoeAuxLossArgs a;
  a.logits = logits_, a.indices = indices_, a.routing = routing(false);
  a.seq = s_.moe.load_balancing == MoeLoadBalancing::SeqAuxLoss ? rt.seq_length : 0;
  return a;
}

// Where this rank's rows go: the permuted rows are sorted by expert, so the rows of rank j's
// experts are one block; the ranks swap their per-expert counts, and this rank's experts
// receive (source rank, expert) groups, each a multiple of kGroupAlign rows.
void MoeMlp::plan_exchange(Backend& b, ExpertExchange& ex, HostRouting& host) {
  const int P = ex.size();
  const int64_t E = s_.moe.experts, El = E / P;
  const std::vector<int32_t>& local = host.offsets;
  std::vector<int64_t> send(E), recv(E);
  for (int64_t g = 0; g < E; ++g) send[g] = local[g + 1] - local[g];
  ex.exchange_counts(send, recv, El);
  host.send_rows.assign(P, 0), host.send_first.assign(P, 0), host.recv_rows.assign(P, 0);
  host.recv_first.assign(P, 0);
  host.expert_offsets.assign(E + 1, 0);
  host.group_weights.assign(E, 0);
  for (int j = 0; j < P; ++j) {
    host.send_first[j] = local[j * El];
    host.send_rows[j] = local[(j + 1) * El] - local[j * El];
    host.recv_first[j] = host.expert_offsets[j * El];
    for (int64_t e = 0; e < El; ++e) {
      const int64_t g = j * El + e;
      host.expert_offsets[g + 1] = static_cast<int32_t>(host.expert_offsets[g] + recv[g]);
      host.group_weights[g] = static_cast<int32_t>(e);
      host.recv_rows[j] += recv[g];
    }
  }
  TS_CHECK(host.expert_offsets[E] <= xr_.dim(0), "{} received rows, planned for {}",
           host.expert_offsets[E], xr_.dim(0));
  b.upload(expert_offsets_, host.expert_offsets.data());
}

// Under selective recompute ln (the block's normed input), h and the shared expert's h share one
// buffer (one recomputable tensor is live at a time), so each is used up before the next is
// written: ln feeds the router, the dispatch and the shared expert's first GEMM before h
// overwrites it.
void MoeMlp::route_and_run_experts(ForwardOps& ops, const Buffers& t, bool force_balance,
                                   ExpertExchange* ex, HostRouting& host) {
  Backend& b = ops.backend();
  ops.linear(t.logits, t.ln, router_, -1);
  b.moe_router_forward(t.indices, t.weights, t.logits, expert_bias_, routing(force_balance));
  MoeCapacity capacity;  // Megatron's token dropping, per pass over this rank's tokens
  capacity.capacity = s_.moe.capacity(t.ln.dim(0));
  capacity.by_position = s_.moe.drop_by_position;
  capacity.weights = t.weights;
  if (capacity.capacity > 0) capacity.dropped = t.dropped;
  b.moe_permute(t.xp, t.rows, t.offsets, t.ln, t.indices, kGroupAlign, capacity);
  // The group sizes are known on the device only. Where every grouped GEMM of the layer runs
  // best from them there, nothing waits for the routing; otherwise one copy per pass serves
  // them all, forward and backward (and the exchange's counts).
  if (ex == nullptr && ops.expert_linear_reads_device_offsets(gate_up_, t.xp) &&
      ops.expert_linear_reads_device_offsets(down_, t.h)) {
    host.offsets.clear();
  } else {
    host.offsets.resize(static_cast<size_t>(s_.moe.experts + 1));
    b.download(host.offsets.data(), t.offsets);
  }
  // The experts run on this rank's rows (every expert) or on the rows the group sends to
  // this rank's share of them.
  Tensor x = t.xp, y = t.yp;
  if (ex != nullptr) {
    plan_exchange(b, *ex, host);
    ex->exchange_rows(xr_, host.recv_rows, host.recv_first, t.xp, host.send_rows, host.send_first);
    x = xr_, y = yr_;
  }
  const ExpertGroups g = expert_groups(ex, t.offsets, host);
  ops.expert_linear(t.h1, x, gate_up_, ops.param(gate_up_), g);
  if (t.shared_gu.defined()) ops.linear(t.shared_gu, t.ln, shared_gate_up_, -1);
  b.swiglu_forward(t.h, t.h1);
  ops.expert_linear(y, t.h, down_, ops.param(down_), g);
  if (ex != nullptr)
    ex->exchange_rows(t.yp, host.send_rows, host.send_first, yr_, host.recv_rows, host.recv_first);
  if (t.shared_gu.defined()) b.swiglu_forward(t.shared_h, t.shared_gu);
}

ExpertExchange* MoeMlp::exchange(LayerOps& ops) const {
  ExpertExchange* ex = ops.expert_exchange();
  const int size = ex ? ex->size() : 1;
  TS_CHECK(size == ep_, "moe block planned for {} expert-parallel ranks, run on {}", ep_, size);
  return size > 1 ? ex : nullptr;
}

void MoeMlp::forward_inner(LayerOps& ops, const LinearOperand& in) {
  route_and_run_experts(ops,
                        {in.x, logits_, indices_, weights_, rows_, offsets_, xp_, h1_, h_, yp_,
                         shared_gu_, shared_h_, dropped_},
                        ops.runtime().moe_force_balance, exchange(ops),
                        host_routing_.at(static_cast<size_t>(ops.activation_slot())));
}

// The statistics count each micro-batch once: a fully recomputed layer reruns forward_inner
// only, or, inside a uniform recompute group, forward_output while ops.recomputing().
void MoeMlp::forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) {
  Backend& b = ops.backend();
  combine_start(ops, out, shared_h_, residual);
  b.moe_unpermute(out, yp_, rows_, weights_);
  if (!stats_.defined() || ops.recomputing()) return;
  const int64_t E = s_.moe.experts;
  b.moe_expert_counts(stats_.flat_range(0, E), indices_);
  if (s_.moe.load_balancing != MoeLoadBalancing::None) {
    MoeAuxLossArgs a = aux_loss_args(ops.runtime());
    a.loss = stats_.flat_range(E, 1);
    b.moe_aux_loss(a);
  }
  b.moe_z_loss(stats_.flat_range(E + 1, 1), Tensor{}, logits_, 0.0f);
  if (dropped_.defined()) b.sum(stats_.flat_range(E + 2, 1), dropped_, /*accumulate=*/true);
}

void MoeMlp::backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout, const Tensor& din,
                      const std::function<void()>& recompute_in) {
  Backend& b = ops.backend();
  const bool selective = ops.runtime().recompute == RecomputeGranularity::Selective;
  const bool shared = s_.moe.shared_ffn > 0;
  const MoeSpec& m = s_.moe;
  ExpertExchange* ex = exchange(ops);
  const HostRouting& host = host_routing_.at(static_cast<size_t>(ops.activation_slot()));
  // The combine: d(expert outputs) and d(routing weights), then to the experts' ranks.
  b.moe_unpermute_backward(dyp_, dweights_, dout, yp_, rows_, weights_);
  Tensor dy = dyp_, xe = xp_;
  if (ex != nullptr) {
    ex->exchange_rows(dyr_, host.recv_rows, host.recv_first, dyp_, host.send_rows, host.send_first);
    dy = dyr_, xe = xr_;
  }
  // The experts, down then up (their gradients written, then accumulated over micro-batches).
  if (selective) b.swiglu_forward(h_, h1_);
  const ExpertGroups g = expert_groups(ex, offsets_, host);
  ops.expert_linear_backward(dh_, dy, h_, down_, ops.param(down_), ops.grad(down_), g);
  b.swiglu_backward(dh1_, dh_, h1_);
  const Tensor dx = dy;  // dy's memory, free from here on
  ops.expert_linear_backward(dx, dh1_, xe, gate_up_, ops.param(gate_up_), ops.grad(gate_up_), g);
  // Back to the rows' own ranks (dyp's memory is free once sent).
  const Tensor dxp = dyp_;
  if (ex != nullptr)
    ex->exchange_rows(dxp, host.send_rows, host.send_first, dx, host.recv_rows, host.recv_first);
  // The router: the weights' gradient, then the aux and z losses', into fp32 logit gradients.
  const MoeRouting r = routing(ops.runtime().moe_force_balance);
  b.moe_router_backward(dlogits_, dweights_, logits_, indices_, r);
  // Each micro-batch's losses are means over its tokens; the step averages them over the
  // micro-batches and ranks, as the language-model loss over tokens (Megatron's scaling).
  const float micro_batch_scale =
      ops.loss_grad_scale() * static_cast<float>(ops.runtime().tokens());
  if (m.load_balancing != MoeLoadBalancing::None && m.aux_loss_coeff > 0) {
    MoeAuxLossArgs a = aux_loss_args(ops.runtime());
    a.dlogits = dlogits_;
    a.grad_scale = static_cast<float>(m.aux_loss_coeff) * micro_batch_scale;
    b.moe_aux_loss(a);
  }
  if (m.z_loss_coeff > 0)
    b.moe_z_loss(Tensor{}, dlogits_, logits_,
                 static_cast<float>(m.z_loss_coeff) * micro_batch_scale);
  b.convert(dlogits_c_, dlogits_);
  // The shared expert's down projection and SwiGLU, then (ln recomputed after shared_h, whose
  // buffer it shares under selective recompute) the GEMMs that read ln.
  if (shared) {
    if (selective) b.swiglu_forward(shared_h_, shared_gu_);
    ops.linear_backward(dshared_h_, dout, shared_h_, shared_down_, -1);
    b.swiglu_backward(dshared_gu_, dshared_h_, shared_gu_);
  }
  recompute_in();
  ops.linear_backward({}, dlogits_c_, in, router_, -1);
  // d(in): the shared expert's, the router's and the experts' inputs'.
  if (shared) ops.linear_backward(din, dshared_gu_, in, shared_gate_up_, -1);
  MatmulArgs router_dgrad;
  router_dgrad.out = din;
  router_dgrad.a = dlogits_c_;
  router_dgrad.b = ops.param(router_);
  router_dgrad.beta = shared ? 1.0f : 0.0f;
  b.matmul(router_dgrad);
  b.moe_permute_backward(din, dxp, rows_);
}

size_t MoeMlp::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  const int64_t C = s_.hidden, E = s_.moe.experts, K = s_.moe.topk, F = s_.moe.ffn;
  const int64_t S = s_.moe.shared_ffn, R = permuted_rows(n, s_.moe);
  size_t bytes = ScratchArena::aligned(n * E * e) + 3 * ScratchArena::aligned(n * K * 4) +
                 ScratchArena::aligned((E + 1) * 4) + 2 * ScratchArena::aligned(R * C * e) +
                 ScratchArena::aligned(R * 2 * F * e) + ScratchArena::aligned(R * F * e);
  if (S > 0) bytes += ScratchArena::aligned(n * 2 * S * e) + ScratchArena::aligned(n * S * e);
  if (s_.moe.capacity_factor > 0) bytes += ScratchArena::aligned(4);
  return bytes;
}

void MoeMlp::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in,
                            const Tensor& out, const Tensor& residual, const Tensor& /*cache*/,
                            const CachePosition& /*at*/) {
  Backend& b = ops.backend();
  const int64_t n = in.dim(0), C = s_.hidden, E = s_.moe.experts, K = s_.moe.topk;
  const int64_t F = s_.moe.ffn, S = s_.moe.shared_ffn, R = permuted_rows(n, s_.moe);
  const DType dt = in.dtype;
  Buffers t;
  t.ln = in;
  t.logits = scratch.take(dt, {n, E});
  t.indices = scratch.take(DType::I32, {n, K});
  t.weights = scratch.take(DType::F32, {n, K});
  t.rows = scratch.take(DType::I32, {n, K});
  t.offsets = scratch.take(DType::I32, {E + 1});
  if (s_.moe.capacity_factor > 0) t.dropped = scratch.take(DType::F32, {1});
  t.xp = scratch.take(dt, {R, C});
  t.h1 = scratch.take(dt, {R, 2 * F});
  t.h = scratch.take(dt, {R, F});
  t.yp = scratch.take(dt, {R, C});
  if (S > 0) {
    t.shared_gu = scratch.take(dt, {n, 2 * S});
    t.shared_h = scratch.take(dt, {n, S});
  }
  HostRouting host;
  route_and_run_experts(ops, t, /*force_balance=*/false, /*ex=*/nullptr, host);
  combine_start(ops, out, t.shared_h, residual);
  b.moe_unpermute(out, t.yp, t.rows, t.weights);
}

// What the combine adds the experts' outputs to: the shared expert's output (+ residual), the
// residual, or zeros.
void MoeMlp::combine_start(ForwardOps& ops, const Tensor& out, const Tensor& shared_h,
                           const Tensor& residual) const {
  if (s_.moe.shared_ffn > 0) return ops.linear(out, shared_h, shared_down_, -1, residual);
  if (residual.defined())
    ops.backend().copy(out, residual);
  else
    ops.backend().fill(out, 0.0f);
}

void MoeMlp::update_state(Backend& backend) {
  if (!expert_bias_.defined() || !stats_.defined()) return;
  backend.moe_expert_bias_update(expert_bias_, stats_.flat_range(0, s_.moe.experts),
                                 static_cast<float>(s_.moe.bias_update_rate));
}

// The router, the shared expert, and each expert's GEMMs over its share of the routed rows
// (top-k of every token's experts, balanced: top-k / experts of the tokens per expert).
std::vector<LinearGemm> MoeMlp::linear_gemms() const {
  const int64_t C = s_.hidden, E = s_.moe.experts, K = s_.moe.topk, F = s_.moe.ffn;
  const int64_t S = s_.moe.shared_ffn;
  std::vector<LinearGemm> g{
      {.name = "router", .out_features = E, .in_features = C, .fp8 = LinearGemm::Fp8::Never}};
  if (S > 0) g.push_back({.name = "shared_gate_up", .out_features = 2 * S, .in_features = C});
  g.push_back({.name = "experts_gate_up", .out_features = 2 * F, .in_features = C, .count = E,
               .share_num = K, .share_den = E, .fp8 = LinearGemm::Fp8::Expert});
  g.push_back({.name = "experts_down", .out_features = C, .in_features = F, .count = E,
               .share_num = K, .share_den = E, .fp8 = LinearGemm::Fp8::Expert});
  if (S > 0)
    g.push_back({.name = "shared_down", .out_features = C, .in_features = S, .residual = true});
  return g;
}

}  // namespace tessera
