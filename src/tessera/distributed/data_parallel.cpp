#include "tessera/distributed/data_parallel.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/distributed/fully_sharded.h"

namespace tessera::dist {

int64_t flat_buffer_multiple(int world_size) {
  return 64 * static_cast<int64_t>(std::max(world_size, 1));
}

namespace {

int64_t bucket_size(int64_t bucket_elements, int world) {
  const int64_t g = flat_buffer_multiple(world);
  return std::max<int64_t>((bucket_elements + g - 1) / g * g, g);
}

// The parts of `ranges` inside `within` (both increasing and disjoint).
std::vector<ParamRange> intersect(const std::vector<ParamRange>& ranges,
                                  const std::vector<ParamRange>& within) {
  std::vector<ParamRange> out;
  for (const ParamRange& a : ranges)
    for (const ParamRange& b : within) {
      const ParamRange r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
      if (r.count() > 0) out.push_back(r);
    }
  return out;
}

// [0, total) less the increasing, disjoint `runs`.
std::vector<ParamRange> complement(const std::vector<ParamRange>& runs, int64_t total) {
  std::vector<ParamRange> out;
  int64_t at = 0;
  for (const ParamRange& r : runs) {
    if (r.begin > at) out.push_back({at, r.begin});
    at = std::max(at, r.end);
  }
  if (at < total) out.push_back({at, total});
  return out;
}

}  // namespace

BucketPlan plan_buckets(int64_t params, int64_t bucket_elements, int world_size) {
  const int64_t g = flat_buffer_multiple(world_size);
  return plan_buckets({{0, (params + g - 1) / g * g}}, params, bucket_elements, world_size);
}

BucketPlan plan_buckets(const std::vector<ParamRange>& ranges, int64_t params,
                        int64_t bucket_elements, int world_size) {
  BucketPlan p;
  p.params = params;
  p.world = std::max(world_size, 1);
  const int64_t g = flat_buffer_multiple(p.world);
  p.padded = (params + g - 1) / g * g;
  const int64_t size = bucket_size(bucket_elements, p.world);
  for (size_t i = ranges.size(); i-- > 0;) {
    const ParamRange& r = ranges[i];
    TS_CHECK(r.count() % g == 0 && r.begin >= 0 && r.end <= p.padded &&
                 (i == 0 || ranges[i - 1].end <= r.begin),
             "bucket ranges: [{}, {}) is not an increasing multiple of {} elements", r.begin, r.end,
             g);
    for (int64_t end = r.end; end > r.begin;) {
      const int64_t begin = std::max<int64_t>(end - size, r.begin);
      p.buckets.push_back({begin, end});
      end = begin;
    }
  }
  return p;
}

std::vector<ParamRange> ReductionPlan::owned(int dense_rank, int expert_rank) const {
  std::vector<ParamRange> out = dense.owned(dense_rank);
  if (!experts.buckets.empty()) {
    const std::vector<ParamRange> e = experts.owned(expert_rank);
    out.insert(out.end(), e.begin(), e.end());
    std::sort(out.begin(), out.end(),
              [](const ParamRange& a, const ParamRange& b) { return a.begin < b.begin; });
  }
  return out;
}

ReductionPlan plan_reduction(const ParamLayout& layout, int64_t bucket_elements, int world,
                             int expert_parallel) {
  world = std::max(world, 1);
  const int64_t g = flat_buffer_multiple(world);
  const int64_t padded = (layout.total + g - 1) / g * g;
  TS_CHECK(layout.expert_runs.empty() || (expert_parallel > 1 && world % expert_parallel == 0),
           "a layout with expert runs over {} data-parallel ranks, expert parallelism {}", world,
           expert_parallel);
  // The dense ranges: the gaps between the expert runs.
  std::vector<ParamRange> dense;
  int64_t at = 0;
  for (const ParamRange& r : layout.expert_runs) {
    if (r.begin > at) dense.push_back({at, r.begin});
    at = r.end;
  }
  if (padded > at) dense.push_back({at, padded});
  ReductionPlan p;
  p.dense = plan_buckets(dense, layout.total, bucket_elements, world);
  p.experts = plan_buckets(layout.expert_runs, layout.total, bucket_elements,
                           layout.expert_runs.empty() ? 1 : world / expert_parallel);
  return p;
}

ParamRange BucketPlan::shard(size_t k, int rank) const {
  const ParamRange& b = buckets[k];
  const int64_t n = b.count() / world;
  return {b.begin + rank * n, b.begin + (rank + 1) * n};
}

std::vector<ParamRange> BucketPlan::owned(int rank) const {
  std::vector<ParamRange> out;
  for (size_t k = buckets.size(); k-- > 0;) {
    const ParamRange s = shard(k, rank);
    const ParamRange clipped{s.begin, std::min(s.end, params)};
    if (clipped.count() > 0) out.push_back(clipped);
  }
  return out;
}

DataParallelism::DataParallelism(Communicator& comm, Model& model)
    : comm_(comm), model_(model), barrier_buffer_(model.backend(), sizeof(float), "barrier flag") {}

DataParallelism::~DataParallelism() = default;

Tensor DataParallelism::gathered_param(int index) {
  return model_.param(index);
}

std::vector<Tensor> DataParallelism::grad_pieces(const ParamRange& range) const {
  return {model_.grads().flat_range(range.begin, range.count())};
}

void DataParallelism::grad_norm_sq_of(const Tensor& out, const std::vector<ParamRange>& ranges) {
  Backend& b = model_.backend();
  const std::vector<OwnedParams> owned = optimizer_shards();
  std::vector<ParamRange> counted = ranges;
  if (!owned.empty()) {
    // ZeRO-1: only this rank's slices hold the data-parallel sum.
    std::vector<ParamRange> slices;
    for (const OwnedParams& o : owned) slices.push_back(o.range);
    counted = intersect(ranges, slices);
  }
  b.fill(out, 0.0f);
  for (const ParamRange& r : counted)
    for (const Tensor& piece : grad_pieces(r)) b.sum_squares(out, piece, /*accumulate=*/true);
  settle();
  if (!owned.empty()) comm_.all_reduce(out, ReduceOp::Sum, Lane::Compute);
}

void DataParallelism::sum(const Tensor& t) {
  settle();
  comm_.all_reduce(t, ReduceOp::Sum, Lane::Compute);
}

void DataParallelism::max(const Tensor& t) {
  settle();
  comm_.all_reduce(t, ReduceOp::Max, Lane::Compute);
}

void DataParallelism::barrier() {
  // No rank's all-reduce completes before every rank has joined it, and reading its result
  // on the host waits for that completion.
  const Tensor flag = barrier_buffer_.tensor(DType::F32, {1});
  settle();
  comm_.all_reduce(flag, ReduceOp::Sum, Lane::Compute);
  float ignored = 0;
  model_.backend().download(&ignored, flag);
}

DataParallel::DataParallel(Communicator& comm, Model& model, const DataParallelOptions& options,
                           ExpertCommunicators experts)
    : DataParallelism(comm, model),
      options_(options),
      experts_(experts),
      plan_(plan_reduction(model.layout(), options.bucket_elements, comm.size(),
                           experts.expert_parallel ? experts.expert_parallel->size() : 1)),
      padded_(plan_.dense.padded) {
  TS_CHECK(model.runtime().flat_buffer_multiple % flat_buffer_multiple(comm.size()) == 0,
           "the model's buffers are padded to {}, data parallelism needs a multiple of {}",
           model.runtime().flat_buffer_multiple, flat_buffer_multiple(comm.size()));
  TS_CHECK(model.layout().expert_runs.empty() == (experts.expert_parallel == nullptr),
           "data parallelism: a layout {} expert runs needs the expert-parallel groups",
           model.layout().expert_runs.empty() ? "without" : "with");
  // Both plans' buckets in the order the backward finishes them.
  const int expert_rank = experts.expert_data ? experts.expert_data->rank() : 0;
  for (size_t k = 0; k < plan_.dense.buckets.size(); ++k)
    buckets_.push_back({plan_.dense.buckets[k], plan_.dense.shard(k, comm.rank()), &comm});
  for (size_t k = 0; k < plan_.experts.buckets.size(); ++k)
    buckets_.push_back(
        {plan_.experts.buckets[k], plan_.experts.shard(k, expert_rank), experts.expert_data});
  std::stable_sort(buckets_.begin(), buckets_.end(),
                   [](const Bucket& a, const Bucket& b) { return a.range.begin > b.range.begin; });
  // The padding takes part in every reduction: keep it zero (the backward never writes it).
  if (padded_ > plan_.dense.params)
    model.backend().fill(padded_view(model.grads(), {plan_.dense.params, padded_}), 0.0f);
  model_.set_unit_observer(this);
}

DataParallel::~DataParallel() {
  model_.set_unit_observer(nullptr);
}

std::string DataParallel::description() const {
  return fmt::format("{}, {} gradient buckets{}{}{}",
                     options_.shard_optimizer ? "ZeRO-1 optimizer shards" : "replicated optimizer",
                     buckets_.size(),
                     plan_.experts.buckets.empty()
                         ? ""
                         : fmt::format(" ({} of experts, over {} expert-data-parallel rank{})",
                                       plan_.experts.buckets.size(), plan_.experts.world,
                                       plan_.experts.world == 1 ? "" : "s"),
                     options_.overlap_grad_reduce ? ", reduction overlapped with backward" : "",
                     options_.shard_optimizer && options_.overlap_param_gather
                         ? ", parameter gather overlapped with forward"
                         : "");
}

std::vector<OwnedParams> DataParallel::optimizer_shards() const {
  std::vector<OwnedParams> out;
  if (!options_.shard_optimizer) return out;
  const int expert_rank = experts_.expert_data ? experts_.expert_data->rank() : 0;
  for (const ParamRange& r : plan_.owned(comm_.rank(), expert_rank))
    out.push_back({r, model_.params().flat_range(r.begin, r.count()),
                   model_.grads().flat_range(r.begin, r.count())});
  return out;
}

Tensor DataParallel::padded_view(const Tensor& flat, const ParamRange& r) const {
  // The buffers are allocated for padded_ elements; the model's tensors show params.
  TS_CHECK(r.begin >= 0 && r.end <= padded_, "range [{}, {}) outside {} elements", r.begin, r.end,
           padded_);
  return Tensor{static_cast<char*>(flat.data) + r.begin * dtype_size(flat.dtype), flat.dtype,
                Shape{r.count()}, flat.device};
}

std::vector<Communicator*> DataParallel::comms() const {
  std::vector<Communicator*> out{&comm_};
  if (experts_.expert_data) out.push_back(experts_.expert_data);
  return out;
}

void DataParallel::begin_micro_batch(bool last) {
  armed_ = last && options_.overlap_grad_reduce;
  next_bucket_ = 0;
}

// A bucket of a group of one (the expert runs when every rank holds other experts) is its
// own sum.
void DataParallel::reduce_bucket(const Bucket& b, Lane lane) {
  if (b.comm == nullptr) return;
  const Tensor bucket = padded_view(model_.grads(), b.range);
  if (options_.shard_optimizer)
    b.comm->reduce_scatter(padded_view(model_.grads(), b.shard), bucket, lane);
  else
    b.comm->all_reduce(bucket, ReduceOp::Sum, lane);
}

// Offsets from the unit's first element up get no further contributions.
void DataParallel::grads_ready(int unit) {
  if (!armed_) return;
  const int64_t ready_from = model_.layout().units[unit].begin;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].range.begin >= ready_from)
    reduce_bucket(buckets_[next_bucket_++], Lane::Comm);
}

