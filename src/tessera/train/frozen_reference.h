#pragma once
// A frozen copy of a policy's starting weights on the device, the reference that DPO (with
// dpo_precompute_ref_log_probs false) and GRPO (with a KL term) compare the policy against.
// It is split as the optimizer splits the policy's weights (whole under plain data
// parallelism, this rank's shard under ZeRO-1 and FSDP, its tensor-parallel part), and swapped
// into the policy's place for the reference's passes.
#include <cstddef>
#include <vector>

#include "tessera/ops/device_buffer.h"

namespace tessera {

class AdamWOptimizer;
class Model;
namespace dist {
class Parallelism;
}

class FrozenReference {
 public:
  // Copies the weights the optimizer updates, as they are now. Where the optimizer keeps no
  // whole master copy to restore the policy's weights from (fp32 weights of an unsharded run,
  // bf16 main parameters, a split master whose high halves the reference's overwrite), room
  // for theirs is kept beside the copy (the memory planner counts both).
  FrozenReference(Backend& backend, AdamWOptimizer& optimizer, Model& model, dist::Parallelism& parallel);

  size_t bytes() const { return buffer_.bytes(); }
  // The reference's weights in the policy's place (true), or the policy's back (false).
  void use(bool reference);

 private:
  Backend& backend_;
  AdamWOptimizer& optimizer_;
  Model& model_;
  dist::Parallelism& parallel_;
  DeviceBuffer buffer_;
  std::vector<Tensor> frozen_, saved_;
};

}  // namespace tessera
