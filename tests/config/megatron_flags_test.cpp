// Megatron's command-line flags and Primus's files as users paste them (config/megatron_keys.h):
// one test per group of the list (architecture, schedule and loss, FP8, runtime, data,
// MoE), the boolean spellings of every flag, Megatron's nargs, and Primus's model files.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/experiment_yaml.h"
#include "common/scratch_dir.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/config/megatron_keys.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/run/run_setup.h"
#include "tessera/train/lr_schedule.h"

namespace tessera {
namespace {

using testing::experiment_from_yaml;

constexpr const char* kMinimal = "model: tiny_llama\nmock_data: true\nvocab_size: 512\n";

Experiment load(const std::vector<std::string>& cli, const std::string& yaml = kMinimal) {
  return experiment_from_yaml(yaml, cli);
}

ConfigError error_of(const std::vector<std::string>& cli, const std::string& yaml = kMinimal) {
  try {
    load(cli, yaml);
  } catch (const ConfigError& e) {
    return e;
  }
  ADD_FAILURE() << "expected a ConfigError";
  return ConfigError("", "", "", "");
}

bool accepted(const Experiment& e, const std::string& key) {
  for (const AcceptedMegatronKey& k : e.megatron_keys)
    if (k.key == key) return true;
  return false;
}

// Each refused value names the key and says what Tessera does instead.
void expect_refused(const std::vector<std::string>& cli, const std::string& key,
                    const std::string& fragment) {
  SCOPED_TRACE(key);
  const ConfigError err = error_of(cli);
  EXPECT_EQ(err.key(), key) << err.what();
  EXPECT_NE(std::string(err.what()).find(fragment), std::string::npos) << err.what();
}

TEST(MegatronFlags, ArchitectureFlagsAreAcceptedAtTesserasValuesAndRefusedAtOthers) {
  // A Llama launch script's architecture flags, as written.
  const Experiment e = load({"--use-mcore-models",
                             "--swiglu",
                             "--normalization",
                             "RMSNorm",
                             "--position-embedding-type",
                             "rope",
                             "--rotary-percent",
                             "1.0",
                             "--disable-bias-linear",
                             "--group-query-attention",
                             "--attention-dropout",
                             "0",
                             "--hidden-dropout",
                             "0.0",
                             "--attention-backend",
                             "flash",
                             "--transformer-impl",
                             "transformer_engine",
                             "--no-masked-softmax-fusion",
                             "--attention-softmax-in-fp32"});
  for (const char* key :
       {"use_mcore_models", "swiglu", "normalization", "position_embedding_type", "rotary_percent",
        "disable_bias_linear", "group_query_attention", "attention_dropout", "hidden_dropout",
        "transformer_impl", "masked_softmax_fusion", "attention_softmax_in_fp32"})
    EXPECT_TRUE(accepted(e, key)) << key;
  // Megatron's attention backends are Tessera's kernels: flash its own, fused cuDNN's.
  EXPECT_EQ(e.training.attention_backend, AttentionBackend::Tessera);
  EXPECT_EQ(load({"--attention-backend", "fused"}).training.attention_backend,
            AttentionBackend::Vendor);

  expect_refused({"--apply-layernorm-1p"}, "apply_layernorm_1p", "not implemented");
  expect_refused({"--normalization", "LayerNorm"}, "normalization", "RMSNorm");
  expect_refused({"--no-swiglu"}, "swiglu", "SwiGLU");
  expect_refused({"--position-embedding-type", "learned_absolute"}, "position_embedding_type",
                 "rotary");
  expect_refused({"--rotary-percent", "0.5"}, "rotary_percent", "every dimension");
  expect_refused({"--hidden-dropout", "0.1"}, "hidden_dropout", "dropout is not implemented");
  expect_refused({"--attention-backend", "unfused"}, "attention_backend", "flash");
  // tiny_llama groups its heads (4 heads, 2 groups): Megatron without the flag would not.
  expect_refused({"--group-query-attention", "false"}, "group_query_attention",
                 "Megatron ignores num_query_groups");
  EXPECT_TRUE(accepted(load({"--no-group-query-attention", "--num-query-groups", "4"}),
                       "group_query_attention"));
}

TEST(MegatronFlags, SampleBasedScheduleWarmupFractionWsdAndPerTokenLoss) {
  // Megatron's sample-based run: 40 samples of 4 = 10 iterations, warm-up over 8 samples,
  // decay over 32.
  const Experiment s =
      load({"--global-batch-size", "4", "--micro-batch-size", "4", "--train-samples", "40",
            "--lr-warmup-samples", "8", "--lr-decay-samples", "32", "--lr", "1e-3", "--min-lr",
            "1e-4", "--lr-decay-style", "linear", "--calculate-per-token-loss"});
  const TrainingConfig& t = s.training;
  EXPECT_EQ(t.train_iters, 10);
  EXPECT_TRUE(accepted(s, "calculate_per_token_loss"));
  // Samples 4, 8 of the warm-up; then linear over samples 8..32; min_lr after.
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1e-3 * 4 / 8);
  EXPECT_DOUBLE_EQ(learning_rate(t, 2), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(t, 5), 1e-4 + (1.0 - 12.0 / 24.0) * (1e-3 - 1e-4));
  EXPECT_DOUBLE_EQ(learning_rate(t, 8), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-4);

