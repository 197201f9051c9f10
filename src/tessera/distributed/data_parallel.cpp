#include "tessera/distributed/data_parallel.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/distributed/fully_sharded.h"

namespace tessera::dist {

int64_t flat_buffer_multiple(int world_size) {
  return 64 * static_cast<int64_t>(std::max(world_size, 1));
}

BucketPlan plan_buckets(int64_t params, int64_t bucket_elements, int world_size) {
  BucketPlan p;
  p.params = params;
  p.world = std::max(world_size, 1);
  const int64_t g = flat_buffer_multiple(p.world);
  p.padded = (params + g - 1) / g * g;
  const int64_t size = std::max<int64_t>((bucket_elements + g - 1) / g * g, g);
  for (int64_t end = p.padded; end > 0;) {
    const int64_t begin = std::max<int64_t>(end - size, 0);
    p.buckets.push_back({begin, end});
    end = begin;
  }
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

DataParallel::DataParallel(Communicator& comm, Model& model, const DataParallelOptions& options)
    : DataParallelism(comm, model),
      options_(options),
      plan_(plan_buckets(model.layout().total, options.bucket_elements, comm.size())) {
  TS_CHECK(model.runtime().flat_buffer_multiple % flat_buffer_multiple(comm.size()) == 0,
           "the model's buffers are padded to {}, data parallelism needs a multiple of {}",
           model.runtime().flat_buffer_multiple, flat_buffer_multiple(comm.size()));
  // The padding takes part in every reduction: keep it zero (the backward never writes it).
  if (plan_.padded > plan_.params)
    model.backend().fill(padded_view(model.grads(), {plan_.params, plan_.padded}), 0.0f);
  model_.set_unit_observer(this);
}

DataParallel::~DataParallel() {
  model_.set_unit_observer(nullptr);
}

std::string DataParallel::description() const {
  return fmt::format("{}, {} gradient buckets{}{}",
                     options_.shard_optimizer ? "ZeRO-1 optimizer shards" : "replicated optimizer",
                     plan_.buckets.size(),
                     options_.overlap_grad_reduce ? ", reduction overlapped with backward" : "",
                     options_.shard_optimizer && options_.overlap_param_gather
                         ? ", parameter gather overlapped with forward"
                         : "");
}

std::vector<OwnedParams> DataParallel::optimizer_shards() const {
  std::vector<OwnedParams> out;
  if (!options_.shard_optimizer) return out;
  for (const ParamRange& r : plan_.owned(comm_.rank()))
    out.push_back({r, model_.params().flat_range(r.begin, r.count()),
                   model_.grads().flat_range(r.begin, r.count())});
  return out;
}

Tensor DataParallel::padded_view(const Tensor& flat, const ParamRange& r) const {
  // The buffers are allocated for plan_.padded elements; the model's tensors show params.
  TS_CHECK(r.begin >= 0 && r.end <= plan_.padded, "range [{}, {}) outside {} elements", r.begin,
           r.end, plan_.padded);
  return Tensor{static_cast<char*>(flat.data) + r.begin * dtype_size(flat.dtype), flat.dtype,
                Shape{r.count()}, flat.device};
}

void DataParallel::begin_micro_batch(bool last) {
  armed_ = last && options_.overlap_grad_reduce;
  next_bucket_ = 0;
}

void DataParallel::reduce_bucket(size_t k, Lane lane) {
  const Tensor bucket = padded_view(model_.grads(), plan_.buckets[k]);
  if (options_.shard_optimizer)
    comm_.reduce_scatter(padded_view(model_.grads(), plan_.shard(k, comm_.rank())), bucket, lane);
  else
    comm_.all_reduce(bucket, ReduceOp::Sum, lane);
}

// Offsets from the unit's first element up get no further contributions.
void DataParallel::grads_ready(int unit) {
  if (!armed_) return;
  const int64_t ready_from = model_.layout().units[unit].begin;
  while (next_bucket_ < plan_.buckets.size() && plan_.buckets[next_bucket_].begin >= ready_from)
    reduce_bucket(next_bucket_++, Lane::Comm);
}

void DataParallel::finish_gradient_reduction() {
  settle();
  const Lane lane = options_.overlap_grad_reduce ? Lane::Comm : Lane::Compute;
  while (next_bucket_ < plan_.buckets.size()) reduce_bucket(next_bucket_++, lane);
  armed_ = false;
  if (lane == Lane::Comm) comm_.wait_comm();
}

void DataParallel::grad_norm_sq(const Tensor& out) {
  Backend& b = model_.backend();
  if (!options_.shard_optimizer) {
    b.sum_squares(out, model_.grads(), /*accumulate=*/false);
    return;
  }
  b.fill(out, 0.0f);
  for (const ParamRange& r : plan_.owned(comm_.rank()))
    b.sum_squares(out, model_.grads().flat_range(r.begin, r.count()), /*accumulate=*/true);
  sum(out);
}

void DataParallel::params_updated() {
  if (!options_.shard_optimizer) return;
  settle();
  if (!options_.overlap_param_gather) {
    for (size_t k = 0; k < plan_.buckets.size(); ++k)
      comm_.all_gather(padded_view(model_.params(), plan_.buckets[k]),
                       padded_view(model_.params(), plan_.shard(k, comm_.rank())), Lane::Compute);
    return;
  }
  // The forward reads the buffer from offset 0 up: gather the buckets in that order.
  for (size_t k = plan_.buckets.size(); k-- > 0;) {
    comm_.all_gather(padded_view(model_.params(), plan_.buckets[k]),
                     padded_view(model_.params(), plan_.shard(k, comm_.rank())), Lane::Comm);
    gathers_.push_back({plan_.buckets[k].begin, comm_.comm_mark()});
  }
}

// The prefix of the flat buffer up to the unit's end must be current.
void DataParallel::params_needed(int unit, int /*next*/) {
  const int64_t needed_end = model_.layout().units[unit].end;
  while (next_gather_ < gathers_.size() && gathers_[next_gather_].begin < needed_end)
    comm_.wait_comm_mark(gathers_[next_gather_++].mark);
  if (next_gather_ == gathers_.size()) gathers_.clear(), next_gather_ = 0;
}

void DataParallel::settle() {
  if (gathers_.empty()) return;
  comm_.wait_comm();
  gathers_.clear();
  next_gather_ = 0;
}

std::unique_ptr<DataParallelism> make_data_parallelism(Communicator& comm, Model& model,
                                                       const DataParallelOptions& options) {
  if (options.fully_shard) return std::make_unique<FullyShardedDataParallel>(comm, model);
  return std::make_unique<DataParallel>(comm, model, options);
}

}  // namespace tessera::dist
