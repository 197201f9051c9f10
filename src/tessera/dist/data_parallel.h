#pragma once
// Data parallelism over the model's flat gradient buffer, applied from outside the
// single-device model (the model only reports, through its grads-ready hook, which suffix
// of the gradients is final).
//
// Buckets: the flat buffer, padded to a multiple of 64 x world elements, is cut into
// buckets of about ddp_bucket_size elements from the top down, the order in which the
// backward finishes them. In the last micro-batch of a step each bucket's reduction is
// queued on the communicator's own stream as soon as the backward has passed it, so it
// overlaps with the backward of the layers below (overlap_grad_reduce).
//   plain DP   all-reduce (sum) of every bucket; the loss scale already divides by the
//              global token count, so the sum is the mean gradient of the global batch.
//   ZeRO-1     reduce-scatter of every bucket: rank r receives the sum of slice r of each
//              bucket and keeps fp32 master weights and AdamW moments only for those slices
//              (AdamWOptimizer's owned ranges); after the update every rank's bf16 slices are
//              all-gathered back into each rank's full parameter buffer. With
//              overlap_param_gather the gathers run on the communicator's stream, lowest
//              offsets first, and the next forward waits for each bucket only when it reaches
//              the layer that reads it (the model's params-needed hook).
// The gradient norm is always that of the global batch's mean gradient (clipping agrees on
// every rank).
#include <cstdint>
#include <vector>

#include "tessera/dist/communicator.h"
#include "tessera/model/llama_model.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/train/adamw_optimizer.h"

namespace tessera::dist {

// Elements every bucket boundary is a multiple of: shards of 64-element (256-byte fp32)
// granules keep the optimizer's vector loads aligned.
int64_t flat_buffer_multiple(int world_size);

struct BucketPlan {
  int64_t params = 0;  // elements in use
  int64_t padded = 0;  // params rounded up to flat_buffer_multiple(world)
  int world = 1;
  std::vector<ParamRange> buckets;  // cover [0, padded), highest offsets first

  // Rank r's slice of bucket k (ZeRO-1).
  ParamRange shard(size_t k, int rank) const;
  // Rank r's slices of every bucket, clipped to [0, params), in increasing order.
  std::vector<ParamRange> owned(int rank) const;
};

BucketPlan plan_buckets(int64_t params, int64_t bucket_elements, int world_size);

struct DataParallelOptions {
  bool shard_optimizer = false;      // use_distributed_optimizer (ZeRO-1)
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = false;  // ZeRO-1 only
  int64_t bucket_elements = 40'000'000;
};

class DataParallel {
 public:
  // The model must have been built with runtime.flat_buffer_multiple =
  // flat_buffer_multiple(comm.size()). Installs the model's grads-ready hook.
  DataParallel(Communicator& comm, LlamaModel& model, const DataParallelOptions& options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  const BucketPlan& plan() const { return plan_; }
  // The optimizer's ranges: this rank's shard under ZeRO-1, else empty (everything).
  std::vector<ParamRange> optimizer_ranges() const;

  // Before each micro-batch's forward/backward; `last` arms the overlapped reduction.
  void begin_micro_batch(bool last);
  // After the last micro-batch: queues the buckets not reduced yet and makes the compute
  // stream wait for every reduction.
  void finish_gradient_reduction();
  // out (1) fp32 = squared norm of the reduced (mean) gradient of the global batch.
  void grad_norm_sq(const Tensor& out, const AdamWOptimizer& optimizer);
  // ZeRO-1: after the optimizer step, every rank's updated parameter slices to every rank.
  // Overlapped, the parameters are complete only for the next forward (as it goes) or after
  // settle_params().
  void gather_params();
  // Makes compute wait for every parameter gather still in flight.
  void settle_params();
  // In place: the sum over ranks (losses, counters). Collectives on the compute stream
  // first settle the parameters.
  void sum(const Tensor& t);
  // In place: the maximum over ranks (FP8 amaxes, so every rank scales alike).
  void max(const Tensor& t);
  // Returns on each rank once every rank has called it (steps of a sharded checkpoint save).
  void barrier();

 private:
  void on_grads_ready(int64_t ready_from);
  void on_params_needed(int64_t needed_end);
  void reduce_bucket(size_t k, Lane lane);
  Tensor padded_view(const Tensor& flat, const ParamRange& r) const;

  Communicator& comm_;
  LlamaModel& model_;
  DataParallelOptions options_;
  BucketPlan plan_;
  bool armed_ = false;
  size_t next_bucket_ = 0;
  struct GatherInFlight {
    int64_t begin;  // the bucket's first element
    int mark;       // Communicator::comm_mark() after its all-gather
  };
  std::vector<GatherInFlight> gathers_;  // increasing offsets; front: the next to wait for
  size_t next_gather_ = 0;
  DeviceBuffer barrier_buffer_;
};

}  // namespace tessera::dist
