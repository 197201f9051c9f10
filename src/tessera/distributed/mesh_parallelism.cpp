#include "tessera/distributed/mesh_parallelism.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
MeshParallelism::MeshParallelism(Communicator& world, const DeviceMesh& mesh, Model& model,
                                 const DataParallelOptions& data_parallel)
    : world_(world),
      mesh_(mesh),
      model_(model),
      barrier_buffer_(model.backend(), sizeof(float), "barrier flag") {
  const ModelRuntime& rt = model.runtime();
  const int tp = mesh.size(MeshDim::TP), tp_rank = mesh.coordinate(world.rank(), MeshDim::TP);
  TS_CHECK(rt.tensor_parallel_size == tp && rt.tensor_parallel_rank == tp_rank,
           "the model holds tensor-parallel part {} of {}, rank {} is part {} of {}",
           rt.tensor_parallel_rank, rt.tensor_parallel_size, world.rank(), tp_rank, tp);
  TS_CHECK(!data_parallel.fully_shard || mesh.size(MeshDim::PP) == 1,
           "FSDP with pipeline parallelism");
  const int cp = mesh.size(MeshDim::CP);
  TS_CHECK(rt.context_parallel_size == cp &&
               rt.context_parallel_rank == mesh.coordinate(world.rank(), MeshDim::CP),
           "the model holds context-parallel share {} of {}, rank {} is {} of {}",
           rt.context_parallel_rank, rt.context_parallel_size, world.rank(),
           mesh.coordinate(world.rank(), MeshDim::CP), cp);
  TS_CHECK(mesh.size(MeshDim::PP) == 1 || !rt.pipeline_chunks.empty(),
           "a pipeline of {} stages over a model that holds every layer", mesh.size(MeshDim::PP));
  // Every rank splits the same groups in the same order (Communicator::split is collective).
  tp_comm_ = split_mesh_group(world, mesh, {MeshDim::TP});
  cp_comm_ = split_mesh_group(world, mesh, {MeshDim::CP});
  data_comm_ = split_mesh_group(world, mesh, {MeshDim::DP, MeshDim::CP});
  amax_comm_ = split_mesh_group(world, mesh, {MeshDim::TP, MeshDim::DP, MeshDim::CP});
  pp_comm_ = split_mesh_group(world, mesh, {MeshDim::PP});
  model_comm_ = split_mesh_group(world, mesh, {MeshDim::TP, MeshDim::PP});
  tp_group_ = std::make_unique<CommunicatorGroup>(*tp_comm_);
  cp_group_ = std::make_unique<CommunicatorGroup>(*cp_comm_);
  model_.set_tensor_parallel_group(tp_group_.get());
  model_.set_context_parallel_group(cp_group_.get());
  ExpertCommunicators experts;
  if (mesh.size(MeshDim::EP) > 1) {
    ep_comm_ = split_mesh_group(world, mesh, {MeshDim::EP});
    if (mesh.size(MeshDim::ExpertDP) > 1)
      expert_data_comm_ = split_mesh_group(world, mesh, {MeshDim::ExpertDP});
    exchange_ = std::make_unique<CommExpertExchange>(model.backend(), *ep_comm_);
    model_.set_expert_exchange(exchange_.get());
    experts = {ep_comm_.get(), expert_data_comm_.get()};
  }
  if (data_comm_->size() > 1) {
    DataParallelOptions options = data_parallel;
    // A stage's backward passes of different micro-batches interleave with its forwards: the
    // gradients are final only after the schedule's last pass.
    if (mesh.size(MeshDim::PP) > 1) options.overlap_grad_reduce = false;
    // With FSDP (torchtitan's 2D, and its CP): this tensor-parallel part sharded over the
    // data x context-parallel ranks that hold it.
    data_ = make_data_parallelism(*data_comm_, model, options, experts);
  }

  const ParamLayout& layout = model.layout();
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamInfo& p = layout.params[i];
    const bool partial = p.tp == TensorParallelStyle::ReplicatedPartialGrads;
    const bool replicated = p.tp == TensorParallelStyle::Replicated || partial;
    if ((replicated && rt.sequence_parallel) || (partial && mesh.size(MeshDim::TP) > 1))
      partial_grads_.push_back(static_cast<int>(i));
    // Expert stacks are not split over tensor-parallel ranks either (each holds the same
    // experts, whole): counted once, like the replicated ones.
    if ((replicated || p.tp == TensorParallelStyle::Expert) && tp_rank != 0) continue;
    // To the next parameter: the alignment gap between them holds zeros.
    const int64_t end = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    if (!counted_.empty() && counted_.back().end == p.offset)
      counted_.back().end = end;
    else
      counted_.push_back({p.offset, end});
  }
}

