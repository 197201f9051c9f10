#pragma once
// What a model keeps beside its parameters that every training step reduces over the ranks,
// updates, checkpoints and reports (FP8's scaling state; the MoE layers' load balance and
// expert bias), as hooks that the trainer drives in one order without knowing what they are.
// A model feature with per-step state of its own is a new hook, not a trainer change.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessera/core/tensor.h"

namespace tessera {

// The step's reductions over a run's ranks as its parallel layout does them (the trainer
// forwards them to dist::Parallelism); on one device each is the identity.
class StepCollectives {
 public:
  virtual ~StepCollectives() = default;
  // In place: the sum over the ranks that hold other samples' figures (data and context
  // parallel ranks, pipeline stages), each replica counted once.
  virtual void sum(const Tensor& t) = 0;
  // In place: the maximum over the ranks that hold the same parameters (data parallel, and
  // the parts of tensor-parallel ones), so that every rank derives the same from it.
  virtual void max_over_replicas(const Tensor& t) = 0;
  // In place: the sum over every rank of the job (a NaN on one rank reaches them all).
  virtual void sum_over_job(const Tensor& t) = 0;
};

// TensorBoard tags and their values.
using NamedScalars = std::vector<std::pair<std::string, double>>;

class StepHook {
 public:
  virtual ~StepHook() = default;

  // Once, before the first step: the collectives its steps reduce with (they outlive the
  // hook's use). Without it a hook reduces nothing: one device.
  virtual void attach(StepCollectives& collectives) { (void)collectives; }
  // After the step's last backward and its gradients' squared norm, before the optimizer:
  // reduces what the step recorded and updates the state. May add to grad_norm_sq: a NaN
  // there skips the update on every rank.
  virtual void end_step(const Tensor& grad_norm_sq) { (void)grad_norm_sq; }
  // On the host after end_step (it waits for the device): reads the step's figures. `passes`
  // forward passes went into them (micro-batches x data-parallel ranks).
  virtual void read_step(int64_t passes) { (void)passes; }
  // What made a skipped step non-finite, where this hook saw it; empty otherwise.
  virtual std::string non_finite_cause() const { return {}; }

  // The state a checkpoint keeps, by name, and the notice that it was loaded into place.
  virtual std::vector<std::pair<std::string, Tensor>> state() const { return {}; }
  virtual void state_restored() {}

  // The last read step's figures under their TensorBoard tags.
  virtual NamedScalars step_scalars() const { return {}; }
  // The log interval's figures (the steps read since end_interval): fields of the iteration
  // line (" | name: value" each), a line of detail for `iteration`'s log (empty: none), and
  // metrics.jsonl's keys.
  virtual std::string interval_fields() const { return {}; }
  virtual std::string interval_detail(int64_t iteration) const {
    (void)iteration;
    return {};
  }
  virtual void add_interval_metrics(nlohmann::json& record) const { (void)record; }
  virtual void end_interval() {}
};

}  // namespace tessera
