#include "tessera/config/megatron_keys.h"

#include <algorithm>
#include <vector>

#include "tessera/config/keys.h"

namespace tessera {
namespace {

bool is_null(const std::string& v) { return v.empty() || v == "null" || v == "~" || v == "None"; }
bool is_true(const std::string& v) { return v == "true" || v == "True" || v == "TRUE" || v == "1"; }
bool is_false(const std::string& v) {
  return v == "false" || v == "False" || v == "FALSE" || v == "0";
}

// A key that concerns something Tessera has no part of: any value.
MegatronKey any_value(std::string_view name, std::string_view effect, bool flag = false) {
  MegatronKey k;
  k.name = name, k.flag = flag, k.effect = effect;
  k.check = [](const Experiment&, const std::string&) { return std::string(); };
  return k;
}

// A key whose Megatron default is what Tessera does; other values are not implemented.
// `allowed`: the values that agree (null, Megatron's "not set", always does).
MegatronKey only(std::string_view name, std::vector<std::string> allowed, std::string_view effect,
                 bool flag = false) {
  MegatronKey k;
  k.name = name, k.flag = flag, k.effect = effect;
  k.check = [allowed, effect](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
    return allowed.front() + ": " + std::string(effect);
  };
  return k;
}

MegatronKey only_false(std::string_view name, std::string_view effect) {
  MegatronKey k = only(name, {"false"}, effect, true);
  k.check = [effect](const Experiment&, const std::string& v) -> std::string {
    if (is_null(v) || is_false(v)) return "";
    return "false: " + std::string(effect);
  };
  return k;
}

std::vector<MegatronKey> build() {
  std::vector<MegatronKey> k;
  // ---- spellings of Tessera keys ----
  {
    MegatronKey bf16;
    bf16.name = "bf16", bf16.flag = true, bf16.sets = "precision";
    bf16.effect = "Megatron's mixed-precision flag: true is precision: bf16, false is precision: fp32.";
    bf16.set = [](Experiment& e, const std::string& v) -> std::string {
      if (is_true(v)) e.training.precision = Precision::Bf16;
      else if (is_false(v)) e.training.precision = Precision::Fp32;
      else if (!is_null(v)) return "true or false (precision: bf16 or fp32)";
      return "";
    };
    k.push_back(bf16);
  }
  {
    MegatronKey fp16;
    fp16.name = "fp16", fp16.flag = true, fp16.sets = "precision";
    fp16.effect = "Megatron's fp16 flag: only false; fp16 training (with loss scaling) is not implemented.";
    fp16.set = [](Experiment&, const std::string& v) -> std::string {
      if (is_null(v) || is_false(v)) return "";
      return "false: fp16 training (half precision with loss scaling) is not implemented; train "
             "in bf16 (--bf16, or precision: bf16) or fp32 (precision: fp32)";
    };
    k.push_back(fp16);
  }
  {
    MegatronKey timeout;
    timeout.name = "distributed_timeout_minutes", timeout.sets = "dist_timeout_minutes";
    timeout.effect = "Megatron's name of dist_timeout_minutes.";
    timeout.set = [](Experiment& e, const std::string& v) {
      return find_key("dist_timeout_minutes")->set(e, v);
    };
    k.push_back(timeout);
  }
  // ---- accepted at any value: what they configure is not part of Tessera ----
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
  for (const char* name : {"enable_primus_turbo", "use_turbo_attention", "use_turbo_grouped_mlp"})
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
  k.push_back(any_value("num_workers",
                        "Megatron's data-loader processes: Tessera reads its batches in process."));
  k.push_back(any_value("ckpt_format",
                        "Megatron's checkpoint format (torch, torch_dist): Tessera writes "
                        "safetensors checkpoints (docs/checkpoints.md)."));
  // ---- accepted at the values that agree with Tessera ----
  // (tensor/pipeline/context/expert model-parallel sizes and sequence_parallel are Tessera
  // keys: config/keys.cpp.)
  k.push_back(only_false("finetune",
                         "a fine-tuning start (weights only, iteration 0) is not implemented; "
                         "hf_init_path starts from a Hugging Face model's weights"));
  k.push_back(only_false("auto_continue_train",
                         "to resume from the save directory's latest checkpoint, set load to it"));
  for (const char* name : {"no_load_optim", "no_load_rng"})
    k.push_back(only_false(name, "a resumed run always loads the optimizer and data state"));
  for (const char* name : {"no_save_optim", "no_save_rng"})
    k.push_back(only_false(name, "checkpoints always hold the optimizer and data state"));
  k.push_back(only("test_data_path", {"null"},
                   "Tessera evaluates the validation split only (valid_data_path)"));
  {
    MegatronKey last;
    last.name = "disable_last_saving", last.flag = true;
    last.effect =
        "Tessera saves a checkpoint at the end of every run that has save set: true is accepted "
        "only without save.";
    last.check = [](const Experiment& e, const std::string& v) -> std::string {
      if (is_null(v) || is_false(v) || e.checkpoint.save.empty()) return "";
      return "false, or no save directory: Tessera saves a checkpoint at the end of every run "
             "that has save set (save_interval sets the ones before it)";
    };
    k.push_back(last);
  }
  {
    MegatronKey eod = any_value("eod_mask_loss",
                                "not implemented: the loss counts every position, also the ones "
                                "after an end-of-document token (true is accepted with a warning).",
                                true);
    eod.warns = [](const std::string& v) { return is_true(v); };
    k.push_back(eod);
  }
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