MeshParallelism::~MeshParallelism() {
  if (exchange_) model_.set_expert_exchange(nullptr);
  model_.set_tensor_parallel_group(nullptr);
  model_.set_context_parallel_group(nullptr);
}

int MeshParallelism::data_parallel_rank() const {
  return mesh_.coordinate(world_.rank(), MeshDim::DP);
}

int MeshParallelism::data_parallel_size() const {
  return mesh_.size(MeshDim::DP);
}

std::string MeshParallelism::description() const {
  std::string s = mesh_.description();
  if (mesh_.size(MeshDim::CP) > 1)
    s += fmt::format("; context parallel {} (tokens of 2 of {} chunks per sequence)",
                     mesh_.size(MeshDim::CP), 2 * mesh_.size(MeshDim::CP));
  if (mesh_.size(MeshDim::TP) > 1)
    s += fmt::format("; tensor parallel {}{}", mesh_.size(MeshDim::TP),
                     model_.runtime().sequence_parallel ? " with sequence parallelism" : "");
  if (mesh_.size(MeshDim::PP) > 1) {
    std::string layers;
    for (const LayerRange& c : model_.runtime().pipeline_chunks)
      layers += fmt::format("{}{}-{}", layers.empty() ? "" : ", ", c.first, c.end() - 1);
    s += fmt::format("; pipeline stage {} of {} ({}1F1B, layers {}, {} micro-batch slots)",
                     mesh_.coordinate(world_.rank(), MeshDim::PP), mesh_.size(MeshDim::PP),
                     model_.chunks() > 1 ? "interleaved " : "", layers,
                     model_.runtime().pipeline_slots);
  }
  if (const int ep = mesh_.size(MeshDim::EP); ep > 1) {
    int64_t held = 0;
    for (const ParamInfo& p : model_.layout().params) held += p.numel();
    const int64_t experts = model_.spec().moe.experts;
    s += fmt::format(
        "; experts spread over {} expert-parallel ranks{} (each holds {} of every MoE layer's {} "
        "experts: {:.3f}B of the model's {:.3f}B parameters on this rank)",
        ep, mesh_.size(MeshDim::PP) > 1 ? " of the stage" : "", experts / ep, experts,
        held / 1e9, model_.spec().total_params() / 1e9);
  }
  if (data_)
    s += fmt::format("; data{} parallel: {}", mesh_.size(MeshDim::CP) > 1 ? " x context" : "",
                     data_->description());
  return s;
}

const PipelineSchedule& MeshParallelism::schedule(int64_t count, bool with_backward) {
  auto& s = schedules_[{count, with_backward}];
  if (!s)
    s = std::make_unique<PipelineSchedule>(mesh_.size(MeshDim::PP), model_.chunks(), count,
                                           with_backward);
  return *s;
}

void MeshParallelism::run_micro_batches(int64_t count, float grad_scale,
                                        const std::function<void(int64_t)>& load,
                                        const std::function<void(int64_t)>& run) {
  if (mesh_.size(MeshDim::PP) == 1)
    return Parallelism::run_micro_batches(count, grad_scale, load, run);
  // The gradients are reduced after the schedule (finish_gradient_reduction): no bucket is
  // armed for the backward.
  if (data_) data_->begin_micro_batch(false);
  run_schedule(schedule(count, true), true, grad_scale, load);
}

void MeshParallelism::run_forward_passes(int64_t count, const std::function<void(int64_t)>& load,
                                         const std::function<void(int64_t)>& run) {
  if (mesh_.size(MeshDim::PP) == 1) return Parallelism::run_forward_passes(count, load, run);
  run_schedule(schedule(count, false), false, 0.0f, load);
}

void MeshParallelism::run_scaled_micro_batches(
    int64_t count, float grad_scale, const std::function<void(int64_t)>& load,
    const std::function<std::vector<float>(int64_t)>& head_scales) {
  TS_CHECK(mesh_.size(MeshDim::PP) > 1, "run_scaled_micro_batches without pipeline stages");
  if (data_) data_->begin_micro_batch(false);
  run_schedule(schedule(count, true), true, grad_scale, load, head_scales);
}

