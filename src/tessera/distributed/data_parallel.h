#pragma once
// Data parallelism, applied from outside the single-device model: the model reports, through
// its unit observer (ParamUnitObserver), when it reads each unit's parameters and when each
// unit's gradients are final.
//
// Three ways to share a step (make_data_parallelism picks one):
//   plain DP   (DataParallel) all-reduce (sum) of gradient buckets; the loss scale already
//              divides by the global token count, so the sum is the mean gradient of the
//              global batch. Every rank holds everything.
//   ZeRO-1     (DataParallel, use_distributed_optimizer) reduce-scatter of every bucket: rank
//              r receives the sum of slice r of each bucket and keeps fp32 master weights and
//              AdamW moments only for those slices; after the update every rank's bf16 slices
//              are all-gathered back into each rank's full parameter buffer. With
//              overlap_param_gather the gathers run on the communicator's stream, lowest
//              offsets first, and the next forward waits for each bucket only when it reaches
//              the unit that reads it.
//   FSDP       (FullyShardedDataParallel, use_torch_fsdp2; fully_sharded.h) ZeRO-3: parameters
//              and gradients are sharded too, gathered per unit just in time.
// Buckets (DP, ZeRO-1): the flat buffer, padded to a multiple of 64 x world elements, is cut
// into buckets of about ddp_bucket_size elements from the top down, the order in which the
// backward finishes them. In the last micro-batch of a step each bucket's reduction is queued
// on the communicator's own stream as soon as the backward has passed it, so it overlaps with
// the backward of the layers below (overlap_grad_reduce).
// Expert parallelism: each rank holds its experts' stacks only (ParamLayout::expert_runs), the
// same as the other ranks of its expert-data-parallel group (Megatron's expt_dp). The expert
// runs' gradients are bucketed and reduced (or ZeRO-1 sharded and gathered) over that group,
// everything else over every data-parallel rank, each in its own buckets.
// The gradient norm is always that of the global batch's mean gradient (clipping agrees on
// every rank).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/model/model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::dist {

// Elements every bucket boundary is a multiple of: shards of 64-element (256-byte fp32)
// granules keep the optimizer's vector loads aligned.
int64_t flat_buffer_multiple(int world_size);

struct BucketPlan {
  int64_t params = 0;  // elements in use
  int64_t padded = 0;  // params rounded up to flat_buffer_multiple(world)
  int world = 1;
  std::vector<ParamRange> buckets;  // cover the planned ranges, highest offsets first

  // Rank r's slice of bucket k (ZeRO-1).
  ParamRange shard(size_t k, int rank) const;
  // Rank r's slices of every bucket, clipped to [0, params), in increasing order.
  std::vector<ParamRange> owned(int rank) const;
};

// Buckets covering [0, padded).
BucketPlan plan_buckets(int64_t params, int64_t bucket_elements, int world_size);
// Buckets covering `ranges` (increasing, each a multiple of flat_buffer_multiple(world_size)
// long) of a buffer of `params` elements; no bucket spans two of them.
BucketPlan plan_buckets(const std::vector<ParamRange>& ranges, int64_t params,
                        int64_t bucket_elements, int world_size);

// Where a layout's gradients are reduced: the expert runs (ParamLayout::expert_runs) over the
// world / ep expert-data-parallel ranks, the rest over all `world` data-parallel ranks.
// Without expert runs every element is dense.
struct ReductionPlan {
  BucketPlan dense, experts;
  // Shards (ZeRO-1) of the rank that is `dense_rank` of every data-parallel rank and
  // `expert_rank` of its expert-data-parallel group, in increasing order.
  std::vector<ParamRange> owned(int dense_rank, int expert_rank) const;
};
ReductionPlan plan_reduction(const ParamLayout& layout, int64_t bucket_elements, int world,
                             int expert_parallel);

struct DataParallelOptions {
  bool shard_optimizer = false;  // use_distributed_optimizer (ZeRO-1)
  bool fully_shard = false;      // use_torch_fsdp2 (ZeRO-3)
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = false;  // ZeRO-1 only
  int64_t bucket_elements = 40'000'000;
};