  // The same schedule in iterations gives the same rates.
  const Experiment i = load({"--global-batch-size", "4", "--micro-batch-size", "4", "--train-iters",
                             "10", "--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--lr",
                             "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "linear"});
  for (int64_t it = 1; it <= 10; ++it)
    EXPECT_DOUBLE_EQ(learning_rate(i.training, it), learning_rate(t, it)) << it;

  // --lr-warmup-fraction: a quarter of the 8-iteration decay.
  const Experiment f = load({"--train-iters", "8", "--lr-warmup-iters", "0", "--lr-warmup-fraction",
                             "0.25", "--lr", "1e-3"});
  EXPECT_DOUBLE_EQ(learning_rate(f.training, 1), 1e-3 / 2);
  EXPECT_DOUBLE_EQ(learning_rate(f.training, 2), 1e-3);

  // WSD: lr held until the last 4 of 10 iterations, then annealed (Megatron's shapes).
  for (const auto& [style, coeff] : std::vector<std::pair<std::string, double (*)(double)>>{
           {"exponential", [](double r) { return 2.0 * std::pow(0.5, r) - 1.0; }},
           {"linear", [](double r) { return 1.0 - r; }},
           {"cosine", [](double r) { return 0.5 * (std::cos(M_PI * r) + 1.0); }},
           {"minus_sqrt", [](double r) { return 1.0 - std::sqrt(r); }}}) {
    SCOPED_TRACE(style);
    const Experiment w = load({"--train-iters", "10", "--lr-warmup-iters", "2", "--lr-decay-style",
                               "WSD", "--lr-wsd-decay-style", style, "--lr-wsd-decay-iters", "4",
                               "--lr", "1e-3", "--min-lr", "1e-4"});
    EXPECT_DOUBLE_EQ(learning_rate(w.training, 1), 1e-3 / 2);
    for (int64_t it = 3; it <= 6; ++it) EXPECT_DOUBLE_EQ(learning_rate(w.training, it), 1e-3);
    for (int64_t it = 7; it <= 10; ++it)
      EXPECT_DOUBLE_EQ(learning_rate(w.training, it), 1e-4 + coeff((it - 6) / 4.0) * (1e-3 - 1e-4))
          << it;
  }
  expect_refused({"--lr-decay-style", "WSD"}, "lr_wsd_decay_iters", "WSD");
  expect_refused({"--train-iters", "10", "--lr-warmup-iters", "2", "--lr-decay-style", "WSD",
                  "--lr-wsd-decay-iters", "9"},
                 "lr_wsd_decay_iters", "after the warm-up");
  // Two spellings of one phase in one place are refused; lr_warmup_fraction names it.
  expect_refused({"--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"}, "lr_warmup_fraction",
                 "lr_warmup_iters");
  expect_refused({"--lr-decay-style", "inverse-square-root"}, "lr_decay_style", "WSD");
}

TEST(MegatronFlags, TheCommandLinesScheduleSpellingReplacesTheFilesOther) {
  // An experiment in iterations, a Megatron launch line in samples: the line wins.
  const std::string file = std::string(kMinimal) +
                           "train_iters: 50\nlr_warmup_iters: 2\nglobal_batch_size: 4\n"
                           "micro_batch_size: 4\n";
  const Experiment e = load({"--train-samples", "80", "--lr-warmup-samples", "16"}, file);
  EXPECT_EQ(e.training.train_iters, 20);
  EXPECT_EQ(e.training.lr_warmup_iters, 0);
  EXPECT_EQ(e.origin.at("train_iters"), "command line");
  // Both in the one file stay an error naming both.
  const ConfigError err =
      error_of({}, std::string(kMinimal) + "lr_warmup_iters: 2\nlr_warmup_samples: 8\n");
  EXPECT_EQ(err.key(), "lr_warmup_samples") << err.what();
  // --use_torch_fsdp2 true over an experiment's distributed optimizer (Primus's alternatives).
  const Experiment f = experiment_from_yaml(
      std::string(kMinimal) +
          "use_distributed_optimizer: true\noverlap_param_gather: true\nglobal_batch_size: 8\n",
      {"--use_torch_fsdp2", "true"}, 8);
  EXPECT_TRUE(f.training.use_torch_fsdp2);
  EXPECT_FALSE(f.training.use_distributed_optimizer);
}

TEST(MegatronFlags, Fp8FormatIsFp8AndFp8ParamGatherIsRefusedAndFp8AttentionTakesHeadsOf128) {
  EXPECT_EQ(load({"--fp8-format", "hybrid"}).training.fp8, Fp8Mode::Hybrid);
  EXPECT_EQ(load({"--fp8-format", "e4m3"}).training.fp8, Fp8Mode::E4M3);
  EXPECT_EQ(load({"--fp8-format", "hybrid"}).origin.at("fp8"), "command line");
  expect_refused({"--fp8-format", "mxfp8"}, "fp8_format", "hybrid or e4m3");
  expect_refused({"--fp8-param-gather"}, "fp8_param_gather", "FP8 parameters");
  EXPECT_TRUE(accepted(load({"--no-fp8-param-gather"}), "fp8_param_gather"));
  // FP8 activations between the attention's projections: refused where set, accepted off.
  expect_refused({"--fp8-multi-head-attention"}, "fp8_multi_head_attention",
                 "fp8_dot_product_attention runs");
  EXPECT_TRUE(accepted(load({"--no-fp8-multi-head-attention"}), "fp8_multi_head_attention"));
  // FP8 attention itself: heads of 128 on a GPU, refused by name with what it needs elsewhere.
  const std::string gpu = std::string(kMinimal) + "device: cuda\nkv_channels: 128\n";
  EXPECT_TRUE(load({"--fp8-dot-product-attention"}, gpu).training.fp8_dot_product_attention);
  EXPECT_FALSE(load({"--no-fp8-dot-product-attention"}, gpu).training.fp8_dot_product_attention);
  const auto refused = [&](const std::string& yaml, const std::string& fragment) {
    const ConfigError err = error_of({"--fp8-dot-product-attention"}, yaml);
    EXPECT_EQ(err.key(), "fp8_dot_product_attention") << err.what();
    EXPECT_NE(std::string(err.what()).find(fragment), std::string::npos) << err.what();
  };
  refused(std::string(kMinimal) + "device: cuda\n", "heads of 64");
  refused(std::string(kMinimal) + "device: cpu\nkv_channels: 128\n", "device cpu");
  refused(gpu + "precision: fp32\n", "precision fp32");
  refused(gpu + "attention_backend: cudnn\n", "attention_backend cudnn");
}

TEST(MegatronFlags, RuntimeFlags) {
  const Experiment e = load({"--grad-reduce-in-bf16", "--manual-gc", "--manual-gc-interval", "10",
                             "--empty-unused-memory-level", "2", "--distributed-backend", "nccl"});
  EXPECT_TRUE(e.training.grad_reduce_in_bf16);
  for (const char* key :
       {"manual_gc", "manual_gc_interval", "empty_unused_memory_level", "distributed_backend"})
    EXPECT_TRUE(accepted(e, key)) << key;
  // The gradient buffer is bf16, without the precision-aware optimizer Megatron's option needs
  // none of; on the CPU the reference rounds its fp32 gradients to it.
  const RunSetup s = make_run_setup(e, {1, DType::F32}, [] { return int64_t{512}; });
  EXPECT_EQ(s.runtime.grad_dtype, DType::BF16);
  EXPECT_EQ(
      make_run_setup(load({}), {1, DType::F32}, [] { return int64_t{512}; }).runtime.grad_dtype,
      DType::F32);
  expect_refused({"--distributed-backend", "gloo"}, "distributed_backend", "NCCL");
}

TEST(MegatronFlags, DataFlagsTokenizersAndUnquotedBlends) {
  // Megatron's nargs: the blend's words follow --data-path unquoted, up to the next option.
  const Experiment blend = load({"--data-path", "0.7", "/data/a_text_document", "0.3",
                                 "/data/b_text_document", "--split", "99,1,0"});
  EXPECT_EQ(blend.data.data_path, "0.7 /data/a_text_document 0.3 /data/b_text_document");
  EXPECT_EQ(blend.data.split, "99,1,0");
  const Experiment flags = load({"--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                                 "--num-workers", "8", "--dataloader-type", "single"});
  for (const char* key :
       {"create_attention_mask_in_dataloader", "mmap_bin_files", "num_workers", "dataloader_type"})
    EXPECT_TRUE(accepted(flags, key)) << key;
  expect_refused({"--dataloader-type", "cyclic"}, "dataloader_type", "single");

  // NullTokenizer: vocab_size ids and an end-of-document id; its text is the ids.
  const Experiment null_tok = load({"--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"});
  const RunSetup s = make_run_setup(null_tok, {1, DType::F32}, [] { return int64_t{0}; });
  EXPECT_EQ(s.data_vocab, 1001);
  EXPECT_EQ(s.spec.vocab_size, 1024);  // padded to make_vocab_size_divisible_by 128
  const auto tokenizer = make_tokenizer(null_tok.data, null_tok.model_config.vocab_size);
  EXPECT_EQ(tokenizer->vocab_size(), 1001);
  EXPECT_EQ(tokenizer->eod_id(), 1000);
  std::vector<int32_t> ids;
  tokenizer->encode("5 17  999\n1000", &ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 17, 999, 1000}));
  EXPECT_EQ(tokenizer->decode(ids), "5 17 999 1000");
  EXPECT_THROW(tokenizer->encode("5 1001", &ids), DataError);
  EXPECT_EQ(error_of({"--tokenizer-type", "NullTokenizer", "--vocab-size", "0"},
                     "model: tiny_llama\nmock_data: true\n")
                .key(),
            "vocab_size");

  // Primus's tokenizer names, with Hugging Face hub names of the shipped tokenizers.
  const Experiment llama3 =
      load({"--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", "meta-llama/Llama-3.1-8B"});
  EXPECT_EQ(llama3.data.tokenizer_type, TokenizerType::HuggingFace);
  EXPECT_TRUE(names_a_tokenizer("meta-llama/Meta-Llama-3-8B"));
  expect_refused({"--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/unknown"},
                 "tokenizer_model", "downloads nothing");

  // GPT2BPETokenizer reads GPT-2's vocab.json and merges.txt: here every byte (GPT-2's
  // printable spelling of it, id = the byte) and the merges that make "hello".
  testing::ScratchDir dir;
  const std::string vocab = (dir / "vocab.json").string(), merges = (dir / "merges.txt").string();
  nlohmann::json tokens;
  for (int b = 0, shifted = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const int code = printable ? b : 256 + shifted++;
    std::string utf8;  // code < 0x800: one or two bytes
    if (code < 0x80) {
      utf8 = std::string(1, static_cast<char>(code));
    } else {
      utf8 = {static_cast<char>(0xC0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3F))};
    }
    tokens[utf8] = b;
  }
  tokens["he"] = 256, tokens["ll"] = 257, tokens["hell"] = 258, tokens["hello"] = 259;
  tokens["<|endoftext|>"] = 260;
  std::ofstream(vocab) << tokens.dump();
  std::ofstream(merges) << "#version: 0.2\nh e\nl l\nhe ll\nhell o\n";
  const Experiment gpt2 =
      load({"--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges});
  const auto bpe = make_tokenizer(gpt2.data);
  ids.clear();
  bpe->encode("hello hello", &ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{259, 32, 259}));  // "hello", " " (byte 0x20), "hello"
  EXPECT_EQ(bpe->eod_id(), 260);
  EXPECT_EQ(bpe->decode(ids), "hello hello");
  expect_refused({"--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab}, "merge_file",
                 "merges.txt");
}

TEST(MegatronFlags, MoeFlags) {
  const std::string moe = "model: tiny_moe\nmock_data: true\nvocab_size: 512\n";
  const Experiment e =
      load({"--moe-grouped-gemm", "--moe-router-dtype", "None", "--expert-tensor-parallel-size",
            "1", "--moe-token-dispatcher-type", "allgather"},
           moe);
  for (const char* key : {"moe_grouped_gemm", "moe_router_dtype", "expert_tensor_parallel_size"})
    EXPECT_TRUE(accepted(e, key)) << key;
  EXPECT_EQ(e.model_config.moe_token_dispatcher_type, MoeDispatcher::AllToAll);
  const ConfigError dtype = error_of({"--moe-router-dtype", "fp32"}, moe);
  EXPECT_EQ(dtype.key(), "moe_router_dtype");
  EXPECT_NE(std::string(dtype.what()).find("compute dtype"), std::string::npos) << dtype.what();
  EXPECT_EQ(error_of({"--expert-tensor-parallel-size", "2"}, moe).key(),
            "expert_tensor_parallel_size");
  // Primus's name of force-balanced routing.
  EXPECT_TRUE(load({"--moe-router-force-load-balancing"}, moe).training.moe_force_balance);
}

// --flag, --flag true and --no-flag false mean the same for every boolean, Tessera's and
// Megatron's; --flag false, --no-flag and --no-flag true too. Loading either gives the same
// experiment, or the same refusal.
TEST(MegatronFlags, EveryBooleanTakesFlagTrueFlagAloneAndNoFlag) {
  const auto outcome = [](const std::vector<std::string>& cli) {
    try {
      const Experiment e = load(cli);
      std::string text = experiment_to_yaml(e);
      for (const AcceptedMegatronKey& k : e.megatron_keys) {
        std::string value = k.value;  // True and true are the same flag
        for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        text += k.key + "=" + value + "\n";
      }
      return text;
    } catch (const ConfigError& err) {
      return "error " + err.key();
    }
  };
  std::vector<std::string> flags;
  for (const KeySpec& k : config_keys())
    if (k.type == KeyType::Bool) flags.emplace_back(k.name);
  for (const MegatronKey& k : megatron_keys())
    if (k.flag) flags.emplace_back(k.name);
  ASSERT_GT(flags.size(), 80u);
  for (const std::string& name : flags) {
    SCOPED_TRACE(name);
    std::string dashed = name;
    for (char& c : dashed)
      if (c == '_') c = '-';
    const std::string on = outcome({"--" + name, "true"});
    EXPECT_EQ(outcome({"--" + dashed}), on);
    EXPECT_EQ(outcome({"--" + name + "=True"}), on);
    // A key spelled no_* (no_load_optim) is its own flag, not a negation.
    if (name.starts_with("no_")) continue;
    EXPECT_EQ(outcome({"--no-" + dashed, "false"}), on);
    const std::string off = outcome({"--" + name, "false"});
    EXPECT_EQ(outcome({"--no-" + dashed}), off);
    EXPECT_EQ(outcome({"--no_" + name, "true"}), off);
    EXPECT_EQ(outcome({"--no_" + name + "=1"}), off);
  }
  // A word after a flag that is not a boolean is named, not taken as its value.
  EXPECT_EQ(error_of({"--use-flash-attn", "maybe"}).key(), "use_flash_attn");
  // Primus's --no_fp8_weight_transpose_cache true turns the cache off.
  EXPECT_FALSE(
      load({"--no_fp8_weight_transpose_cache", "true"}).training.fp8_weight_transpose_cache);
  EXPECT_TRUE(load({"--no-gradient-accumulation-fusion"}).megatron_keys.size() == 1);
}

TEST(MegatronFlags, ProfilerFlagsAsThePrimusWorkflowTypesThem) {
  // The workflow's line on 8 GPUs; the shell has taken the quotes off the rank list.
  const std::string yaml = std::string(kMinimal) + "train_iters: 20\nglobal_batch_size: 8\n";
  const Experiment e = experiment_from_yaml(
      yaml, {"--profile=True", "--use_pytorch_profiler=True", "--profile_ranks=[0,1,2,3,4,5,6,7]"},
      8);
  EXPECT_TRUE(e.logging.profile);
  EXPECT_TRUE(accepted(e, "use_pytorch_profiler"));
  EXPECT_EQ(e.logging.profile_ranks, "[0,1,2,3,4,5,6,7]");
  // Megatron's nargs spelling: the ids as words.
  EXPECT_EQ(experiment_from_yaml(yaml, {"--profile", "--profile-ranks", "0", "3"}, 8)
                .logging.profile_ranks,
            "0,3");
  // Ranks beyond the job are still refused (here one rank).
  EXPECT_EQ(error_of({"--train_iters", "20", "--profile", "--profile_ranks=[0,1]"}).key(),
            "profile_ranks");
}

TEST(MegatronFlags, EvalItersZeroTurnsEvaluationOff) {
  const Experiment e = load({"--eval-iters", "0"}, std::string(kMinimal) + "eval_interval: 10\n");
  EXPECT_EQ(e.data.eval_interval, 0);
  EXPECT_EQ(e.data.eval_iters, 0);
  EXPECT_EQ(e.origin.at("eval_interval"), "command line");
  EXPECT_EQ(load({"--eval-interval", "5"}).data.eval_interval, 5);
  EXPECT_EQ(error_of({"--eval-iters", "-1"}).key(), "eval_iters");
}

TEST(MegatronFlags, RecomputeMethodsAndRecomputeActivations) {
  const Experiment uniform = load({"--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "2"});
  EXPECT_EQ(uniform.training.recompute_method, RecomputeMethod::Uniform);
  EXPECT_EQ(uniform.training.recompute_num_layers, 2);
  EXPECT_EQ(load({"--recompute-activations"}).training.recompute_granularity,
            RecomputeGranularity::Selective);
  // recompute_num_layers alone is Primus's pairing: full recompute, block method. Above the
  // layers (tiny_llama has 4) it recomputes them all, as Primus's 80 over a 40-layer proxy.
  const Experiment alone = load({"--recompute_num_layers", "80"});
  EXPECT_EQ(alone.training.recompute_granularity, RecomputeGranularity::Full);
  EXPECT_EQ(alone.training.recompute_method, RecomputeMethod::Block);
  EXPECT_EQ(alone.origin.at("recompute_granularity"), "command line");
  expect_refused({"--recompute-granularity", "selective", "--recompute-method", "block"},
                 "recompute_method", "full");
  expect_refused({"--recompute-granularity", "full", "--recompute-method", "uniform"},
                 "recompute_num_layers", "uniform");
}

// A Primus model file loads as written: `bases:` (and `extends:`) over Primus's own model
// bases, Primus's model keys, its tokenizer names. The files here are Primus's
// primus/configs/models/megatron/ llama3.1_8B chain, verbatim.
TEST(PrimusModelFile, LoadsAsWrittenWithItsBases) {
  const std::string models = std::string(TESSERA_TEST_DATA_DIR) + "/primus/models";
  const Experiment e = experiment_from_yaml(
      "model: " + models + "/llama3.1_8B.yaml\nmock_data: true\nseq_length: 128\n");
  const ModelConfig& m = e.model_config;
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.ffn_hidden_size, 14336);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_DOUBLE_EQ(m.rotary_base, 500000);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  EXPECT_EQ(e.data.tokenizer_type, TokenizerType::HuggingFace);
  EXPECT_EQ(e.data.tokenizer_model, "meta-llama/Llama-3.1-8B");
  for (const char* key : {"swiglu", "normalization", "position_embedding_type",
                          "group_query_attention", "transformer_impl", "apply_rope_fusion"})
    EXPECT_TRUE(accepted(e, key)) << key;
  // Its vocabulary is the tokenizer's, the shipped one its hub name stands for.
  const RunSetup s = make_run_setup(e, {1, DType::F32}, [&] {
    return make_tokenizer(e.data, e.model_config.vocab_size)->vocab_size();
  });
  EXPECT_EQ(s.spec.vocab_size, 128256);
  // The same model file with `bases:` instead of `extends:`, its parents taken from Tessera's
  // presets when they are not beside it.
  testing::ScratchDir dir;
  std::ofstream(dir / "llama3_8B_bases.yaml")
      << "bases:\n  - llama3_8B.yaml\ntokenizer_type: Llama3Tokenizer\n"
         "tokenizer_model: meta-llama/Meta-Llama-3-8B\nnormalization: RMSNorm\n";
  const Experiment b = experiment_from_yaml("model: " + (dir / "llama3_8B_bases.yaml").string() +
                                            "\nmock_data: true\nseq_length: 128\n");
  EXPECT_EQ(b.model_config.num_layers, 32);
  EXPECT_EQ(b.model_config.vocab_size, 128256);  // Tessera's llama3_8B preset
  EXPECT_EQ(b.data.tokenizer_model, "meta-llama/Meta-Llama-3-8B");
}

}  // namespace
}  // namespace tessera