void DataParallel::finish_gradient_reduction() {
  settle();
  const Lane lane = options_.overlap_grad_reduce ? Lane::Comm : Lane::Compute;
  while (next_bucket_ < buckets_.size()) reduce_bucket(buckets_[next_bucket_++], lane);
  armed_ = false;
  if (lane == Lane::Comm)
    for (Communicator* c : comms()) c->wait_comm();
}

void DataParallel::grad_norm_sq(const Tensor& out) {
  Backend& b = model_.backend();
  if (options_.shard_optimizer) {
    // Every element is in exactly one rank's shards.
    b.fill(out, 0.0f);
    for (const OwnedParams& o : optimizer_shards())
      b.sum_squares(out, o.grads, /*accumulate=*/true);
    sum(out);
    return;
  }
  // Plain: each rank holds the whole reduced gradient (and, with experts, its own experts').
  grad_norm_sq_of(out, {{0, model_.layout().total}});
}

void DataParallel::grad_norm_sq_of(const Tensor& out, const std::vector<ParamRange>& ranges) {
  if (options_.shard_optimizer || experts_.expert_parallel == nullptr)
    return DataParallelism::grad_norm_sq_of(out, ranges);
  // Every rank holds the reduced dense gradients and its experts' (the same as its
  // expert-data-parallel peers'): the experts' squares summed over the expert-parallel ranks,
  // then the dense ones added.
  Backend& b = model_.backend();
  const std::vector<ParamRange>& experts = model_.layout().expert_runs;
  b.fill(out, 0.0f);
  for (const ParamRange& r : intersect(ranges, experts))
    b.sum_squares(out, model_.grads().flat_range(r.begin, r.count()), /*accumulate=*/true);
  settle();
  experts_.expert_parallel->all_reduce(out, ReduceOp::Sum, Lane::Compute);
  for (const ParamRange& r : intersect(ranges, complement(experts, model_.layout().total)))
    b.sum_squares(out, model_.grads().flat_range(r.begin, r.count()), /*accumulate=*/true);
}