// Data parallelism of every kind: the collectives over its ranks.
class DataParallelism : public Parallelism {
 public:
  ~DataParallelism() override;

  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.size(); }
  int data_parallel_rank() const override { return comm_.rank(); }
  int data_parallel_size() const override { return comm_.size(); }
  Tensor gathered_param(int index) override;
  // For a layout that splits the model itself (MeshParallelism), once
  // finish_gradient_reduction returned: the reduced gradient of `range` (flat layout) as this
  // rank holds it (the model's gradients; FSDP's shard pieces), and the squared norm of the
  // gradients in `ranges`, each element counted once over the data-parallel ranks (summed
  // over them where each holds a share: ZeRO-1's slices, FSDP's shards).
  virtual std::vector<Tensor> grad_pieces(const ParamRange& range) const;
  virtual void grad_norm_sq_of(const Tensor& out, const std::vector<ParamRange>& ranges);
  void sum(const Tensor& t) override;
  void max(const Tensor& t) override;
  void barrier() override;
  // Makes compute wait for every collective still in flight on Lane::Comm and drops the comm
  // marks kept for finer waits. Called before each collective on Lane::Compute (sum, max,
  // barrier): the communicator waits there anyway, which ends the marks' validity. Layouts
  // that hold data parallelism call it before their own collectives on the compute stream.
  virtual void settle() = 0;

 protected:
  DataParallelism(Communicator& comm, Model& model);

  Communicator& comm_;
  Model& model_;

 private:
  DeviceBuffer barrier_buffer_;
};

// With expert parallelism: the groups a rank's experts' gradients are summed over (not owned).
struct ExpertCommunicators {
  Communicator* expert_parallel = nullptr;  // ranks holding the other experts
  Communicator* expert_data = nullptr;      // ranks holding the same experts; null when alone
};

// Plain data parallelism and ZeRO-1. The model must have been built with
// runtime.flat_buffer_multiple = flat_buffer_multiple(comm.size()).
class DataParallel : public DataParallelism, private ParamUnitObserver {
 public:
  DataParallel(Communicator& comm, Model& model, const DataParallelOptions& options,
               ExpertCommunicators experts = {});
  ~DataParallel() override;

  std::string description() const override;
  std::vector<OwnedParams> optimizer_shards() const override;
  void begin_micro_batch(bool last) override;
  void finish_gradient_reduction() override;
  void grad_norm_sq(const Tensor& out) override;
  void grad_norm_sq_of(const Tensor& out, const std::vector<ParamRange>& ranges) override;
  // ZeRO-1: every rank's updated parameter slices to every rank. Overlapped, the parameters
  // are complete only for the next forward (as it goes) or after settle().
  void params_updated() override;
  void params_complete() override { settle(); }

 protected:
  void settle() override;

 private:
  void params_needed(int unit, int next) override;
  void grads_ready(int unit) override;
  // A bucket of either plan, with the group that reduces it (null: a group of one).
  struct Bucket {
    ParamRange range, shard;
    Communicator* comm;
  };
  void reduce_bucket(const Bucket& b, Lane lane);
  Tensor padded_view(const Tensor& flat, const ParamRange& r) const;
  std::vector<Communicator*> comms() const;

  DataParallelOptions options_;
  ExpertCommunicators experts_;
  ReductionPlan plan_;
  std::vector<Bucket> buckets_;  // both plans', highest offsets first
  int64_t padded_ = 0;
  bool armed_ = false;
  size_t next_bucket_ = 0;
  struct GatherInFlight {
    int64_t begin;  // the bucket's first element
    Communicator* comm;
    int mark;  // comm->comm_mark() after its all-gather
  };
  std::vector<GatherInFlight> gathers_;  // increasing offsets; front: the next to wait for
  size_t next_gather_ = 0;
};

// The kind `options` asks for, installed as the model's unit observer. With fully_shard the
// model must have been built with runtime.sharded_params.
std::unique_ptr<DataParallelism> make_data_parallelism(Communicator& comm, Model& model,
                                                       const DataParallelOptions& options,
                                                       ExpertCommunicators experts = {});

}  // namespace tessera::dist
