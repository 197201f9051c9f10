#include "tessera/train/frozen_reference.h"

#include "tessera/distributed/parallelism.h"
#include "tessera/model/model.h"
#include "tessera/optim/adamw_optimizer.h"

namespace tessera {

FrozenReference::FrozenReference(Backend& backend, AdamWOptimizer& optimizer, Model& model,
                                 dist::Parallelism& parallel)
    : backend_(backend), optimizer_(optimizer), model_(model), parallel_(parallel) {
  const std::vector<OwnedParams>& shards = optimizer_.owned_params();
  const bool restorable = optimizer_.restores_params();
  size_t bytes = 0;
  for (const OwnedParams& o : shards) bytes += o.params.nbytes();
  buffer_ = DeviceBuffer(backend_, bytes * (restorable ? 1 : 2), "reference weights");
  size_t at = 0;
  for (const OwnedParams& o : shards) {
    frozen_.push_back(buffer_.tensor(o.params.dtype, o.params.shape, at));
    backend_.copy(frozen_.back(), o.params);
    if (!restorable) saved_.push_back(buffer_.tensor(o.params.dtype, o.params.shape, bytes + at));
    at += o.params.nbytes();
  }
}

// Back from the optimizer's master weights, or from the copy kept where it has none.
void FrozenReference::use(bool reference) {
  const std::vector<OwnedParams>& shards = optimizer_.owned_params();
  const bool kept = !saved_.empty();
  for (size_t i = 0; i < shards.size(); ++i) {
    if (reference) {
      if (kept) backend_.copy(saved_[i], shards[i].params);
      backend_.copy(shards[i].params, frozen_[i]);
    } else if (kept) {
      backend_.copy(shards[i].params, saved_[i]);
    }
  }
  if (reference || kept) {
    model_.params_updated();
  } else {
    optimizer_.sync_params_from_master();
  }
  parallel_.params_updated();  // ZeRO-1 gathers them, FSDP drops its gathered units
}

}  // namespace tessera
