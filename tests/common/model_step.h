#pragma once
// One forward-backward of a freshly initialised model on the CPU, with the batch every model
// test uses (tokens and targets below 64 from the seeded generator): its loss sum, gradients
// and MoE statistics, for tests that compare runtimes (recompute, force-balance) of one model.
#include <cstdint>
#include <vector>

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::testing {

struct ModelStep {
  float loss_sum = 0;
  std::vector<float> grads, moe_stats;  // moe_stats empty for a dense model
};

// The seeded initialisation every model test starts from (fp32 weights).
inline void init_test_model(Backend& backend, const ModelSpec& spec, DecoderModel& model) {
  const int64_t P = model.layout().total;
  DeviceBuffer master(backend, P * sizeof(float), "master");
  init_parameters(backend, spec, model.layout(), master.tensor(DType::F32, {P}), 7);
  backend.copy(model.params(), master.tensor(DType::F32, {P}));
}

inline ModelStep one_model_step(const ModelSpec& spec, const ModelRuntime& rt) {
  auto backend = make_cpu_backend();
  DecoderModel model(*backend, spec, rt);
  const int64_t P = model.layout().total;
  init_test_model(*backend, spec, model);
  const int64_t N = rt.micro_batch * rt.seq_length;
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>(random_below(1, i, 64));
    targets[i] = static_cast<int32_t>(random_below(2, i, 64));
  }
  model.set_batch(tokens.data(), targets.data());
  model.zero_loss_sum();
  model.forward_backward(1.0f / N);
  ModelStep r;
  backend->download(&r.loss_sum, model.loss_sum());
  r.grads.resize(P);
  backend->download(r.grads.data(), model.grads());
  if (model.moe_stats().defined()) {
    r.moe_stats.resize(model.moe_stats().numel());
    backend->download(r.moe_stats.data(), model.moe_stats());
  }
  return r;
}

}  // namespace tessera::testing
