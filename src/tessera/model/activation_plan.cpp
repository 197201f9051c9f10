#include "tessera/model/activation_plan.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr size_t kAlign = 256;

size_t aligned_bytes(DType dtype, const Shape& shape) {
  const size_t n = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  return (n + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

void ActivationPlan::place(Tensor* target, DType dtype, Shape shape, Region region) {
  const size_t bytes = aligned_bytes(dtype, shape);
  size_t offset = 0;
  if (region == kStored || region == kShared) {
    offset = sizes_[region];
    sizes_[region] += bytes;
  } else if (region == kRecomputable) {
    sizes_[kRecomputable] = std::max(sizes_[kRecomputable], bytes);  // one tensor at a time
  } else {
    offset = cursor_;
    cursor_ += bytes;
    sizes_[region] = std::max(sizes_[region], cursor_);
  }
  items_.push_back({target, dtype, shape, region, offset});
}

void ActivationPlan::add(Tensor* target, DType dtype, Shape shape, Keep keep) {
  if (keep == Keep::Shared && current_ == kStored) return place(target, dtype, shape, kShared);
  const bool recomputable = keep == Keep::Recomputable && selective_ && current_ == kStored;
  place(target, dtype, shape, recomputable ? kRecomputable : current_);
}

void ActivationPlan::begin_layer(bool recomputed, bool continues_group) {
  TS_CHECK(current_ == kStored, "activation plan: a layer began inside another set");
  if (!recomputed) return;
  current_ = kRecomputedLayers;
  if (!continues_group) cursor_ = 0;
}

void ActivationPlan::end_layer() {
  TS_CHECK(current_ != kBackwardScratch, "activation plan: end_layer in backward scratch");
  current_ = kStored;
}

void ActivationPlan::begin_backward_scratch() {
  TS_CHECK(current_ == kStored, "activation plan: backward scratch began inside another set");
  current_ = kBackwardScratch;
  cursor_ = 0;
}

void ActivationPlan::end_backward_scratch() {
  TS_CHECK(current_ == kBackwardScratch, "activation plan: no backward scratch to end");
  current_ = kStored;
}

size_t ActivationPlan::bytes() const {
  size_t total = sizes_[kStored] * static_cast<size_t>(slots_);
  for (int r = 1; r < kRegions; ++r) total += sizes_[r];
  return total;
}

void ActivationPlan::bind(const DeviceBuffer& buffer, int slot) const {
  TS_CHECK(slot >= 0 && slot < slots_, "activation plan: slot {} of {}", slot, slots_);
  size_t base[kRegions] = {};
  base[kShared] = sizes_[kStored] * static_cast<size_t>(slots_);
  for (int r = kShared + 1; r < kRegions; ++r) base[r] = base[r - 1] + sizes_[r - 1];
  base[kStored] = sizes_[kStored] * static_cast<size_t>(slot);
  for (const Item& it : items_)
    *it.target = buffer.tensor(it.dtype, it.shape, base[it.region] + it.offset);
}

}  // namespace tessera
