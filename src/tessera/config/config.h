#pragma once
// Typed configuration of one experiment. Keys follow Megatron/Primus names wherever the
// concept is the same; every key can be set in the model preset, the experiment YAML
// (top level, `overrides:` or Primus's `modules.pre_trainer.overrides:`) or on the command
// line as `--key value` / `--key=value`, in increasing order of precedence.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/dtype.h"

namespace tessera {

// WSD (warmup-stable-decay): lr held until the last lr_wsd_decay_iters of the decay, then
// annealed to min_lr in the lr_wsd_decay_style (Megatron's).
enum class LrDecayStyle { Constant, Linear, Cosine, Wsd };
enum class WsdDecayStyle { Exponential, Linear, Cosine, MinusSqrt };
enum class RecomputeGranularity { None, Full, Selective };
// Megatron's recompute_method with full recompute: uniform re-runs groups of
// recompute_num_layers layers from each group's stored input; block re-runs the first
// recompute_num_layers layers of each pipeline stage one by one and stores the others' whole
// activations. None (Tessera's default): every layer (uniform groups of one), or with
// recompute_num_layers set, the block method.
enum class RecomputeMethod { None, Uniform, Block };
enum class Precision { Auto, Fp32, Bf16 };
// Gpu: this build's GPU backend, whatever its vendor (the device key spells it cuda, as
// PyTorch names the GPU device on every vendor).
enum class DeviceChoice { Auto, Cpu, Gpu };
// Null: Megatron's NullTokenizer, token ids as given (vocab_size of them plus an end-of-document
// id); Gpt2Bpe: GPT-2's byte-level BPE from a vocab.json and a merges.txt (vocab_file,
// merge_file).
enum class TokenizerType { ByteLevel, HuggingFace, Null, Gpt2Bpe };
// Which tokens of chat data (datasets with a roles file, data/chat.h) the loss covers:
// every assistant turn (TRL's assistant_only_loss, Megatron-Bridge's answer_only_loss), the
// final assistant turn only (the completion of a prompt), or all tokens.
enum class LossMask { Assistant, Completion, All };
// How indexed documents become samples: wrapped cuts their concatenation into windows
// (Megatron's GPT dataset, TRL's "wrapped"); bfd packs whole documents best-fit decreasing
// into padded sequences (TRL's "bfd"), for fine-tuning (data/packed_dataset.h).
enum class PackingStrategy { Wrapped, Bfd };
// What a training step optimises: the language-model loss (pretraining, SFT), or a preference
// loss over pairs of answers (data/chat.h's preference pairs; train/dpo.h).
enum class Objective { Lm, Dpo, Grpo };
// GRPO's normalisation of the token losses (train/grpo.h).
enum class GrpoLossType { Grpo, Bnpo, DrGrpo };
// Where a completion states its answer (train/rewards.h).
enum class AnswerFormat {
  Boxed,  // the content of the last \boxed{...}, braces nested (math)
  Hash,   // what follows the last "####" on its line (GSM8K)
  Regex,  // the first capture group of the pattern's first match (or the match without groups)
};
// TRL's DPO loss_type values Tessera computes (train/dpo.h).
enum class DpoLossType { Sigmoid, Ipo, Hinge };
// Vendor: the GPU vendor's fused-attention library (cuDNN on CUDA; the key spells it cudnn).
enum class AttentionBackend { Auto, Tessera, Vendor };
// FP8 linear layers (docs/fp8.md), with Transformer Engine's names: hybrid = E4M3 activations
// and weights, E5M2 gradients; e4m3 = E4M3 everywhere.
enum class Fp8Mode { Off, Hybrid, E4M3 };
enum class Fp8Recipe { Delayed, Tensorwise, Blockwise };
enum class Fp8AmaxAlgo { Max, MostRecent };
// Mixture of experts, Megatron's choices (docs/moe.md).
enum class MoeLoadBalancing { AuxLoss, SeqAuxLoss, None };
enum class MoeScoreFunction { Softmax, Sigmoid };
enum class MoeDispatcher { AllToAll };
// Which of an expert's routed tokens beyond its capacity are dropped (Megatron's
// moe_token_drop_policy): the lowest routing weights, or the latest tokens.
enum class MoeDropPolicy { Probs, Position };
// RoPE variants, Megatron's rope_type: null (Default) is Megatron's choice, yarn with
// multi-latent attention and plain rope otherwise.
enum class RopeType { Default, Rope, Yarn };

struct ModelConfig {
  std::string model_family = "llama";  // model/model_family.h: which blocks the layers have
  int64_t num_layers = 2;
  int64_t hidden_size = 64;
  int64_t ffn_hidden_size = 0;            // 0: derived as in Megatron's SwiGLU sizing
  int64_t num_attention_heads = 4;
  int64_t num_query_groups = 0;           // 0: same as num_attention_heads (no GQA)
  int64_t kv_channels = 0;                // head dim; 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 4096;
  int64_t vocab_size = 0;                 // 0: the tokenizer's vocabulary size
  int64_t make_vocab_size_divisible_by = 128;
  double rotary_base = 10000.0;
  bool use_rope_scaling = false;          // Llama 3.1 frequency scaling
  double rope_scaling_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  double norm_epsilon = 1e-5;
  bool add_qkv_bias = false;              // Qwen 2.5
  bool untie_embeddings_and_output_weights = true;
  int64_t sliding_window = 0;             // Mistral: 4096; 0 = full causal attention
  double init_method_std = 0.02;
  bool qk_layernorm = false;  // Qwen3: RMSNorm over each query and key head
  // Mixture of experts (Megatron's keys, docs/moe.md); num_experts 0 is a dense model.
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;  // each expert's SwiGLU width; 0: ffn_hidden_size
  int64_t moe_shared_expert_intermediate_size = 0;  // 0: no shared expert
  // Which layers are MoE: every Nth ("1": all, "2": 0, 2, 4, ...) or Megatron's list
  // ("[0]*3+[1]*27", "[1,0,1,0]"), one entry per layer.
  std::string moe_layer_freq = "1";
  MoeLoadBalancing moe_router_load_balancing_type = MoeLoadBalancing::AuxLoss;
  double moe_aux_loss_coeff = 0.0;
  double moe_z_loss_coeff = 0.0;
  MoeScoreFunction moe_router_score_function = MoeScoreFunction::Softmax;
  bool moe_router_pre_softmax = false;         // softmax over all experts, then top-k (no renorm)
  bool moe_router_enable_expert_bias = false;  // DeepSeek-V3's aux-loss-free balancing
  double moe_router_bias_update_rate = 1e-3;
  int64_t moe_router_num_groups = 0;  // group-limited routing; 0: off
  int64_t moe_router_group_topk = 0;
  double moe_router_topk_scaling_factor = 0.0;  // 0: unscaled
  // Tokens per expert at most capacity_factor x the balanced share of a micro-batch (Megatron's
  // token dropping); unset (negative) is dropless.
  double moe_expert_capacity_factor = -1.0;
  MoeDropPolicy moe_token_drop_policy = MoeDropPolicy::Probs;
  bool moe_pad_expert_input_to_capacity = false;  // not implemented: false only
  MoeDispatcher moe_token_dispatcher_type = MoeDispatcher::AllToAll;
  // Multi-head latent attention (DeepSeek-V2/V3, Megatron's MLATransformerConfig names;
  // docs/moe.md). Queries come from a q_lora_rank latent (0: projected directly), keys and
  // values from a kv_lora_rank latent; each head's query and key are a qk_head_dim part
  // without RoPE and a qk_pos_emb_head_dim part with it (the key's shared by every head).
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;  // required with multi_latent_attention
  int64_t qk_head_dim = 128;
  int64_t qk_pos_emb_head_dim = 64;
  int64_t v_head_dim = 128;
  // DeepSeek's YaRN RoPE (rope_type yarn): frequencies interpolated by rotary_scaling_factor
  // outside the band [beta_slow, beta_fast] rotations over original_max_position_embeddings,
  // and attention logits scaled by mscale (Megatron's defaults).
  RopeType rope_type = RopeType::Default;
  double rotary_scaling_factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

struct TrainingConfig {
  Objective objective = Objective::Lm;
  // objective dpo (train/dpo.h): TRL's beta, loss_type and label_smoothing.
  double dpo_beta = 0.1;
  DpoLossType dpo_loss_type = DpoLossType::Sigmoid;
  double dpo_label_smoothing = 0.0;
  bool dpo_length_normalize = false;  // TRL's IPO / SimPO: per-token log-probabilities
  bool dpo_reference_free = false;    // TRL's reference_free
  double dpo_rpo_alpha = 0.0;         // TRL's rpo_alpha: the chosen answers' NLL term
  // The file of the reference's log-probabilities (train/dpo_reference.h); empty: beside the
  // dataset, named after the reference and seq_length.
  std::string dpo_reference_logps;
  // TRL's precompute_ref_log_probs: true, the log-probabilities above; false, a frozen copy
  // of the reference weights on the device, run before each step.
  bool dpo_precompute_ref_log_probs = true;
  // Each pair in one sequence with its prompt once (the prompt's rows computed once for both
  // answers; attention still over each side apart), where the run allows it.
  bool dpo_shared_prompt = true;
  // objective grpo (train/grpo_run.h): TRL's GRPOConfig names with a grpo_ prefix.
  int64_t grpo_num_generations = 8;          // completions per prompt (a group)
  int64_t grpo_max_completion_length = 256;  // new tokens per completion at most
  bool grpo_offload_optimizer_state = false;  // the AdamW moments on the host while generating
  int64_t grpo_max_num_seqs = 0;  // completions decoded at once on a rank; 0: all of its batch's
  int64_t grpo_generation_gpus = 0;  // split placement: the last ranks only generate; 0: colocated
  bool grpo_async_generation = false;  // split: the next batch generates while this one trains
  double grpo_temperature = 1.0;
  int64_t grpo_top_k = 0;
  double grpo_top_p = 1.0;
  double grpo_min_p = 0.0;
  double grpo_epsilon = 0.2, grpo_epsilon_high = 0.2;  // the ratio's clip range
  double grpo_beta = 0.0;                              // the KL penalty's weight
  GrpoLossType grpo_loss_type = GrpoLossType::Grpo;
  bool grpo_scale_rewards = true;      // false: Dr. GRPO's advantages (no division by the std)
  int64_t grpo_num_iterations = 1;     // optimizer steps per generation batch (TRL's mu)
  bool grpo_dynamic_sampling = false;  // DAPO: groups whose rewards are all equal are dropped
  std::string grpo_rewards = "answer";  // name[:weight],... (train/grpo_run.h)
  AnswerFormat grpo_answer_format = AnswerFormat::Hash;
  std::string grpo_answer_regex, grpo_format_regex;
  int64_t grpo_overlong_cache = 0;  // DAPO's soft over-long buffer, in tokens
  std::string grpo_stop_strings;      // data/stop_strings.h: one string or a list
  std::string grpo_reward_command;
  double grpo_reward_timeout = 60.0;  // seconds
  // LoRA (model/lora_model.h): adapters of this rank on lora_target_modules, the rest frozen;
  // 0: the whole model trains.
  int64_t lora_rank = 0;
  double lora_alpha = 32.0;
  double lora_dropout = 0.0;
  std::string lora_target_modules = "all-linear";
  int64_t train_iters = 100;
  // The run's length in samples instead (Megatron): train_iters = train_samples /
  // global_batch_size, derived while loading. 0: train_iters gives it.
  int64_t train_samples = 0;
  int64_t exit_interval = 0;         // stop after an iteration that is a multiple; 0: off
  double exit_duration_in_mins = 0;  // stop once the process has run this long; 0: off
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t seq_length = 128;
  double lr = 3e-4;
  double min_lr = 0.0;
  int64_t lr_warmup_iters = 0;
  int64_t lr_decay_iters = 0;             // 0: train_iters
  // Megatron's sample-based schedule (with train_samples) and warm-up as a fraction of the
  // decay; 0 (the fraction: negative) is unset. The schedule runs in samples either way
  // (train/lr_schedule.h), so iterations are global batches of samples.
  int64_t lr_warmup_samples = 0;
  int64_t lr_decay_samples = 0;
  double lr_warmup_fraction = -1.0;
  LrDecayStyle lr_decay_style = LrDecayStyle::Cosine;
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::Exponential;
  int64_t lr_wsd_decay_iters = 0;  // WSD: the annealing phase, in iterations or samples
  int64_t lr_wsd_decay_samples = 0;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;                 // 0: no clipping
  int64_t seed = 1234;
  DeviceChoice device = DeviceChoice::Auto;
  Precision precision = Precision::Auto;  // auto: bf16 on GPUs, fp32 on the CPU reference
  RecomputeGranularity recompute_granularity = RecomputeGranularity::None;
  RecomputeMethod recompute_method = RecomputeMethod::None;
  // With full recompute: layers per uniform group, or recomputed layers per pipeline stage
  // (block); without a method, 0 recomputes every layer and N the first N (block).
  int64_t recompute_num_layers = 0;
  int64_t max_consecutive_nan_iters = 10;
  int64_t cross_entropy_chunk_tokens = 8192;
  AttentionBackend attention_backend = AttentionBackend::Auto;
  bool gemm_autotune = true;  // time cuBLASLt's candidate algorithms per GEMM shape
  bool deterministic_mode = false;  // bit-reproducible attention backward (Megatron's name)
  Fp8Mode fp8 = Fp8Mode::Off;
  Fp8Recipe fp8_recipe = Fp8Recipe::Delayed;
  int64_t fp8_amax_history_len = 1024;
  Fp8AmaxAlgo fp8_amax_compute_algo = Fp8AmaxAlgo::Max;
  int64_t fp8_margin = 0;
  bool fp8_lm_head = false;
  bool fp8_weight_transpose_cache = true;
  // Megatron's name: attention's forward products on e4m3 codes (AttentionShape::fp8).
  bool fp8_dot_product_attention = false;
  // Transformer Engine's MMParams.use_split_accumulator per FP8 GEMM kind: false lets the tensor
  // cores keep partial sums in reduced precision (faster, error growing with K).
  bool fp8_gemm_fprop_split_accumulator = false;
  bool fp8_gemm_dgrad_split_accumulator = true;
  bool fp8_gemm_wgrad_split_accumulator = true;
  // Model parallelism (docs/distributed.md), Megatron's keys. The data-parallel size is what
  // the world leaves: world / (tensor x pipeline x context).
  int64_t tensor_model_parallel_size = 1;
  bool sequence_parallel = false;  // with tensor parallelism: norms and residuals sharded too
  int64_t pipeline_model_parallel_size = 1;
  // Interleaved 1F1B: model chunks per pipeline rank, given directly or by layers per chunk;
  // 0 is Megatron's None (one chunk per rank, plain 1F1B).
  int64_t virtual_pipeline_model_parallel_size = 0;
  int64_t num_layers_per_virtual_pipeline_stage = 0;
  // Uneven pipelines: layers of the first and the last stage; 0 is an even share.
  int64_t decoder_first_pipeline_num_layers = 0;
  int64_t decoder_last_pipeline_num_layers = 0;
  int64_t context_parallel_size = 1;
  // Data parallelism (docs/distributed.md); the world size comes from the launcher.
  bool use_distributed_optimizer = false;  // ZeRO-1: optimizer state sharded over ranks
  bool use_torch_fsdp2 = false;            // FSDP (ZeRO-3): parameters and gradients sharded too
  bool overlap_grad_reduce = true;         // reduce gradient buckets during the backward
  bool overlap_param_gather = false;       // ZeRO-1: gather parameters during the next forward
  int64_t ddp_bucket_size = 40000000;      // elements per gradient bucket
  // Megatron's precision-aware optimizer (docs/memory.md): the dtypes the optimizer's tensors
  // are stored in (fp32 or bf16; the AdamW arithmetic stays fp32). Other than fp32 only with
  // use_precision_aware_optimizer, which, as in Megatron, needs the distributed optimizer (or
  // FSDP). main_grads_dtype bf16: the gradient buffer accumulates and is reduced in bf16;
  // main_params_dtype bf16: no fp32 master copy, the bf16 parameters are updated in place.
  bool use_precision_aware_optimizer = false;
  DType main_grads_dtype = DType::F32;
  // Megatron's DDP option: the gradient buffer in bf16 (as main_grads_dtype bf16), without the
  // precision-aware optimizer.
  bool grad_reduce_in_bf16 = false;
  DType main_params_dtype = DType::F32;
  // Megatron's store_param_remainders: an fp32 master beside bf16 parameters is kept as its
  // low 16 bits only, the parameters being its high halves (core/split_master.h): the same
  // fp32 values in 2 bytes a parameter less; false keeps a whole fp32 copy.
  bool store_param_remainders = true;
  DType exp_avg_dtype = DType::F32;
  DType exp_avg_sq_dtype = DType::F32;
  double dist_timeout_minutes = 10.0;      // rendezvous and collective timeout
  int64_t expert_model_parallel_size = 1;  // ranks the experts of a layer are spread over
  // Benchmarks: route tokens round-robin over the experts instead of by the router's scores
  // (published MoE numbers are force-balanced); the router's weights still get gradients.
  bool moe_force_balance = false;
};

struct DataConfig {
  bool mock_data = false;
  std::string data_path;                  // Megatron blend "w1 prefix1 w2 prefix2", split by `split`
  std::string train_data_path;            // training blend, or a plain/Brown text file or directory
  std::string valid_data_path;            // validation blend (instead of the split's valid part)
  std::string data_cache_path;            // sample-index caches; empty: beside the data
  std::string split = "969,30,1";
  bool eod_mask_loss = false;             // no loss where the input token is end-of-document
  // Megatron's: positions restart at each document (after an end-of-document token, and at
  // the dataset's document boundaries), and attention stays within each document.
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  PackingStrategy packing_strategy = PackingStrategy::Wrapped;
  LossMask loss_mask = LossMask::Assistant;  // chat data only
  TokenizerType tokenizer_type = TokenizerType::ByteLevel;
  std::string tokenizer_model;            // tokenizer.json path or shipped name (llama3, qwen3, ...)
  std::string vocab_file;                 // GPT2BPETokenizer: vocab.json
  std::string merge_file;                 // GPT2BPETokenizer: merges.txt
  int64_t eval_interval = 0;              // 0: no evaluation
  int64_t eval_iters = 10;
  double target_loss = 0;                 // stop when the validation loss reaches it; 0: off
  bool skip_train = false;                // evaluate the loaded weights only, then exit
};

struct CheckpointConfig {
  std::string save;                       // directory checkpoints are written to; empty: none
  std::string load;                       // directory to resume from; empty: start fresh
  int64_t save_interval = 0;              // iterations between checkpoints; 0: only at the end
  int64_t ckpt_keep_last = 2;             // checkpoints kept in `save`; 0 keeps all
  bool disable_last_saving = false;       // Primus's: no checkpoint at the end of the run
  std::string hf_init_path;               // Hugging Face model directory for initial weights
  // Megatron's --finetune: `load` gives the weights only; iteration, data position and
  // optimizer state start fresh.
  bool finetune = false;
  bool no_load_optim = false;             // resume the counters, not the optimizer state
  // Megatron-Bridge's PEFT base: the checkpoint directory whose latest weights a LoRA run
  // freezes and adapts (`load` then resumes the adapters).
  std::string pretrained_checkpoint;
  // DPO's and GRPO's reference (TRL's ref_model): a checkpoint directory whose latest weights
  // are the reference instead of the starting weights.
  std::string reference_load;
};

struct LoggingConfig {
  int64_t log_interval = 1;
  bool log_progress = true;               // progress bar on a terminal
  bool profile = false;                   // record a trace of iterations [start, end)
  int64_t profile_step_start = 10;
  int64_t profile_step_end = 12;
  std::string profile_ranks = "0";        // comma-separated ranks, or "all"
  // TensorBoard event files (obs/tensorboard.h), rank 0; empty: none.
  std::string tensorboard_dir;
  int64_t tensorboard_log_interval = 1;
  bool log_learning_rate_to_tensorboard = true;
  bool log_timers_to_tensorboard = false;
  bool log_throughput_to_tensorboard = false;
  bool log_memory_to_tensorboard = false;
  bool log_validation_ppl_to_tensorboard = false;
};

// A Megatron or Primus key accepted without effect (config/megatron_keys.h), for the run's log.
struct AcceptedMegatronKey {
  std::string key, value, origin;
};

struct Experiment {
  std::string work_group = "tessera";
  std::string user_name = "user";
  std::string exp_name = "default";
  std::string workspace = "./output";
  std::string model = "";                 // preset name or path it was built from
  ModelConfig model_config;
  TrainingConfig training;
  DataConfig data;
  CheckpointConfig checkpoint;
  LoggingConfig logging;

