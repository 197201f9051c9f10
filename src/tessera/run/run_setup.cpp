#include "tessera/run/run_setup.h"

#include "tessera/config/validate.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/config/blend.h"
#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/pipeline_schedule.h"

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

// Chat data (preprocess --chat: a roles stream beside the tokens) whose loss mask leaves
// tokens out: SFT's prompts and system turns, wrapped or packed.
bool masked_chat_data(const Experiment& e) {
  if (e.data.mock_data || e.data.loss_mask == LossMask::All) return false;
  for (const auto& [key, blend] : {std::pair<const char*, const std::string&>{"data_path", e.data.data_path},
                                    {"train_data_path", e.data.train_data_path}}) {
    if (blend.empty() || is_text_corpus_path(blend)) continue;
    for (const BlendEntry& b : parse_blend(blend, key, origin_of(e, key)))
      if (std::filesystem::exists(chat_roles_prefix(b.prefix) + ".idx")) return true;
  }
  return false;
}

}  // namespace

StateSharding state_sharding(const TrainingConfig& t, int data_parallel_size) {
  if (data_parallel_size <= 1) return StateSharding::None;
  if (t.use_torch_fsdp2) return StateSharding::Fsdp;
  return t.use_distributed_optimizer ? StateSharding::Zero1 : StateSharding::None;
}

dist::DeviceMesh device_mesh(const TrainingConfig& t, int world_size) {
  return dist::DeviceMesh(world_size, {.tp = static_cast<int>(t.tensor_model_parallel_size),
                                       .pp = static_cast<int>(t.pipeline_model_parallel_size),
                                       .cp = static_cast<int>(t.context_parallel_size),
                                       .ep = static_cast<int>(t.expert_model_parallel_size)});
}

