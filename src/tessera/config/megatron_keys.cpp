#include "tessera/config/megatron_keys.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/config/keys.h"

namespace tessera {
namespace {

bool is_null(const std::string& v) { return v.empty() || v == "null" || v == "~" || v == "None"; }
bool is_true(const std::string& v) { return v == "true" || v == "True" || v == "TRUE" || v == "1"; }
bool is_false(const std::string& v) {
  return v == "false" || v == "False" || v == "FALSE" || v == "0";
}
// "0", "0.0", "1e-0": the same number, as Megatron's argparse reads it.
bool is_number(const std::string& v, double expected) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  return !v.empty() && end == v.c_str() + v.size() && d == expected;
}

// A key that concerns something Tessera has no part of, or whose every value gives Tessera's
// run: any value.
MegatronKey any_value(std::string_view name, std::string_view effect, bool flag = false) {
  MegatronKey k;
  k.name = name, k.flag = flag, k.effect = effect;
  k.check = [](const Experiment&, const std::string&) { return std::string(); };
  return k;
}

// A key whose value must be one of `allowed` (null, Megatron's "not set", always is); `why`
// says what Tessera does instead of the other values.
MegatronKey only(std::string_view name, std::vector<std::string> allowed, std::string_view why,
                 bool flag = false) {
  MegatronKey k;
  k.name = name, k.flag = flag, k.effect = why;
  k.check = [allowed, why](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
    return fmt::format(
        "{}: {}", allowed.empty() ? "null" : fmt::format("{}", fmt::join(allowed, " or ")), why);
  };
  return k;
}

MegatronKey only_false(std::string_view name, std::string_view why) {
  MegatronKey k = only(name, {"false"}, why, true);
  k.check = [why](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || is_false(v)) return "";
    return "false: " + std::string(why);
  };
  return k;
}

MegatronKey only_true(std::string_view name, std::string_view why) {
  MegatronKey k = only(name, {"true"}, why, true);
  k.check = [why](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || is_true(v)) return "";
    return "true: " + std::string(why);
  };
  return k;
}

// A number key whose only value Tessera runs is `value` (dropout 0, rotary_percent 1.0).
MegatronKey only_number(std::string_view name, double value, std::string_view why) {
  MegatronKey k;
  k.name = name, k.effect = why;
  k.check = [value, why](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || is_number(v, value)) return "";
    return fmt::format("{}: {}", value, why);
  };
  return k;
}

// A spelling of the Tessera key `target`, setting it through its own parser from a value
// `translate` makes of Megatron's (empty: leave the key as it is).
MegatronKey spelling(std::string_view name, std::string_view target, std::string_view effect,
                     std::function<std::string(const std::string&)> translate, bool flag = false,
                     std::string_view expected = "") {
  MegatronKey k;
  k.name = name, k.flag = flag, k.sets = target, k.effect = effect;
  k.set = [target, translate, expected](Experiment& e, const std::string& v) -> std::string {
    const std::string value = translate(v);
    if (value == "?") return std::string(expected);
    if (value.empty()) return "";
    const std::string problem = find_key(target)->set(e, value);
    return problem.empty() ? "" : expected.empty() ? problem : std::string(expected);
  };
  return k;
}

std::string same(const std::string& v) {
  return v;
}