void DataParallel::params_updated() {
  if (!options_.shard_optimizer) return;
  settle();
  // The forward reads the buffer from offset 0 up: overlapped, gather the buckets in that
  // order.
  for (size_t k = buckets_.size(); k-- > 0;) {
    const Bucket& b = buckets_[k];
    if (b.comm == nullptr) continue;
    const Tensor whole = padded_view(model_.params(), b.range);
    const Tensor mine = padded_view(model_.params(), b.shard);
    if (!options_.overlap_param_gather) {
      b.comm->all_gather(whole, mine, Lane::Compute);
      continue;
    }
    b.comm->all_gather(whole, mine, Lane::Comm);
    gathers_.push_back({b.range.begin, b.comm, b.comm->comm_mark()});
  }
}

// The prefix of the flat buffer up to the unit's end must be current.
void DataParallel::params_needed(int unit, int /*next*/) {
  const int64_t needed_end = model_.layout().units[unit].end;
  while (next_gather_ < gathers_.size() && gathers_[next_gather_].begin < needed_end) {
    const GatherInFlight& g = gathers_[next_gather_++];
    g.comm->wait_comm_mark(g.mark);
  }
  if (next_gather_ == gathers_.size()) gathers_.clear(), next_gather_ = 0;
}

void DataParallel::settle() {
  if (gathers_.empty()) return;
  for (Communicator* c : comms()) c->wait_comm();
  gathers_.clear();
  next_gather_ = 0;
}

std::unique_ptr<DataParallelism> make_data_parallelism(Communicator& comm, Model& model,
                                                       const DataParallelOptions& options,
                                                       ExpertCommunicators experts) {
  if (options.fully_shard) {
    TS_CHECK(experts.expert_parallel == nullptr, "FSDP with expert parallelism");
    if (model.frozen_layout()) return std::make_unique<FrozenShardedDataParallel>(comm, model, options);
    return std::make_unique<FullyShardedDataParallel>(comm, model);
  }
  return std::make_unique<DataParallel>(comm, model, options, experts);
}

}  // namespace tessera::dist
