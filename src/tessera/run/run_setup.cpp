#include "tessera/run/run_setup.h"

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/distributed/data_parallel.h"

namespace tessera {
namespace {

DType compute_dtype(Precision p, DType auto_dtype) {
  switch (p) {
    case Precision::Fp32:
      return DType::F32;
    case Precision::Bf16:
      return DType::BF16;
    case Precision::Auto:
      return auto_dtype;
  }
  return auto_dtype;
}

std::string origin_of(const Experiment& e, const std::string& key) {
  const auto it = e.origin.find(key);
  return it == e.origin.end() ? std::string("default") : it->second;
}

}  // namespace

StateSharding state_sharding(const TrainingConfig& t, int world_size) {
  if (world_size <= 1) return StateSharding::None;
  if (t.use_torch_fsdp2) return StateSharding::Fsdp;
  return t.use_distributed_optimizer ? StateSharding::Zero1 : StateSharding::None;
}

RunSetup make_run_setup(const Experiment& e, const RunDevices& devices,
                        const std::function<int64_t()>& tokenizer_vocab) {
  const TrainingConfig& t = e.training;
  RunSetup s;
  dist::MeshSizes sizes;
  sizes.ep = static_cast<int>(t.expert_model_parallel_size);
  s.mesh = dist::DeviceMesh(devices.world_size, sizes);
  // Mock data draws from the model's whole vocabulary, as in Megatron; real text from the
  // tokenizer's.
  s.data_vocab = e.data.mock_data && e.model_config.vocab_size > 0 ? e.model_config.vocab_size
                                                                   : tokenizer_vocab();
  s.spec = make_model_spec(e, s.data_vocab);
  s.sharding = state_sharding(t, devices.world_size);
  const int dp = s.mesh.size(dist::MeshDim::DP);
  s.accumulation_steps = t.global_batch_size / (t.micro_batch_size * dp);
  s.ddp_bucket_size = t.ddp_bucket_size;
  s.attention_backend = t.attention_backend;

  ModelRuntime& rt = s.runtime;
  rt.micro_batch = t.micro_batch_size;
  rt.seq_length = t.seq_length;
  rt.compute_dtype = compute_dtype(t.precision, devices.auto_compute_dtype);
  rt.grad_dtype = t.main_grads_dtype;
  s.optimizer = OptimizerDtypes::from(t);
  // What validation could not know before the device was: what precision auto means.
  if (s.optimizer.main_params != DType::F32 && rt.compute_dtype != s.optimizer.main_params)
    throw ConfigError(origin_of(e, "main_params_dtype"), "main_params_dtype",
                      std::string(dtype_name(s.optimizer.main_params)),
                      fmt::format("fp32 with {} parameters: bf16 main parameters are the bf16 "
                                  "parameters themselves (precision bf16, or auto on a GPU)",
                                  dtype_name(rt.compute_dtype)));
  // bf16 gradients come out of bf16 GEMMs on GPUs; the CPU reference rounds its fp32 ones.
  if (rt.grad_dtype == DType::BF16 && rt.compute_dtype == DType::F32 &&
      devices.auto_compute_dtype == DType::BF16)
    throw ConfigError(origin_of(e, "main_grads_dtype"), "main_grads_dtype", "bf16",
                      "fp32 with fp32 parameters on a GPU: bf16 gradients are written by bf16 "
                      "GEMMs (precision bf16 or auto)");
  rt.recompute = t.recompute_granularity;
  rt.recompute_num_layers = t.recompute_num_layers;
  rt.cross_entropy_chunk_tokens = t.cross_entropy_chunk_tokens;
  rt.fp8 = fp8_options(t);
  rt.moe_force_balance = t.moe_force_balance;
  rt.expert_parallel_size = s.mesh.size(dist::MeshDim::EP);
  if (devices.world_size > 1) {
    rt.flat_buffer_multiple = dist::flat_buffer_multiple(devices.world_size);
    rt.sharded_params = s.sharding == StateSharding::Fsdp;
  }
  return s;
}

}  // namespace tessera
