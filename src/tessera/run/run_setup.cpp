#include "tessera/run/run_setup.h"

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

  ModelRuntime& rt = s.runtime;
  rt.micro_batch = t.micro_batch_size;
  rt.seq_length = t.seq_length;
  rt.compute_dtype = compute_dtype(t.precision, devices.auto_compute_dtype);
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