std::vector<MegatronKey> build() {
  std::vector<MegatronKey> k;
  // ---- spellings of Tessera keys ----
  k.push_back(spelling(
      "bf16", "precision",
      "Megatron's mixed-precision flag: true is precision: bf16, false is precision: fp32.",
      [](const std::string& v) -> std::string {
        return is_true(v) ? "bf16" : is_false(v) ? "fp32" : "?";
      },
      true, "true or false (precision: bf16 or fp32)"));
  k.push_back(spelling(
      "fp16", "precision",
      "Megatron's fp16 flag: only false; fp16 training (with loss scaling) is not implemented.",
      [](const std::string& v) -> std::string { return is_false(v) ? "" : "?"; }, true,
      "false: fp16 training (half precision with loss scaling) is not implemented; train in "
      "bf16 (--bf16, or precision: bf16) or fp32 (precision: fp32)"));
  k.push_back(spelling("distributed_timeout_minutes", "dist_timeout_minutes",
                       "Megatron's name of dist_timeout_minutes.", same));
  k.push_back(spelling("fp8_format", "fp8",
                       "Megatron's FP8 flag (--fp8-format hybrid|e4m3): sets fp8, the same "
                       "formats (hybrid: E4M3 forward, E5M2 gradients).",
                       same, false, "hybrid or e4m3 (Transformer Engine's formats, as fp8)"));
  k.push_back(spelling(
      "recompute_activations", "recompute_granularity",
      "Megatron's --recompute-activations: true is recompute_granularity: selective (Tessera's "
      "selective recompute re-runs the norms and the SwiGLU); false leaves it.",
      [](const std::string& v) -> std::string {
        return is_true(v) ? "selective" : is_false(v) ? "" : "?";
      },
      true, "true or false (true: recompute_granularity selective)"));
  k.push_back(spelling("moe_router_force_load_balancing", "moe_force_balance",
                       "Primus's name of moe_force_balance (round-robin routing, for benchmarks).",
                       same, true));
  k.push_back(spelling("num_virtual_stages_per_pipeline_rank",
                       "virtual_pipeline_model_parallel_size",
                       "Megatron's newer name of virtual_pipeline_model_parallel_size.", same));

  // ---- architecture: the values Tessera's decoder has ----
  constexpr std::string_view kOwnModel =
      "Tessera builds its own decoder (model families, docs/architecture.md), the same for "
      "Megatron's legacy, core and Transformer Engine implementations.";
  k.push_back(any_value("use_mcore_models", kOwnModel, true));
  k.push_back(any_value("deprecated_use_mcore_models", kOwnModel, true));
  k.push_back(any_value("use_legacy_models", kOwnModel, true));
  k.push_back(any_value("transformer_impl", kOwnModel));
  k.push_back(only("model_type", {"gpt"},
                   "Tessera trains decoder-only GPT models (Mamba and "
                   "hybrid models are not implemented)"));
  k.push_back(only_true("swiglu", "the MLP is SwiGLU (Megatron's GELU MLP is not implemented)"));
  k.push_back(
      only("normalization", {"RMSNorm"}, "the norms are RMSNorm (LayerNorm is not implemented)"));
  k.push_back(only("position_embedding_type", {"rope"},
                   "positions are rotary embeddings (learned absolute positions are not "
                   "implemented)"));
  k.push_back(only_number("rotary_percent", 1.0,
                          "RoPE rotates every dimension of a head (partial rotary embeddings "
                          "are not implemented)"));
  k.push_back(only_false("rotary_interleaved",
                         "RoPE rotates the two halves of a head (interleaved pairs are not "
                         "implemented)"));
  k.push_back(only_number("rotary_seq_len_interpolation_factor", 1.0,
                          "positions are not interpolated (use Llama 3.1's rope scaling, "
                          "use_rope_scaling)"));
  k.push_back(only_true("use_rotary_position_embeddings", "positions are rotary embeddings"));
  k.push_back(
      only_false("add_position_embedding", "positions are rotary embeddings, not learned ones"));
  k.push_back(only_true("disable_bias_linear",
                        "the linear layers have no bias (only the QKV projection may, "
                        "add_qkv_bias); biases on the others are not implemented"));
  k.push_back(only_false("add_bias_linear",
                         "the linear layers have no bias (only the QKV projection may, "
                         "add_qkv_bias); biases on the others are not implemented"));
  {
    MegatronKey gqa;
    gqa.name = "group_query_attention", gqa.flag = true;
    gqa.effect =
        "Tessera groups the key/value heads whenever num_query_groups is set; false is accepted "
        "where num_query_groups is 0 or num_attention_heads (Megatron would ignore it).";
    gqa.check = [](const Experiment& e, const std::string& v) -> std::string {
      const ModelConfig& m = e.model_config;
      if (is_null(v) || is_true(v) || m.num_query_groups == 0 ||
          m.num_query_groups == m.num_attention_heads)
        return "";
      return fmt::format(
          "true when num_query_groups ({}) is below num_attention_heads ({}): Megatron ignores "
          "num_query_groups without group_query_attention, Tessera does not; set "
          "group_query_attention true, or num_query_groups null",
          m.num_query_groups, m.num_attention_heads);
    };
    k.push_back(gqa);
  }
  for (const char* name : {"attention_dropout", "hidden_dropout"})
    k.push_back(only_number(name, 0.0, "dropout is not implemented (pretraining runs without)"));
  k.push_back(only_false("apply_layernorm_1p",
                         "not implemented: the norms multiply by their weight, not 1 + weight"));
  k.push_back(only_false("qk_l2_norm", "not implemented (qk_layernorm is an RMSNorm per head)"));
  k.push_back(only_false("fp32_residual_connection",
                         "the residual stream is kept in the compute dtype (bf16 on GPUs)"));
  k.push_back(only_false("apply_residual_connection_post_layernorm",
                         "the residual adds the block's input, before its norm (pre-norm)"));
  for (const char* name : {"quick_geglu", "openai_gelu", "squared_relu"})
    k.push_back(only_false(name, "the MLP's activation is SwiGLU's SiLU"));
  k.push_back(any_value("attention_softmax_in_fp32",
                        "Tessera's attention computes its softmax in fp32 (both values: the "
                        "fused kernels Megatron uses do too).",
                        true));
  k.push_back(any_value("apply_query_key_layer_scaling",
                        "scaling the attention logits down by the layer number and back up "
                        "inside an fp32 softmax gives the same probabilities: Tessera's softmax "
                        "is fp32.",
                        true));
  constexpr std::string_view kFusion =
      "a Megatron kernel-fusion switch: Tessera's kernels are fused their own way and compute "
      "the same result with either value.";
  for (const char* name :
       {"masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion",
        "apply_rope_fusion", "moe_permute_fusion", "no_persist_layer_norm",
        "use_te_activation_func", "clone_scatter_output_in_embedding",
        "moe_use_fused_router_with_aux_score"})
    k.push_back(any_value(name, kFusion, true));
  k.push_back(only_number("vocab_extra_ids", 0, "no extra vocabulary ids are added"));
  constexpr std::string_view kTiktoken =
      "Megatron's TikTokenizer settings: Tessera reads Hugging Face tokenizer.json files.";
  for (const char* name : {"tiktoken_pattern", "tiktoken_num_special_tokens"})
    k.push_back(any_value(name, kTiktoken));
  k.push_back(any_value("tiktoken_special_tokens", kTiktoken));
  k.back().accepts_list = true;  // a list of tokens
  k.push_back(any_value("legacy_tokenizer",
                        "Megatron's choice between tokenizer classes: Tessera has its own.", true));
  k.push_back(any_value("trust_remote_code",
                        "Hugging Face's remote code: Tessera runs none; it reads tokenizer.json.",
                        true));
  k.push_back(only("encoder_num_layers", {}, "decoder-only models: no encoder layers"));
  k.push_back(only("decoder_num_layers", {}, "num_layers gives the decoder's layers"));
  k.push_back(
      only_true("perform_initialization",
                "the weights are always initialised (Megatron's init, docs/architecture.md)"));
  k.push_back(any_value("use_cpu_initialization",
                        "Tessera initialises on the device, from a counter-based generator, so "
                        "every device and sharding gets the same weights.",
                        true));
  // Mamba, hybrid and multi-token prediction models are not built.
  constexpr std::string_view kMamba = "Mamba layers: not used by a model without them.";
  for (const char* name :
       {"mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_expand",
        "mamba_d_conv", "disable_mamba_mem_eff_path"})
    k.push_back(any_value(name, kMamba));
  k.push_back(only_false("is_hybrid_model", "hybrid Mamba/attention models are not implemented"));
  for (const char* name : {"hybrid_attention_ratio", "hybrid_mlp_ratio"})
    k.push_back(only_number(name, 0.0, "hybrid Mamba/attention models are not implemented"));
  k.push_back(only("hybrid_override_pattern", {},
                   "hybrid Mamba/attention models are not "
                   "implemented"));
  k.push_back(only("mtp_num_layers", {"0"},
                   "multi-token prediction layers are not implemented (DeepSeek-V3 trains "
                   "without its MTP layer)"));
  k.push_back(any_value("mtp_loss_scaling_factor",
                        "weighs the multi-token prediction loss: no effect without MTP layers."));
  for (const char* name :
       {"final_logit_softcapping", "attn_logit_softcapping", "router_logit_softcapping"})
    k.push_back(only(name, {}, "logit soft-capping (Grok) is not implemented"));

  // ---- mixture of experts ----
  k.push_back(any_value("moe_grouped_gemm",
                        "the experts always run as grouped GEMMs over their row ranges; "
                        "Megatron's sequential experts compute the same.",
                        true));
  k.push_back(any_value("moe_use_legacy_grouped_gemm", kFusion, true));
  k.push_back(any_value("moe_shared_expert_overlap",
                        "overlaps the shared expert with the token exchange: the same result.",
                        true));
  k.push_back(any_value("moe_per_layer_logging",
                        "Tessera logs every MoE layer's balance (its own lines and metrics).",
                        true));
  k.push_back(any_value("disable_primus_topk_router",
                        "Primus's router kernel: Tessera runs its own (moe_router_forward)."));
  k.push_back(any_value("delay_wgrad_compute",
                        "a scheduling choice for the weight-gradient GEMMs: the same gradients.",
                        true));
  k.push_back(only("moe_router_dtype", {},
                   "the router's logits are in the compute dtype (bf16 on GPUs), Megatron's "
                   "default (null); fp32 and fp64 router logits are not implemented"));
  k.push_back(only_number("moe_input_jitter_eps", 0.0, "input jitter is not implemented"));
  k.push_back(only_false("moe_enable_deepep",
                         "DeepEP's dispatcher is not used: tokens are exchanged by all-to-all"));
  k.push_back(only_false("moe_layer_recompute",
                         "recomputing only the MoE layers is not implemented (use "
                         "recompute_granularity)"));
  k.push_back(only_false("moe_extended_tp", "experts are not split over tensor-parallel ranks"));
  k.push_back(only_false("moe_use_upcycling", "upcycling a dense checkpoint is not implemented"));
  k.push_back(only_false("use_deprecated_20241209_moe_layer",
                         "Tessera has one MoE layer (Megatron's current semantics)"));
  k.push_back(only("expert_tensor_parallel_size", {"1"},
                   "experts are not split over tensor-parallel ranks (expert parallelism "
                   "spreads whole experts)"));

  // ---- parallelism: what Tessera's mesh has ----
  k.push_back(only("model_parallel_size", {}, "tensor_model_parallel_size gives the split"));
  k.push_back(
      only_number("encoder_tensor_model_parallel_size", 0, "decoder-only models: no encoder"));
  k.push_back(
      only_number("encoder_pipeline_model_parallel_size", 0, "decoder-only models: no encoder"));
  k.push_back(only("pipeline_model_parallel_split_rank", {}, "decoder-only models: no encoder"));
  k.push_back(only("pipeline_model_parallel_layout", {},
                   "the stages' layers come from pipeline_model_parallel_size and the "
                   "decoder_first/last_pipeline_num_layers keys"));
  k.push_back(only("pipeline_model_parallel_comm_backend", {"nccl"},
                   "pipeline stages exchange activations over the job's NCCL communicator"));
  k.push_back(only("hierarchical_context_parallel_sizes", {},
                   "context parallelism is one level (context_parallel_size)"));
  k.push_back(any_value("cp_comm_type",
                        "how context-parallel ranks exchange keys and values: Tessera's "
                        "exchange gives every rank the same attention result."));
  k.push_back(only("microbatch_group_size_per_vp_stage", {},
                   "the interleaved schedule runs groups of pipeline_model_parallel_size "
                   "micro-batches"));
  constexpr std::string_view kOverlap =
      "a communication-overlap switch of Megatron's tensor parallelism: the same result.";
  for (const char* name :
       {"async_tensor_model_parallel_allreduce", "tp_comm_overlap", "tp_comm_overlap_ag",
        "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs",
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad"})
    k.push_back(any_value(name, kOverlap, true));
  k.push_back(any_value("tp_comm_overlap_cfg", kOverlap));
  k.push_back(any_value("tp_comm_bootstrap_backend", kOverlap));
  k.push_back(any_value("high_priority_stream_groups",
                        "stream priorities of Megatron's process groups: Tessera's gradient "
                        "reductions already run on a high-priority stream."));
  k.back().accepts_list = true;
  k.push_back(any_value("barrier_with_L1_time",
                        "Megatron's timers: Tessera times iterations itself.", true));
  k.push_back(only("distributed_backend", {"nccl"},
                   "GPU ranks communicate through NCCL (thread ranks on the CPU through "
                   "memory)"));

  // ---- FP8 ----
  k.push_back(only_false("fp8_param_gather",
                         "FP8 parameters (Transformer Engine's FP8 model weights, gathered in "
                         "FP8) are not implemented: the parameters are bf16 and gathered in "
                         "bf16, their FP8 copies cast per step"));
  // Transformer Engine's FP8 multi-head attention also keeps the QKV and output projections'
  // activations in FP8 between the layers; Tessera's FP8 attention (fp8_dot_product_attention)
  // is the dot products alone.
  k.push_back(only_false("fp8_multi_head_attention",
                         "FP8 activations between the attention's projections and the attention "
                         "are not implemented; fp8_dot_product_attention runs the attention's "
                         "products in FP8"));

  // ---- runtime ----
  k.push_back(
      any_value("manual_gc", "Python's garbage collector: Tessera has none to pause.", true));
  for (const char* name : {"manual_gc_interval", "manual_gc_eval"})
    k.push_back(any_value(name, "Python's garbage collector: Tessera has none to run."));
  k.push_back(any_value("empty_unused_memory_level",
                        "empties PyTorch's caching allocator: Tessera allocates its buffers "
                        "once, with nothing cached to empty."));
  k.push_back(any_value(
      "calculate_per_token_loss",
      "Tessera's loss is the mean over every token of the global batch; Megatron's per-micro-"
      "batch means average to the same value here, since every micro-batch counts the same "
      "number of tokens (no position is masked out of the loss).",
      true));
  k.push_back(any_value("use_pytorch_profiler",
                        "Tessera's own recorder (profile: true) writes the same Chrome trace "
                        "format PyTorch's profiler does (traces/rank-N.pt.trace.json.gz), which "
                        "tessera report reads.",
                        true));

  // ---- logging and runs ----
  constexpr std::string_view kWandb =
      "Weights & Biases logging, which Tessera does not do: metrics.jsonl and TensorBoard "
      "(tensorboard_dir) hold the run's metrics.";
  for (const char* name : {"wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity"})
    k.push_back(any_value(name, kWandb));
  k.push_back(any_value("disable_wandb", kWandb, true));
  k.push_back(any_value("stderr_sink_level",
                        "Primus's console log level: Tessera prints INFO and above and writes "
                        "every level to logs/pre_trainer/rank-N/{debug,info,warning,error}.log."));
  constexpr std::string_view kAverages =
      "Primus's running averages in its iteration line: Tessera logs each log_interval's values "
      "(`tessera plot` reports medians).";
  k.push_back(any_value("log_avg_skip_iterations", kAverages));
  k.push_back(any_value("log_avg_reset_interval", kAverages));
  k.push_back(any_value("log_throughput",
                        "Tessera's iteration line always shows TFLOP/s and tokens/s per GPU.", true));
  k.push_back(any_value("disable_tensorboard",
                        "Primus writes TensorBoard files unless this is true; Tessera writes them "
                        "when tensorboard_dir is set.",
                        true));
  constexpr std::string_view kTurbo =
      "Primus-Turbo's kernels (AMD GPUs): Tessera runs its own (attention_backend chooses the "
      "attention kernel).";
  for (const char* name : {"enable_primus_turbo", "use_turbo_attention", "use_turbo_grouped_mlp",
                           "use_turbo_grouped_gemm"})
    k.push_back(any_value(name, kTurbo, true));
  k.push_back(any_value("use_flash_attn",
                        "Tessera's attention is always a fused kernel (attention_backend).", true));
  k.push_back(any_value("gradient_accumulation_fusion",
                        "Megatron's fused weight-gradient accumulation: Tessera's weight-gradient "
                        "GEMMs always accumulate into the gradients (the same sums).",
                        true));
  constexpr std::string_view kCrossEntropy =
      "Tessera's cross-entropy is always fused with the output head, in token chunks "
      "(cross_entropy_chunk_tokens).";
  k.push_back(any_value("cross_entropy_loss_fusion", kCrossEntropy, true));
  k.push_back(any_value("cross_entropy_fusion_impl", kCrossEntropy));

  // ---- data ----
  k.push_back(any_value("num_workers",
                        "Megatron's data-loader processes: Tessera reads its batches in process."));
  k.push_back(any_value("create_attention_mask_in_dataloader",
                        "Tessera's attention applies the causal mask inside its kernel; no mask "
                        "tensor is built with either value.",
                        true));
  k.push_back(any_value("mmap_bin_files",
                        "how .bin files are read: Tessera maps them, and either way the samples "
                        "are the same.",
                        true));
  k.push_back(only("dataloader_type", {"single"},
                   "samples are read once in Megatron's single-pass order (cyclic and external "
                   "loaders are not implemented)"));
  k.push_back(only("test_data_path", {"null"},
                   "Tessera evaluates the validation split only (valid_data_path)"));
  k.back().words_joined_by = " ";

  // ---- checkpoints ----
  k.push_back(any_value("ckpt_format",
                        "Megatron's checkpoint format (torch, torch_dist): Tessera writes "
                        "safetensors checkpoints (docs/checkpoints.md)."));
  k.push_back(only_false("auto_continue_train",
                         "to resume from the save directory's latest checkpoint, set load to it"));
  k.push_back(any_value("no_load_rng",
                        "Tessera's checkpoints hold no random-number state to load: the data order "
                        "is a function of seed and consumed samples, and nothing else is random "
                        "after initialisation",
                        true));
  for (const char* name : {"no_save_optim", "no_save_rng"})
    k.push_back(only_false(name, "checkpoints always hold the optimizer and data state"));
  return k;
}

}  // namespace

std::span<const MegatronKey> megatron_keys() {
  static const std::vector<MegatronKey> kKeys = build();
  return kKeys;
}

const MegatronKey* find_megatron_key(std::string_view name) {
  for (const auto& k : megatron_keys())
    if (k.name == name) return &k;
  return nullptr;
}

}  // namespace tessera