  // Where each key's value came from ("file.yaml:12", "command line", "default"), for errors.
  std::map<std::string, std::string> origin;
  std::string source_file;                // the experiment file given to the loader
  // Megatron/Primus keys that were accepted without effect, each once (its last setting).
  std::vector<AcceptedMegatronKey> megatron_keys;

  // {workspace}/{work_group}/{user_name}/{exp_name}
  std::string experiment_root() const;
  // logging.tensorboard_dir; a relative one lies under the experiment root, where Primus puts
  // its {experiment}/tensorboard. Empty when TensorBoard is off.
  std::string tensorboard_directory() const {
    const std::string& d = logging.tensorboard_dir;
    return d.empty() || d.front() == '/' ? d : experiment_root() + "/" + d;
  }
};

struct LoadOptions {
  std::string config_path;                 // empty: the shipped default experiment
  std::vector<std::string> cli_overrides;  // "--key value" / "--key=value" tokens
  int data_parallel_size = 1;              // ranks of the job (world size) seen by validation
};

// Loads, merges, substitutes and validates. Throws ConfigError naming file, key, value and
// what was expected; touches nothing on disk.
Experiment load_experiment(const LoadOptions& options);

// The shipped configs of one folder of configs/ by the names they are given as (`models`:
// "llama3.1_8B", ..., `experiments`: "default", "primus/llama3.1_8B-pretrain", ...), sorted.
std::vector<std::string> shipped_config_names(std::string_view folder);

// Model chunks per pipeline rank: virtual_pipeline_model_parallel_size, or what
// num_layers_per_virtual_pipeline_stage makes of num_layers; 1 without interleaving.
int64_t virtual_pipeline_chunks(const TrainingConfig& t, int64_t num_layers);

// The learning-rate schedule's phases (train/lr_schedule.h) in the unit it counts in: iterations,
// or samples when a sample-based key (lr_warmup_samples, lr_decay_samples, lr_wsd_decay_samples)
// is set, as Megatron counts them.
struct LrSchedulePhases {
  bool in_samples = false;
  double warmup = 0;     // steps of warm-up
  double decay_end = 0;  // the step at which the decay reaches min_lr
  double wsd_decay = 0;  // WSD: steps of annealing that end the decay
};
LrSchedulePhases lr_schedule_phases(const TrainingConfig& t);

// "969,30,1" -> {969, 30, 1}; empty on malformed input (negative, non-numeric).
std::vector<double> parse_split(const std::string& text);

// The effective configuration as YAML (every key, in registry order), for logs and the
// experiment directory.
std::string experiment_to_yaml(const Experiment& e);

}  // namespace tessera