void MeshParallelism::run_schedule(const PipelineSchedule& schedule, bool with_backward,
                                   float grad_scale, const std::function<void(int64_t)>& load,
                                   const std::function<std::vector<float>(int64_t)>& head_scales) {
  const int stage = mesh_.coordinate(world_.rank(), MeshDim::PP);
  // The stages holding the embedding (tokens) and the head (targets) read the micro-batches;
  // with packed documents every stage does, for its layers' positions and document masks.
  const std::vector<LayerRange>& chunks = model_.runtime().pipeline_chunks;
  const bool holds_head = chunks.back().end() == model_.spec().num_layers;
  const bool reads_batches =
      chunks.front().first == 0 || holds_head || model_.runtime().packed_documents();
  const auto is_head = [&](int chunk) { return holds_head && chunk == model_.chunks() - 1; };
  std::vector<char> loaded(static_cast<size_t>(schedule.micro_batches()), 0);
  // The head's losses are the slot's until the next forward: its scales are asked at once.
  std::vector<std::vector<float>> scales(head_scales ? static_cast<size_t>(schedule.micro_batches()) : 0);
  std::vector<P2POp> ops;
  for (const PipelineStep& step : schedule.steps(stage)) {
    if (step.pass) {
      const PipelinePass& p = *step.pass;
      model_.use_slot(schedule.slot(stage, p.micro_batch));
      if (p.kind == PipelinePass::Kind::Forward) {
        if (reads_batches && !loaded[p.micro_batch]) load(p.micro_batch), loaded[p.micro_batch] = 1;
        const bool scaled = head_scales && is_head(p.chunk);
        model_.forward_chunk(p.chunk, with_backward && !scaled, grad_scale);
        if (scaled) scales[p.micro_batch] = head_scales(p.micro_batch);
      } else {
        if (head_scales && is_head(p.chunk)) model_.kept_head_backward(p.chunk, scales[p.micro_batch]);
        model_.backward_chunk(p.chunk);
      }
    }
    if (step.transfers.empty()) continue;
    ops.clear();
    for (const PipelineTransfer& x : step.transfers) {
      const int slot = schedule.slot(stage, x.micro_batch);
      const Tensor t = x.gradient ? model_.chunk_grad(x.chunk, slot)
                       : x.send   ? model_.chunk_output(x.chunk, slot)
                                  : model_.chunk_input(x.chunk, slot);
      ops.push_back({x.send ? P2POp::Kind::Send : P2POp::Kind::Recv, t, x.peer});
    }
    pp_comm_->send_recv(ops, Lane::Compute);
  }
}

std::vector<OwnedParams> MeshParallelism::optimizer_shards() const {
  return data_ ? data_->optimizer_shards() : std::vector<OwnedParams>{};
}

void MeshParallelism::begin_micro_batch(bool last) {
  if (data_) data_->begin_micro_batch(last);
}

void MeshParallelism::finish_gradient_reduction() {
  if (data_) data_->finish_gradient_reduction();
  // Where the data parallelism keeps a share of each gradient (FSDP), the share lies at the
  // same places on every tensor-parallel rank (their layouts have the same shape).
  for (int index : partial_grads_) {
    if (!data_) {
      tp_comm_->all_reduce(model_.grad(index), ReduceOp::Sum, Lane::Compute);
      continue;
    }
    const ParamInfo& p = model_.layout().params[index];
    for (const Tensor& piece : data_->grad_pieces({p.offset, p.offset + p.numel()}))
      tp_comm_->all_reduce(piece, ReduceOp::Sum, Lane::Compute);
  }
}

void MeshParallelism::grad_norm_sq(const Tensor& out) {
  if (data_) {
    data_->grad_norm_sq_of(out, counted_);
  } else {
    Backend& b = model_.backend();
    b.fill(out, 0.0f);
    for (const ParamRange& r : counted_)
      b.sum_squares(out, model_.grads().flat_range(r.begin, r.count()), /*accumulate=*/true);
  }
  model_comm_->all_reduce(out, ReduceOp::Sum, Lane::Compute);
}

void MeshParallelism::params_updated() {
  if (data_) data_->params_updated();
}

void MeshParallelism::sum(const Tensor& t) {
  if (data_) data_->sum(t);
  if (mesh_.size(MeshDim::PP) > 1) pp_comm_->all_reduce(t, ReduceOp::Sum, Lane::Compute);
}

void MeshParallelism::sum_over_sequence(const Tensor& t) {
  if (mesh_.size(MeshDim::CP) == 1) return;
  settle();
  cp_comm_->all_reduce(t, ReduceOp::Sum, Lane::Compute);
}

void MeshParallelism::max(const Tensor& t) {
  settle();
  world_.all_reduce(t, ReduceOp::Max, Lane::Compute);
}

void MeshParallelism::max_over_replicas(const Tensor& t) {
  settle();
  amax_comm_->all_reduce(t, ReduceOp::Max, Lane::Compute);
}

void MeshParallelism::sum_over_job(const Tensor& t) {
  settle();
  world_.all_reduce(t, ReduceOp::Sum, Lane::Compute);
}

void MeshParallelism::barrier() {
  const Tensor flag = barrier_buffer_.tensor(DType::F32, {1});
  settle();
  world_.all_reduce(flag, ReduceOp::Sum, Lane::Compute);
  float ignored = 0;
  model_.backend().download(&ignored, flag);
}

void MeshParallelism::settle() {
  if (data_) data_->settle();
}

}  // namespace tessera::dist
