#pragma once
// Every activation of a model in one planned allocation, sized before anything runs so that the
// memory a run needs is known up front and nothing is allocated inside a step. Tensors are
// declared with how long their values must live, which decides where they go:
//   stored         its own bytes (residual states, what the backward reads);
//   a recomputed layer's
//                  between begin_layer(true) and end_layer(): every fully recomputed layer's
//                  tensors share one region, refilled by the layer's recompute pass before
//                  its backward (recompute_granularity full); the layers of one group of
//                  Megatron's uniform method (begin_layer(true, true) for all but its first)
//                  follow each other in it, since the group re-runs as a whole;
//   recomputable   with selective recompute, one region shared by every such tensor, refilled
//                  by its block just before each use (norm outputs, the SwiGLU output);
//                  otherwise stored;
//   backward scratch
//                  between begin_backward_scratch() and end_backward_scratch(): live only inside
//                  one block's backward, so every block's set shares one region;
//   shared         (Keep::Shared) live only within one forward or backward call of one
//                  micro-batch (the head's logits and statistics, gathers): its own bytes,
//                  once whatever the slots.
// A region shared by several sets is as large as the largest set.
//
// Slots (pipeline parallelism): a stage holds the stored activations of several micro-batches
// at once, so the stored region is repeated once per slot, and bind(buffer, slot) points the
// stored tensors at that slot's copy; the other regions are used by one pass at a time and
// exist once.
#include <cstddef>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

enum class Keep { Stored, Recomputable, Shared };

class ActivationPlan {
 public:
  explicit ActivationPlan(bool selective_recompute, int slots = 1)
      : selective_(selective_recompute), slots_(slots) {}

  void add(Tensor* target, DType dtype, Shape shape, Keep keep = Keep::Stored);

  // `continues_group`: a recomputed layer placed after the previous one in the region rather
  // than over it.
  void begin_layer(bool recomputed, bool continues_group = false);
  void end_layer();
  void begin_backward_scratch();
  void end_backward_scratch();

  size_t bytes() const;
  // Points every declared tensor into `buffer` (at least bytes() long), the stored ones into
  // slot `slot`'s copy.
  void bind(const DeviceBuffer& buffer, int slot = 0) const;
  // Bytes from a stored tensor in one slot to the same tensor in the next.
  size_t slot_stride() const { return sizes_[kStored]; }

 private:
  enum Region { kStored, kShared, kRecomputedLayers, kRecomputable, kBackwardScratch, kRegions };
  struct Item {
    Tensor* target;
    DType dtype;
    Shape shape;
    Region region;
    size_t offset;  // within the region
  };
  void place(Tensor* target, DType dtype, Shape shape, Region region);

  bool selective_;
  int slots_;
  Region current_ = kStored;  // where add() puts stored tensors now
  size_t cursor_ = 0;         // next offset in a shared region's current set
  size_t sizes_[kRegions] = {};
  std::vector<Item> items_;
};

}  // namespace tessera