RunSetup make_run_setup(const Experiment& e, const RunDevices& devices,
                        const std::function<int64_t()>& tokenizer_vocab) {
  const TrainingConfig& t = e.training;
  RunSetup s;
  s.mesh = device_mesh(t, devices.world_size);
  // Mock data draws from the model's whole vocabulary, as in Megatron; real text from the
  // tokenizer's.
  // NullTokenizer's vocabulary is its vocab_size ids and the end-of-document id.
  const int64_t declared =
      e.model_config.vocab_size + (e.data.tokenizer_type == TokenizerType::Null ? 1 : 0);
  s.data_vocab = e.data.mock_data && e.model_config.vocab_size > 0 ? declared : tokenizer_vocab();
  s.spec = make_model_spec(e, s.data_vocab);
  const int tp = s.mesh.size(dist::MeshDim::TP), dp = s.mesh.size(dist::MeshDim::DP);
  // The family derives the MLP width, so only now can its split be checked.
  if (s.spec.ffn % tp != 0) {
    const auto origin = e.origin.find("tensor_model_parallel_size");
    throw ConfigError(origin == e.origin.end() ? "default" : origin->second,
                      "tensor_model_parallel_size", std::to_string(tp),
                      fmt::format("a divisor of the MLP width ({}, derived from hidden_size): each "
                                  "tensor-parallel rank holds an equal share",
                                  s.spec.ffn));
  }
  // ZeRO-1 shards over the ranks that reduce gradients together: data x context parallel.
  s.sharding = state_sharding(t, dp * s.mesh.size(dist::MeshDim::CP));
  s.accumulation_steps = t.global_batch_size / (t.micro_batch_size * dp);
  s.ddp_bucket_size = t.ddp_bucket_size;
  s.backend = backend_options(t);

  ModelRuntime& rt = s.runtime;
  rt.micro_batch = t.micro_batch_size;
  // Under context parallelism each rank holds 2 of the 2 x cp chunks of every sequence.
  const int cp = s.mesh.size(dist::MeshDim::CP);
  rt.seq_length = t.seq_length / cp;
  rt.context_parallel_size = cp;
  rt.context_parallel_rank = s.mesh.coordinate(devices.rank, dist::MeshDim::CP);
  rt.compute_dtype = compute_dtype(t.precision, devices.auto_compute_dtype);
  rt.grad_dtype = t.grad_reduce_in_bf16 ? DType::BF16 : t.main_grads_dtype;
  s.optimizer = OptimizerDtypes::from(t);
  s.lora = lora_options(t);
  s.reference_copy =
      (t.objective == Objective::Dpo && !t.dpo_precompute_ref_log_probs && !t.dpo_reference_free) ||
      (t.objective == Objective::Grpo && t.grpo_beta > 0);
  s.reference_loaded = !e.checkpoint.reference_load.empty();
  if (t.objective == Objective::Grpo) {
    // Split placement: the training ranks hold no generator (the generation ranks' memory is
    // their weights and the generator's buffers, checked as they allocate).
    s.generation_batch = t.grpo_generation_gpus > 0 ? 0 : grpo_generation_slots(t, dp);
    s.link_completions = t.grpo_generation_gpus > 0 ? grpo_link_completions(e, dp) : 0;
    s.global_batch = t.global_batch_size;
    s.reward_terms = grpo_reward_terms(t.grpo_rewards).size();
    s.offload_optimizer_state = t.grpo_offload_optimizer_state;
  }
  // What validation could not know before the device was: what precision auto means.
  if (s.optimizer.main_params != DType::F32 && rt.compute_dtype != s.optimizer.main_params)
    throw ConfigError(origin_of(e, "main_params_dtype"), "main_params_dtype",
                      std::string(dtype_name(s.optimizer.main_params)),
                      fmt::format("fp32 with {} parameters: bf16 main parameters are the bf16 "
                                  "parameters themselves (precision bf16, or auto on a GPU)",
                                  dtype_name(rt.compute_dtype)));
  // bf16 gradients come out of bf16 GEMMs on GPUs; the CPU reference rounds its fp32 ones.
  if (rt.grad_dtype == DType::BF16 && rt.compute_dtype == DType::F32 &&
      devices.auto_compute_dtype == DType::BF16) {
    const bool reduce_key = t.grad_reduce_in_bf16;
    const char* key = reduce_key ? "grad_reduce_in_bf16" : "main_grads_dtype";
    throw ConfigError(origin_of(e, key), key, reduce_key ? "true" : "bf16",
                      fmt::format("{} with fp32 parameters on a GPU: bf16 gradients are written "
                                  "by bf16 GEMMs (precision bf16 or auto)",
                                  reduce_key ? "false" : "fp32"));
  }
  rt.recompute = t.recompute_granularity;
  rt.recompute_method = t.recompute_method;
  rt.recompute_num_layers = t.recompute_num_layers;
  rt.cross_entropy_chunk_tokens = t.cross_entropy_chunk_tokens;
  rt.reset_position_ids = e.data.reset_position_ids;
  rt.reset_attention_mask = e.data.reset_attention_mask;
  // Objectives and data whose targets leave rows out (prompts, padding, end-of-document).
  rt.head_on_loss_rows = t.objective != Objective::Lm || e.data.eod_mask_loss ||
                         e.data.packing_strategy == PackingStrategy::Bfd || masked_chat_data(e);
  rt.fp8 = fp8_options(t);
  rt.fp8_attention = t.fp8_dot_product_attention;
  rt.moe_force_balance = t.moe_force_balance;
  rt.expert_parallel_size = s.mesh.size(dist::MeshDim::EP);
  rt.expert_parallel_rank = s.mesh.coordinate(devices.rank, dist::MeshDim::EP);
  rt.tensor_parallel_size = tp;
  rt.tensor_parallel_rank = s.mesh.coordinate(devices.rank, dist::MeshDim::TP);
  // Megatron turns sequence parallelism off without tensor parallelism.
  rt.sequence_parallel = t.sequence_parallel && tp > 1;
  const int pp = s.mesh.size(dist::MeshDim::PP);
  if (pp > 1) {
    // This rank's layers, and the micro-batches its stage holds at once in a training step
    // and in an evaluation.
    const int stage = s.mesh.coordinate(devices.rank, dist::MeshDim::PP);
    const int chunks = static_cast<int>(virtual_pipeline_chunks(t, s.spec.num_layers));
    rt.pipeline_chunks =
        dist::pipeline_layers(s.spec.num_layers, pp, chunks, t.decoder_first_pipeline_num_layers,
                              t.decoder_last_pipeline_num_layers, stage);
    const dist::PipelineSchedule step(pp, chunks, s.accumulation_steps, true);
    const dist::PipelineSchedule evaluation(pp, chunks, std::max<int64_t>(1, e.data.eval_iters),
                                            false);
    rt.pipeline_slots = std::max(step.slots(stage), evaluation.slots(stage));
  }
  // DPO keeps both answers of a pair (chosen in slot 0, rejected in slot 1) from their forward
  // passes to their backward passes, which the loss on both must come between.
  // The loss's gradient at each position is kept from the forward too (a tokens x vocabulary
  // tensor per answer), so that the backward does not run the output head's forward again.
  // Over pipeline stages a pair is one micro-batch of its two answers instead, which the
  // schedule keeps in one slot until the last stage's backward (run_scaled_micro_batches).
  if (t.objective == Objective::Dpo) {
    if (pp > 1) {
      rt.micro_batch = 2;
    } else {
      rt.pipeline_slots = std::max(rt.pipeline_slots, 2);
    }
    rt.keep_logit_grads = true;
  }
  // Context-parallel ranks reduce their gradients with the data-parallel ones (Megatron's
  // dp-cp group), so the buffers split over both.
  if (dp * cp > 1) {
    rt.flat_buffer_multiple = dist::flat_buffer_multiple(dp * cp);
    rt.sharded_params = s.sharding == StateSharding::Fsdp;
    rt.fp8_unit_copies = rt.sharded_params;
  }
  return s;
}

void check_fp8_gemm_multiple(const Experiment& e, int64_t multiple, std::string_view device) {
  const TrainingConfig& t = e.training;
  if (t.fp8 == Fp8Mode::Off) return;
  const auto origin = [&](const std::string& key) {
    return e.origin.count(key) ? e.origin.at(key) : std::string("default");
  };
  if (t.micro_batch_size * t.seq_length % multiple != 0)
    throw ConfigError(origin("seq_length"), "seq_length", std::to_string(t.seq_length),
                      fmt::format("micro_batch_size x seq_length (now {}) a multiple of {} with "
                                  "fp8 on {}",
                                  t.micro_batch_size * t.seq_length, multiple, device));
  if (t.fp8_lm_head && t.cross_entropy_chunk_tokens % multiple != 0)
    throw ConfigError(origin("cross_entropy_chunk_tokens"), "cross_entropy_chunk_tokens",
                      std::to_string(t.cross_entropy_chunk_tokens),
                      fmt::format("a multiple of {} with fp8_lm_head on {}", multiple, device));
}

}  // namespace tessera
