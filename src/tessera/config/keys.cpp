#include "tessera/config/keys.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

bool is_null(const std::string& s) { return s.empty() || s == "null" || s == "~" || s == "None"; }

bool parse_int(const std::string& s, int64_t* out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end;
}

bool parse_float(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  *out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(*out);
}

bool parse_bool(const std::string& s, bool* out) {
  if (s == "true" || s == "True" || s == "TRUE" || s == "1") return *out = true, true;
  if (s == "false" || s == "False" || s == "FALSE" || s == "0") return *out = false, true;
  return false;
}

std::string format_float(double v) {
  std::string s = fmt::format("{}", v);
  // Keep floats recognisable as floats in the dumped YAML.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

template <class Access>
KeySpec int_key(std::string_view name, std::string_view section, std::string_view help,
                Access access) {
  return {name, section, KeyType::Int, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            if (!parse_int(t, &access(e))) return "an integer";
            return "";
          },
          [access](const Experiment& e) {
            return std::to_string(access(const_cast<Experiment&>(e)));
          }};
}

// A count where Megatron's YAMLs write null for none: null reads as 0 and 0 prints as null.
template <class Access>
KeySpec optional_count_key(std::string_view name, std::string_view section, std::string_view help,
                           Access access) {
  return {name, section, KeyType::Int, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            if (is_null(t)) return access(e) = 0, "";
            if (!parse_int(t, &access(e))) return "an integer, or null for none";
            return "";
          },
          [access](const Experiment& e) {
            const int64_t v = access(const_cast<Experiment&>(e));
            return v == 0 ? std::string("null") : std::to_string(v);
          }};
}

template <class Access>
KeySpec float_key(std::string_view name, std::string_view section, std::string_view help,
                  Access access) {
  return {name, section, KeyType::Float, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            if (!parse_float(t, &access(e))) return "a finite number";
            return "";
          },
          [access](const Experiment& e) {
            return format_float(access(const_cast<Experiment&>(e)));
          }};
}

// A number that may be unset: null reads as (and a negative value dumps as) null.
template <class Access>
KeySpec optional_float_key(std::string_view name, std::string_view section, std::string_view help,
                           Access access) {
  return {name, section, KeyType::Float, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            if (is_null(t)) {
              access(e) = -1.0;
              return "";
            }
            if (!parse_float(t, &access(e)) || access(e) < 0) return "null or a non-negative number";
            return "";
          },
          [access](const Experiment& e) {
            const double v = access(const_cast<Experiment&>(e));
            return v < 0 ? std::string("null") : format_float(v);
          }};
}

template <class Access>
KeySpec bool_key(std::string_view name, std::string_view section, std::string_view help,
                 Access access);

// Megatron's store_true flags, whose files write "not set" as null: null is false.
template <class Access>
KeySpec flag_key(std::string_view name, std::string_view section, std::string_view help,
                 Access access) {
  KeySpec k = bool_key(name, section, help, access);
  k.set = [access, set = k.set](Experiment& e, const std::string& t) {
    if (!is_null(t)) return set(e, t);
    access(e) = false;
    return std::string();
  };
  return k;
}

template <class Access>
KeySpec bool_key(std::string_view name, std::string_view section, std::string_view help,
                 Access access) {
  return {name, section, KeyType::Bool, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            if (!parse_bool(t, &access(e))) return "true or false";
            return "";
          },
          [access](const Experiment& e) {
            return access(const_cast<Experiment&>(e)) ? std::string("true") : std::string("false");
          }};
}

template <class Access>
KeySpec string_key(std::string_view name, std::string_view section, std::string_view help,
                   Access access) {
  return {name, section, KeyType::String, help, {},
          [access](Experiment& e, const std::string& t) -> std::string {
            access(e) = is_null(t) ? std::string() : t;
            return "";
          },
          [access](const Experiment& e) {
            const std::string& v = access(const_cast<Experiment&>(e));
            return v.empty() ? std::string("null") : v;
          }};
}

template <class E>
struct Choice {
  std::string_view name;
  E value;
};

template <class E, class Access>
KeySpec choice_key(std::string_view name, std::string_view section, std::string_view help,
                   std::vector<Choice<E>> choices, Access access) {
  std::vector<std::string_view> names;
  std::string expected = "one of: ";
  for (const auto& c : choices) {
    expected += (names.empty() ? "" : ", ") + std::string(c.name);
    names.push_back(c.name);
  }
  return {name, section, KeyType::Choice, help, names,
          [access, choices, expected](Experiment& e, const std::string& t) -> std::string {
            const std::string key = is_null(t) ? "null" : t;
            for (const auto& c : choices) {
              if (c.name == key) {
                access(e) = c.value;
                return "";
              }
            }
            return expected;
          },
          [access, choices](const Experiment& e) {
            for (const auto& c : choices)
              if (c.value == access(const_cast<Experiment&>(e))) return std::string(c.name);
            return std::string("?");
          }};
}

#define TS_FIELD(path) [](Experiment& e) -> auto& { return e.path; }

std::vector<KeySpec> build_keys() {
  std::vector<KeySpec> k;
  // ---- experiment ----
  k.push_back(string_key("work_group", "experiment", "Team or group; second level of the experiment directory.", TS_FIELD(work_group)));
  k.push_back(string_key("user_name", "experiment", "User; third level of the experiment directory.", TS_FIELD(user_name)));
  k.push_back(string_key("exp_name", "experiment", "Experiment name; last level of the experiment directory.", TS_FIELD(exp_name)));
  k.push_back(string_key("workspace", "experiment", "Root of all experiment directories: {workspace}/{work_group}/{user_name}/{exp_name}.", TS_FIELD(workspace)));
  k.push_back(string_key("model", "experiment", "Model preset: a name from configs/models (e.g. llama3.1_8B) or a YAML path.", TS_FIELD(model)));
  // ---- model ----
  k.push_back(string_key("model_family", "model", "Model family: which blocks the decoder layers have, which model keys apply and how Hugging Face names them; docs/models.md lists the families and their presets, and an unknown name is refused with the registered ones.", TS_FIELD(model_config.model_family)));
  k.push_back(int_key("num_layers", "model", "Transformer layers; set lower than the preset for a proxy model.", TS_FIELD(model_config.num_layers)));
  k.push_back(int_key("hidden_size", "model", "Model width.", TS_FIELD(model_config.hidden_size)));
  k.push_back(int_key("ffn_hidden_size", "model", "SwiGLU inner width; 0 derives int(8*hidden/3/64)*64 as Megatron does.", TS_FIELD(model_config.ffn_hidden_size)));
  k.push_back(int_key("num_attention_heads", "model", "Query heads.", TS_FIELD(model_config.num_attention_heads)));
  k.push_back(int_key("num_query_groups", "model", "Key/value heads (grouped-query attention); 0 means one per query head.", TS_FIELD(model_config.num_query_groups)));
  k.push_back(int_key("kv_channels", "model", "Head dimension; 0 means hidden_size / num_attention_heads.", TS_FIELD(model_config.kv_channels)));
  k.push_back(int_key("max_position_embeddings", "model", "Longest sequence the model is configured for; seq_length may not exceed it.", TS_FIELD(model_config.max_position_embeddings)));
  k.push_back(int_key("vocab_size", "model", "Vocabulary size before padding; 0 takes the tokenizer's.", TS_FIELD(model_config.vocab_size)));
  k.push_back(int_key("make_vocab_size_divisible_by", "model", "Pad the vocabulary (embedding and output rows) to a multiple of this.", TS_FIELD(model_config.make_vocab_size_divisible_by)));
  k.push_back(float_key("rotary_base", "model", "RoPE base frequency (theta).", TS_FIELD(model_config.rotary_base)));
  k.push_back(bool_key("use_rope_scaling", "model", "Apply Llama 3.1 RoPE frequency scaling.", TS_FIELD(model_config.use_rope_scaling)));
  k.push_back(float_key("rope_scaling_factor", "model", "Llama 3.1 RoPE scaling factor.", TS_FIELD(model_config.rope_scaling_factor)));
  k.push_back(float_key("rope_low_freq_factor", "model", "Llama 3.1 RoPE low-frequency factor.", TS_FIELD(model_config.rope_low_freq_factor)));
  k.push_back(float_key("rope_high_freq_factor", "model", "Llama 3.1 RoPE high-frequency factor.", TS_FIELD(model_config.rope_high_freq_factor)));
  k.push_back(int_key("rope_original_max_position_embeddings", "model", "Context length the Llama 3.1 RoPE scaling is relative to.", TS_FIELD(model_config.rope_original_max_position_embeddings)));
  k.push_back(float_key("norm_epsilon", "model", "RMSNorm epsilon.", TS_FIELD(model_config.norm_epsilon)));
  k.push_back(bool_key("add_qkv_bias", "model", "Bias on the query/key/value projections (Qwen 2.5).", TS_FIELD(model_config.add_qkv_bias)));
  k.push_back(bool_key("untie_embeddings_and_output_weights", "model", "Separate output head; false shares the embedding matrix.", TS_FIELD(model_config.untie_embeddings_and_output_weights)));
  k.push_back(int_key("sliding_window", "model", "Sliding-window attention span (Mistral: 4096); 0 is full causal attention.", TS_FIELD(model_config.sliding_window)));
  k.push_back(float_key("init_method_std", "model", "Standard deviation of the normal weight initialisation; output projections use std/sqrt(2*num_layers).", TS_FIELD(model_config.init_method_std)));
  k.push_back(bool_key("qk_layernorm", "model", "RMSNorm over each query and key head before RoPE, with one weight vector (head_dim) for the queries and one for the keys (Qwen3).", TS_FIELD(model_config.qk_layernorm)));
  k.push_back(int_key("num_experts", "model", "Experts per MoE layer (docs/moe.md); 0 is a dense model. The mixtral and qwen3_moe families need it.", TS_FIELD(model_config.num_experts)));
  k.push_back(int_key("moe_router_topk", "model", "Experts each token is routed to.", TS_FIELD(model_config.moe_router_topk)));
  k.push_back(int_key("moe_ffn_hidden_size", "model", "SwiGLU inner width of each routed expert; 0 means ffn_hidden_size.", TS_FIELD(model_config.moe_ffn_hidden_size)));
  k.push_back(int_key("moe_shared_expert_intermediate_size", "model", "SwiGLU inner width of the shared expert every token also passes (DeepSeek); 0: none.", TS_FIELD(model_config.moe_shared_expert_intermediate_size)));
  k.push_back(string_key("moe_layer_freq", "model", "Which layers are MoE (the others dense SwiGLU): N makes every Nth layer, from the first, MoE (1: all); or Megatron's list with one 0/1 entry per layer, e.g. \"[0]*3+[1]*27\" or \"[1,0,1,0]\".", TS_FIELD(model_config.moe_layer_freq)));
  k.back().accepts_list = true;
  k.push_back(choice_key<MoeLoadBalancing>("moe_router_load_balancing_type", "model", "Load-balancing loss: aux_loss (Switch Transformer's, over the micro-batch), seq_aux_loss (DeepSeek's, per sequence) or none. Weighted by moe_aux_loss_coeff.", {{"aux_loss", MoeLoadBalancing::AuxLoss}, {"seq_aux_loss", MoeLoadBalancing::SeqAuxLoss}, {"none", MoeLoadBalancing::None}}, TS_FIELD(model_config.moe_router_load_balancing_type)));
  k.push_back(float_key("moe_aux_loss_coeff", "model", "Weight of the load-balancing loss in the training objective; 0 trains without it (its value is still reported).", TS_FIELD(model_config.moe_aux_loss_coeff)));
  k.push_back(float_key("moe_z_loss_coeff", "model", "Weight of the router z-loss, mean(logsumexp(logits)^2) (ST-MoE); 0 trains without it (its value is still reported).", TS_FIELD(model_config.moe_z_loss_coeff)));
  k.push_back(choice_key<MoeScoreFunction>("moe_router_score_function", "model", "Router scores: softmax over the experts (Mixtral, Qwen3-MoE) or sigmoid per expert (DeepSeek-V3).", {{"softmax", MoeScoreFunction::Softmax}, {"sigmoid", MoeScoreFunction::Sigmoid}}, TS_FIELD(model_config.moe_router_score_function)));
  k.push_back(bool_key("moe_router_pre_softmax", "model", "Softmax over all experts before the top-k, the weights not renormalised (DeepSeek-V2); false: top-k of the logits, then softmax over the chosen (Mixtral, Qwen3-MoE).", TS_FIELD(model_config.moe_router_pre_softmax)));
  k.push_back(bool_key("moe_router_enable_expert_bias", "model", "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing experts only, moved by moe_router_bias_update_rate after every step towards balance. Sigmoid scores only.", TS_FIELD(model_config.moe_router_enable_expert_bias)));
  k.push_back(float_key("moe_router_bias_update_rate", "model", "Step of the expert-bias update: bias += rate * sign(mean tokens per expert - the expert's tokens), over the step's tokens on all ranks.", TS_FIELD(model_config.moe_router_bias_update_rate)));
  k.push_back(int_key("moe_router_num_groups", "model", "Group-limited routing (DeepSeek): experts in this many equal groups; each token first picks moe_router_group_topk groups by the sum of their top (topk / group_topk) scores, then its experts among them. 0: off.", TS_FIELD(model_config.moe_router_num_groups)));
  k.push_back(int_key("moe_router_group_topk", "model", "Groups each token may route to (with moe_router_num_groups).", TS_FIELD(model_config.moe_router_group_topk)));
  k.push_back(float_key("moe_router_topk_scaling_factor", "model", "Multiplies the routing weights (DeepSeek-V3: 2.5); 0 leaves them unscaled.", TS_FIELD(model_config.moe_router_topk_scaling_factor)));
  k.push_back(optional_float_key("moe_expert_capacity_factor", "model", "Megatron's token dropping: each expert takes at most ceil(tokens x topk / num_experts x factor) of a micro-batch's (token, expert) pairs (per rank under expert parallelism), the rest are dropped (moe_token_drop_policy); null (unset) is dropless.", TS_FIELD(model_config.moe_expert_capacity_factor)));
  k.push_back(choice_key<MoeDropPolicy>("moe_token_drop_policy", "model", "With moe_expert_capacity_factor: which of an expert's pairs beyond its capacity are dropped: probs (the lowest routing weights, Megatron's default) or position (the latest tokens).", {{"probs", MoeDropPolicy::Probs}, {"position", MoeDropPolicy::Position}}, TS_FIELD(model_config.moe_token_drop_policy)));
  k.push_back(bool_key("moe_pad_expert_input_to_capacity", "model", "Megatron's padding of every expert's input to its capacity; not implemented, so false (the experts run on the rows they keep).", TS_FIELD(model_config.moe_pad_expert_input_to_capacity)));
  k.push_back(choice_key<MoeDispatcher>("moe_token_dispatcher_type", "model", "How tokens reach their experts' ranks: alltoall (variable-size all-to-all over the expert-parallel group). Megatron's allgather and flex dispatchers are accepted as alltoall: every expert receives the same tokens, only the communication differs.", {{"alltoall", MoeDispatcher::AllToAll}, {"allgather", MoeDispatcher::AllToAll}, {"flex", MoeDispatcher::AllToAll}}, TS_FIELD(model_config.moe_token_dispatcher_type)));
  k.push_back(bool_key("multi_latent_attention", "model", "Multi-head latent attention (DeepSeek-V2/V3; model_family deepseek): queries from a q_lora_rank latent, keys and values from a kv_lora_rank latent, each head's query and key a qk_head_dim part without RoPE plus a qk_pos_emb_head_dim part with it (the key's shared by all heads), values of v_head_dim. kv_channels is not used.", TS_FIELD(model_config.multi_latent_attention)));
  k.push_back(optional_count_key("q_lora_rank", "model", "MLA: width of the query latent (DeepSeek-V3: 1536), RMS-normalised before the per-head up-projection; null (0) projects queries directly from the hidden state (DeepSeek-V2-Lite).", TS_FIELD(model_config.q_lora_rank)));
  k.push_back(int_key("kv_lora_rank", "model", "MLA: width of the key/value latent (DeepSeek: 512), RMS-normalised before the per-head up-projection to keys and values; required with multi_latent_attention.", TS_FIELD(model_config.kv_lora_rank)));
  k.push_back(int_key("qk_head_dim", "model", "MLA: per-head query/key dimension without RoPE (DeepSeek: 128).", TS_FIELD(model_config.qk_head_dim)));
  k.push_back(int_key("qk_pos_emb_head_dim", "model", "MLA: per-head query/key dimension with RoPE (DeepSeek: 64, even); the key's part is one vector shared by every head.", TS_FIELD(model_config.qk_pos_emb_head_dim)));
  k.push_back(int_key("v_head_dim", "model", "MLA: per-head value dimension (DeepSeek: 128).", TS_FIELD(model_config.v_head_dim)));
  k.push_back(choice_key<RopeType>("rope_type", "model", "RoPE variant: rope, yarn (DeepSeek's YaRN: rotary_scaling_factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim; multi_latent_attention only), or null for Megatron's default (yarn with multi_latent_attention, rope otherwise).", {{"null", RopeType::Default}, {"rope", RopeType::Rope}, {"yarn", RopeType::Yarn}}, TS_FIELD(model_config.rope_type)));
  k.push_back(float_key("rotary_scaling_factor", "model", "YaRN: context extension factor (DeepSeek: 40); frequencies below the beta_slow band are divided by it. 1 leaves RoPE unchanged.", TS_FIELD(model_config.rotary_scaling_factor)));
  k.push_back(int_key("original_max_position_embeddings", "model", "YaRN: the context length the model was pretrained with, which the beta_fast/beta_slow rotation counts refer to (DeepSeek: 4096).", TS_FIELD(model_config.original_max_position_embeddings)));
  k.push_back(float_key("beta_fast", "model", "YaRN: frequencies making at least this many rotations over original_max_position_embeddings keep their value (DeepSeek: 32).", TS_FIELD(model_config.beta_fast)));
  k.push_back(float_key("beta_slow", "model", "YaRN: frequencies making at most this many rotations are fully interpolated (DeepSeek: 1); a linear ramp lies between.", TS_FIELD(model_config.beta_slow)));
  k.push_back(float_key("mscale", "model", "YaRN: the cos/sin table is multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale(s, m) = 0.1 m ln(s) + 1 (DeepSeek-V2-Lite: 0.707, V3: 1).", TS_FIELD(model_config.mscale)));
  k.push_back(float_key("mscale_all_dim", "model", "YaRN: the attention softmax scale is multiplied by mscale(rotary_scaling_factor, mscale_all_dim)^2 (DeepSeek-V2-Lite: 0.707, V3: 1; 0 leaves it 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)).", TS_FIELD(model_config.mscale_all_dim)));
  // ---- training ----
  k.push_back(int_key("train_iters", "training", "Optimizer steps to run; 0 lets train_samples set it.", TS_FIELD(training.train_iters)));
  k.push_back(int_key("train_samples", "training", "The run's length in samples, as Megatron: train_iters = train_samples / global_batch_size (rounded down); 0: train_iters gives it. Not with a different train_iters.", TS_FIELD(training.train_samples)));
  k.push_back(int_key("exit_interval", "training", "Stop after the iteration that is a multiple of this (counted from iteration 0, as Megatron), with a checkpoint when save is set, and exit 0; 0 disables.", TS_FIELD(training.exit_interval)));
  k.push_back(float_key("exit_duration_in_mins", "training", "Stop after the iteration during which the process has run this many minutes (fractions allowed; every rank stops at the same one), with a checkpoint when save is set, and exit 0; 0 disables.", TS_FIELD(training.exit_duration_in_mins)));
  k.push_back(int_key("micro_batch_size", "training", "Sequences per forward/backward pass on one GPU.", TS_FIELD(training.micro_batch_size)));
  k.push_back(int_key("global_batch_size", "training", "Sequences per optimizer step over all ranks: micro_batch_size x data-parallel size x accumulation steps.", TS_FIELD(training.global_batch_size)));
  k.push_back(int_key("seq_length", "training", "Tokens per sequence.", TS_FIELD(training.seq_length)));
  k.push_back(float_key("lr", "training", "Peak learning rate.", TS_FIELD(training.lr)));
  k.push_back(float_key("min_lr", "training", "Learning rate at the end of the decay.", TS_FIELD(training.min_lr)));
  k.push_back(int_key("lr_warmup_iters", "training", "Linear warm-up steps from 0 to lr.", TS_FIELD(training.lr_warmup_iters)));
  k.push_back(int_key("lr_decay_iters", "training", "Step at which the decay reaches min_lr; 0 means train_iters.", TS_FIELD(training.lr_decay_iters)));
  k.push_back(int_key("lr_warmup_samples", "training", "Megatron's sample-based warm-up (with train_samples): linear from 0 to lr over this many samples; 0: lr_warmup_iters (or lr_warmup_fraction) gives it.", TS_FIELD(training.lr_warmup_samples)));
  k.push_back(optional_count_key("lr_decay_samples", "training", "Megatron's sample-based decay end (with train_samples): the sample at which the decay reaches min_lr; null (0) means train_samples.", TS_FIELD(training.lr_decay_samples)));
  k.push_back(optional_float_key("lr_warmup_fraction", "training", "Warm-up as a fraction of the decay span (lr_decay_iters or lr_decay_samples), as Megatron; null: lr_warmup_iters / lr_warmup_samples. Not with those set.", TS_FIELD(training.lr_warmup_fraction)));
  k.push_back(choice_key<LrDecayStyle>("lr_decay_style", "training", "Learning-rate decay after warm-up: cosine, linear, constant, or WSD (warmup-stable-decay: lr held, then annealed to min_lr over the last lr_wsd_decay_iters / lr_wsd_decay_samples of the decay in lr_wsd_decay_style).", {{"cosine", LrDecayStyle::Cosine}, {"linear", LrDecayStyle::Linear}, {"constant", LrDecayStyle::Constant}, {"WSD", LrDecayStyle::Wsd}}, TS_FIELD(training.lr_decay_style)));
  k.push_back(choice_key<WsdDecayStyle>("lr_wsd_decay_style", "training", "WSD's annealing shape over its decay phase (ratio r from 0 to 1): exponential 2 x 0.5^r - 1, linear 1 - r, cosine (1 + cos(pi r)) / 2, minus_sqrt 1 - sqrt(r), as Megatron.", {{"exponential", WsdDecayStyle::Exponential}, {"linear", WsdDecayStyle::Linear}, {"cosine", WsdDecayStyle::Cosine}, {"minus_sqrt", WsdDecayStyle::MinusSqrt}}, TS_FIELD(training.lr_wsd_decay_style)));
  k.push_back(optional_count_key("lr_wsd_decay_iters", "training", "WSD: iterations of annealing that end the decay; required with lr_decay_style WSD in an iteration-based run.", TS_FIELD(training.lr_wsd_decay_iters)));
  k.push_back(optional_count_key("lr_wsd_decay_samples", "training", "WSD: samples of annealing that end the decay (with train_samples); required with lr_decay_style WSD in a sample-based run.", TS_FIELD(training.lr_wsd_decay_samples)));
  k.push_back(float_key("weight_decay", "training", "AdamW decoupled weight decay on weight matrices (not on norms and biases).", TS_FIELD(training.weight_decay)));
  k.push_back(float_key("adam_beta1", "training", "AdamW first-moment decay.", TS_FIELD(training.adam_beta1)));
  k.push_back(float_key("adam_beta2", "training", "AdamW second-moment decay.", TS_FIELD(training.adam_beta2)));
  k.push_back(float_key("adam_eps", "training", "AdamW epsilon.", TS_FIELD(training.adam_eps)));
  k.push_back(float_key("clip_grad", "training", "Clip the global gradient norm to this; 0 disables clipping.", TS_FIELD(training.clip_grad)));
  k.push_back(choice_key<Objective>("objective", "training", "What a step optimises: lm, the next-token loss (pretraining, SFT); dpo, direct preference optimisation over the pairs of a preprocess --preference dataset (docs/finetuning.md): each pair's chosen and rejected answers against the starting weights' log-probabilities (the reference, computed once before training and kept beside the dataset: dpo_reference_logps), global_batch_size counting pairs; grpo, group relative policy optimisation (docs/finetuning.md): completions of train_data_path's prompts generated by the policy being trained, scored by grpo_rewards, global_batch_size counting completions.", {{"lm", Objective::Lm}, {"dpo", Objective::Dpo}, {"grpo", Objective::Grpo}}, TS_FIELD(training.objective)));
  k.push_back(float_key("dpo_beta", "training", "DPO's beta (TRL's beta): how far from the reference the policy may move; the rewards are beta times the log-probability ratios.", TS_FIELD(training.dpo_beta)));
  k.push_back(choice_key<DpoLossType>("dpo_loss_type", "training", "DPO's loss (TRL's loss_type): sigmoid (DPO; with dpo_label_smoothing, robust/conservative DPO), ipo or hinge (SLiC).", {{"sigmoid", DpoLossType::Sigmoid}, {"ipo", DpoLossType::Ipo}, {"hinge", DpoLossType::Hinge}}, TS_FIELD(training.dpo_loss_type)));
  k.push_back(float_key("dpo_label_smoothing", "training", "DPO's label smoothing (TRL's label_smoothing, the sigmoid loss's assumed share of flipped preferences), in [0, 0.5).", TS_FIELD(training.dpo_label_smoothing)));
  k.push_back(bool_key("dpo_length_normalize", "training", "DPO: each answer's log-probability divided by its tokens (the mean per token, as TRL's IPO and SimPO use them), for the loss and the rewards.", TS_FIELD(training.dpo_length_normalize)));
  k.push_back(bool_key("dpo_reference_free", "training", "DPO without a reference (TRL's reference_free): its log-probabilities are taken as 0 and not computed; with dpo_length_normalize, SimPO's loss without its margin.", TS_FIELD(training.dpo_reference_free)));
  k.push_back(string_key("dpo_reference_logps", "training", "DPO: the file of the reference's log-probabilities of the dataset's pairs (TRL's precompute_ref_log_probs, kept). Computed once before training for the pairs a run reads, then read by later runs from the same reference and by resumed runs; a file for another dataset content, reference or seq_length is refused by name. Empty (default): beside the dataset, PREFIX_reference_<digest>.logps, one per reference and seq_length.", TS_FIELD(training.dpo_reference_logps)));
  k.push_back(bool_key("dpo_precompute_ref_log_probs", "training", "DPO (TRL's precompute_ref_log_probs): true, the reference's log-probabilities are computed once and kept (dpo_reference_logps); false, a frozen copy of the reference weights (the starting weights or reference_load's, in the compute dtype, split as the optimizer splits the policy's: whole under plain data parallelism, its shard under ZeRO-1 and FSDP, its tensor-parallel part, its pipeline stage's layers) stays on the device and computes them for each step's pairs, about one more forward per answer (it resumes only with reference_load: use the default to resume). The memory planner counts the copy (twice where the optimizer keeps no fp32 master copy (fp32 weights of an unsharded run, bf16 main parameters), the policy's kept beside it).", TS_FIELD(training.dpo_precompute_ref_log_probs)));
  k.push_back(bool_key("dpo_shared_prompt", "training", "DPO: each pair in one sequence with its prompt once, so the projections, norms and MLPs of the prompt's tokens run once for both answers; attention still runs over each answer with the prompt apart, as two sequences of seq_length would, and the log-probabilities are those of the sides run apart (within rounding). The sequence is the longest pair so laid out (every pair is read once at the start for it), rounded up to a multiple of 16 (128 with fp8_recipe blockwise); tokens/s and TFLOP/s still count both sides' seq_length tokens. Not under context parallelism or with multi-head latent attention (each side its own sequence there, as with false; the log says which).", TS_FIELD(training.dpo_shared_prompt)));
  k.push_back(float_key("dpo_rpo_alpha", "training", "RPO (TRL's rpo_alpha): adds alpha times the chosen answers' mean token loss to the DPO loss; 0: off.", TS_FIELD(training.dpo_rpo_alpha)));
  k.push_back(int_key("grpo_num_generations", "training", "GRPO (TRL's num_generations): completions sampled per prompt, a group whose rewards set each other's advantages; global_batch_size must be a multiple.", TS_FIELD(training.grpo_num_generations)));
  k.push_back(int_key("grpo_max_completion_length", "training", "GRPO (TRL's max_completion_length): new tokens per completion at most; a completion that reaches it without its end token is clipped (completions/clipped_ratio). The longest prompt plus this must fit seq_length.", TS_FIELD(training.grpo_max_completion_length)));
  k.push_back(bool_key("grpo_offload_optimizer_state", "training", "GRPO, colocated (verl's optimizer_offload): while a batch generates, the AdamW moments move to host memory and the KV cache takes their place on the device; they come back before the training passes (time/optimizer_offload_s). The cache must fit in the moments' bytes (checked at start); the memory plan then counts no KV cache of its own.", TS_FIELD(training.grpo_offload_optimizer_state)));
  k.push_back(int_key("grpo_generation_gpus", "training", "GRPO placement: 0 (default) colocated, every rank generates with the weights it trains in place; N > 0 split (the workflow's generation GPU(s) beside training GPUs, NeMo-RL's non-colocated generation): the last N ranks of the job only generate, with a copy of the weights that the first training rank broadcasts to them before each generation batch and each evaluation (time/weight_sync_s), and the other ranks train (data parallelism and ZeRO-1 over them); each training rank's completions are decoded on generation rank (its rank mod N), all of them together. Not with lora_rank or grpo_offload_optimizer_state.", TS_FIELD(training.grpo_generation_gpus)));
  k.push_back(bool_key("grpo_async_generation", "training", "GRPO with grpo_generation_gpus (NeMo-RL's async GRPO with a trajectory age of one step, verl's one-step off-policy): the next generation batch is decoded from the weights as they are when this one starts training, while it trains, so generation and training overlap; each batch is then one batch off-policy, and its old-policy log-probabilities are the generator's as it sampled. false (default): on-policy, generation and training take turns.", TS_FIELD(training.grpo_async_generation)));
  k.push_back(int_key("grpo_max_num_seqs", "training", "GRPO (vLLM's max_num_seqs): completions a rank decodes at once, with continuous batching (a completion that ends gives its place to the next waiting one); the KV cache holds this many sequences of seq_length positions, which the memory planner counts. 0 (default): all of the rank's completions of a generation batch (global_batch_size / data-parallel size), and as many held-out prompts.", TS_FIELD(training.grpo_max_num_seqs)));
  k.push_back(float_key("grpo_temperature", "training", "GRPO: the sampling temperature of the completions (positive). The policy's log-probabilities are the model's own (temperature 1), as the loss and KL use them.", TS_FIELD(training.grpo_temperature)));
  k.push_back(int_key("grpo_top_k", "training", "GRPO: sample among the top_k most likely tokens; 0: all.", TS_FIELD(training.grpo_top_k)));
  k.push_back(float_key("grpo_top_p", "training", "GRPO: nucleus sampling's probability mass, in (0, 1]; 1: all tokens.", TS_FIELD(training.grpo_top_p)));
  k.push_back(float_key("grpo_min_p", "training", "GRPO: min-p sampling, tokens at least min_p times as likely as the most likely one, in [0, 1]; 0: all.", TS_FIELD(training.grpo_min_p)));
  k.push_back(float_key("grpo_epsilon", "training", "GRPO (TRL's epsilon): the probability ratio's lower clip, 1 - epsilon, in [0, 1).", TS_FIELD(training.grpo_epsilon)));
  k.push_back(float_key("grpo_epsilon_high", "training", "GRPO (TRL's epsilon_high): the ratio's upper clip, 1 + epsilon_high; DAPO's clip-higher uses 0.28.", TS_FIELD(training.grpo_epsilon_high)));
  k.push_back(float_key("grpo_beta", "training", "GRPO (TRL's beta): the weight of the k3 estimate of the KL divergence to the reference (the starting weights, a frozen copy on the device); 0: no KL term and no reference.", TS_FIELD(training.grpo_beta)));
  k.push_back(choice_key<GrpoLossType>("grpo_loss_type", "training", "GRPO's normalisation (TRL's loss_type): grpo, each completion's mean token loss averaged over the completions; bnpo, the mean over every completion token of the batch (DAPO's token-level loss); dr_grpo, the sum over completions x grpo_max_completion_length (Dr. GRPO).", {{"grpo", GrpoLossType::Grpo}, {"bnpo", GrpoLossType::Bnpo}, {"dr_grpo", GrpoLossType::DrGrpo}}, TS_FIELD(training.grpo_loss_type)));
  k.push_back(bool_key("grpo_scale_rewards", "training", "GRPO (TRL's scale_rewards): advantages are the reward minus its group's mean divided by the group's standard deviation; false, not divided (Dr. GRPO).", TS_FIELD(training.grpo_scale_rewards)));
  k.push_back(int_key("grpo_num_iterations", "training", "GRPO (TRL's num_iterations, the paper's mu): optimizer steps (iterations) on each generation batch; after the first the old policy's log-probabilities, kept from it, set the clipped ratio.", TS_FIELD(training.grpo_num_iterations)));
  k.push_back(bool_key("grpo_dynamic_sampling", "training", "DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage: it teaches nothing) is dropped from the loss and its normalisers; the step trains on the rest (frac_reward_zero_std reports the share).", TS_FIELD(training.grpo_dynamic_sampling)));
  k.push_back(string_key("grpo_stop_strings", "training", "GRPO: strings that end a completion (vLLM's stop, transformers' stop_strings): one string, or a list ([\"\\n\\n\", \"</answer>\"]); the completion keeps the stop string in its tokens and text and is not clipped. Empty (default): completions end at the end token or the length limit.", TS_FIELD(training.grpo_stop_strings)));
  k.back().accepts_list = true;
  k.push_back(string_key("grpo_rewards", "training", "GRPO's rewards, summed with weights: comma-separated name[:weight] (weight 1 if omitted) of answer (1 when the completion's answer, in grpo_answer_format, equals the prompt's answer, else 0), format (1 when grpo_format_regex matches the whole completion), overlong (DAPO's shaping: 0 up to grpo_max_completion_length - grpo_overlong_cache tokens, then down to -1) and command (grpo_reward_command's numbers).", TS_FIELD(training.grpo_rewards)));
  k.push_back(choice_key<AnswerFormat>("grpo_answer_format", "training", "Where the answer reward finds a completion's answer: hash, after the last #### (GSM8K); boxed, inside the last \\boxed{} (math); regex, grpo_answer_regex's first capture group.", {{"hash", AnswerFormat::Hash}, {"boxed", AnswerFormat::Boxed}, {"regex", AnswerFormat::Regex}}, TS_FIELD(training.grpo_answer_format)));
  k.push_back(string_key("grpo_answer_regex", "training", "GRPO: with grpo_answer_format regex, the ECMAScript pattern whose first capture group (or whole match) is the answer.", TS_FIELD(training.grpo_answer_regex)));
  k.push_back(string_key("grpo_format_regex", "training", "GRPO: the format reward's ECMAScript pattern, which the whole completion must match.", TS_FIELD(training.grpo_format_regex)));
  k.push_back(int_key("grpo_overlong_cache", "training", "DAPO's soft over-long buffer for the overlong reward, in tokens below grpo_max_completion_length.", TS_FIELD(training.grpo_overlong_cache)));
  k.push_back(string_key("grpo_reward_command", "training", "GRPO's command reward: a command (run by /bin/sh) that reads one JSON object per line on its input ({\"prompt\", \"completion\", \"answer\"}) and writes one finite number per line; a crash, a bad line, a wrong count or a timeout stops the run with the command named.", TS_FIELD(training.grpo_reward_command)));
  k.push_back(float_key("grpo_reward_timeout", "training", "GRPO: seconds the reward command may take per call before it is killed and the run stops.", TS_FIELD(training.grpo_reward_timeout)));
  k.push_back(int_key("lora_rank", "training", "LoRA: the rank r of adapters W + (lora_alpha / r) B A on the projections lora_target_modules names (peft's r, Megatron-Bridge's dim); the base stays frozen and only the adapters have gradients and optimizer state (docs/finetuning.md). 0: the whole model trains.", TS_FIELD(training.lora_rank)));
  k.push_back(float_key("lora_alpha", "training", "LoRA: the adapters' scale is lora_alpha / lora_rank (peft's lora_alpha, Megatron-Bridge's alpha).", TS_FIELD(training.lora_alpha)));
  k.push_back(float_key("lora_dropout", "training", "LoRA: dropout on the adapters' input (peft's lora_dropout). Accepted at 0.0 only, which is what Tessera does: adapter dropout is not implemented.", TS_FIELD(training.lora_dropout)));
  k.push_back(string_key("lora_target_modules", "training", "LoRA: the projections that get adapters, comma separated: Hugging Face's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, Megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2, or all-linear (every one, peft's name).", TS_FIELD(training.lora_target_modules)));
  k.push_back(int_key("seed", "training", "Seed of initialisation, mock data and data shuffling.", TS_FIELD(training.seed)));
  k.push_back(choice_key<DeviceChoice>("device", "training", "Where to train; auto picks cuda when a GPU is present.", {{"auto", DeviceChoice::Auto}, {"cpu", DeviceChoice::Cpu}, {"cuda", DeviceChoice::Gpu}}, TS_FIELD(training.device)));
  k.push_back(choice_key<Precision>("precision", "training", "Weights/activations dtype: bf16 mixed precision with fp32 master weights, or fp32; auto is bf16 on GPUs, fp32 on the CPU.", {{"auto", Precision::Auto}, {"fp32", Precision::Fp32}, {"bf16", Precision::Bf16}}, TS_FIELD(training.precision)));
  k.push_back(choice_key<RecomputeGranularity>("recompute_granularity", "training", "Activation recompute: full re-runs whole layers in backward; selective re-runs norms and SwiGLU only.", {{"null", RecomputeGranularity::None}, {"full", RecomputeGranularity::Full}, {"selective", RecomputeGranularity::Selective}}, TS_FIELD(training.recompute_granularity)));
  k.push_back(choice_key<RecomputeMethod>("recompute_method", "training", "With full recompute, Megatron's methods: uniform stores the input of each group of recompute_num_layers consecutive layers and re-runs the group in backward; block re-runs the first recompute_num_layers layers of each pipeline stage (its model chunks) one by one and keeps the other layers' activations. null: every layer recomputed on its own, or with recompute_num_layers set, block.", {{"null", RecomputeMethod::None}, {"uniform", RecomputeMethod::Uniform}, {"block", RecomputeMethod::Block}}, TS_FIELD(training.recompute_method)));
  k.push_back(optional_count_key("recompute_num_layers", "training", "With full recompute: layers per group (uniform), or layers recomputed per pipeline stage (block; 0 recomputes none, a number above the stage's layers all of them); without recompute_method, null (0) recomputes every layer and N the first N (block). Set without recompute_granularity, it means recompute_granularity full with the block method, as Primus's configs pair them.", TS_FIELD(training.recompute_num_layers)));
  k.push_back(int_key("max_consecutive_nan_iters", "training", "Stop after this many iterations in a row with a non-finite loss or gradient (each is skipped).", TS_FIELD(training.max_consecutive_nan_iters)));
  k.push_back(int_key("cross_entropy_chunk_tokens", "training", "Tokens per chunk of the fused output-head + cross-entropy; bounds the logits memory to chunk x vocab. One chunk per 8192-token micro batch: two halves cost Qwen 2.5's head ~2% of the step for 1.2 GiB saved (docs/performance.md).", TS_FIELD(training.cross_entropy_chunk_tokens)));
  k.push_back(bool_key("gemm_autotune", "training", "On GPUs, time cuBLASLt's candidate algorithms (up to 32 from its heuristic) once per GEMM shape at first use and keep the fastest for the process. Runs in one process repeat bit for bit; separate processes may time differently, pick algorithms that round differently and differ in the last bits. false: the heuristic's first choice, the same in every process (bitwise-repeatable runs across processes).", TS_FIELD(training.gemm_autotune)));
  k.push_back(bool_key("deterministic_mode", "training", "Megatron's deterministic mode: the attention backward on GPUs takes its bit-reproducible algorithm instead of the faster one that adds dQ in an order varying run to run (Tessera's kernels compute dQ by a pass of their own, 7 instead of 5 tile GEMMs; cuDNN its deterministic algorithm). At seq 8192 on an H200 cuDNN's is 17% slower, Tessera's half the speed of its default (docs/performance.md). GEMM algorithms across processes: gemm_autotune false.", TS_FIELD(training.deterministic_mode)));
  k.push_back(choice_key<AttentionBackend>("attention_backend", "training", "Fused attention on GPUs: tessera (own kernels, FlashAttention-3-style warpgroup kernels on Hopper at head_dim 128; their backward adds dQ in fp32 in an order that varies run to run, as cuDNN's does, unless deterministic_mode), cudnn (cuDNN fused SDPA; an error where cuDNN cannot run the shape), or auto (tessera's warpgroup kernels where they run, bf16 at head_dim 128 on Hopper, except the deterministic backward; elsewhere cuDNN where it loads and builds a plan for the shape, else tessera). Megatron's names are accepted: flash (a FlashAttention-style kernel: tessera) and fused (Transformer Engine's fused attention, cuDNN's: cudnn); its unfused and local backends are not implemented.", {{"auto", AttentionBackend::Auto}, {"tessera", AttentionBackend::Tessera}, {"cudnn", AttentionBackend::Vendor}, {"flash", AttentionBackend::Tessera}, {"fused", AttentionBackend::Vendor}}, TS_FIELD(training.attention_backend)));
  k.push_back(choice_key<Fp8Mode>(
      "fp8", "training",
      "FP8 linear layers (GPU, with bf16): hybrid = E4M3 activations and weights, E5M2 gradients; "
      "e4m3 = E4M3 everywhere; null = bf16 GEMMs. Attention stays bf16 unless "
      "fp8_dot_product_attention.",
      {{"null", Fp8Mode::Off}, {"hybrid", Fp8Mode::Hybrid}, {"e4m3", Fp8Mode::E4M3}},
      TS_FIELD(training.fp8)));
  k.push_back(choice_key<Fp8Recipe>("fp8_recipe", "training", "FP8 scaling: delayed takes each tensor's scale from its amax history; tensorwise (current scaling) from the tensor's own amax at every cast; blockwise (DeepSeek-V3's) one power-of-two scale per 1x128 tile of activations and gradients and per 128x128 block of weights, through cuBLASLt's block-scaled GEMMs (Hopper, cuBLASLt 12.9 or newer, every FP8 dimension a multiple of 128).", {{"delayed", Fp8Recipe::Delayed}, {"tensorwise", Fp8Recipe::Tensorwise}, {"blockwise", Fp8Recipe::Blockwise}}, TS_FIELD(training.fp8_recipe)));
  k.push_back(int_key("fp8_amax_history_len", "training", "Steps of amax history per tensor (delayed scaling).", TS_FIELD(training.fp8_amax_history_len)));
  k.push_back(choice_key<Fp8AmaxAlgo>("fp8_amax_compute_algo", "training", "Amax used for a delayed scale: the max over the history, or the most recent step's.", {{"max", Fp8AmaxAlgo::Max}, {"most_recent", Fp8AmaxAlgo::MostRecent}}, TS_FIELD(training.fp8_amax_compute_algo)));
  k.push_back(int_key("fp8_margin", "training", "FP8 scale = (fp8 max / amax) / 2^margin.", TS_FIELD(training.fp8_margin)));
  k.push_back(bool_key(
      "fp8_dot_product_attention", "training",
      "Megatron's FP8 attention: the attention forward's two products (scores and probabilities "
      "times values) multiply e4m3 codes at twice the bf16 rate, each 128-token tile of a head "
      "scaled by its own amax; the backward stays bf16 over the bf16 queries, keys and values with "
      "this forward's output and log-sum-exp. Heads of 128 on Hopper GPUs (Tessera's kernels), "
      "with or without fp8 GEMMs; not with multi-latent attention, context parallelism or "
      "attention_backend cudnn (docs/fp8.md).",
      TS_FIELD(training.fp8_dot_product_attention)));
  k.push_back(bool_key("fp8_lm_head", "training", "Run the output head in FP8 too (off: bf16, as Transformer Engine recipes keep it).", TS_FIELD(training.fp8_lm_head)));
  k.push_back(bool_key("fp8_weight_transpose_cache", "training", "Keep each weight's FP8 copy and FP8 transpose from the first use in a step to the next optimizer step (2 bytes per weight); false re-casts at every use (--no_fp8_weight_transpose_cache).", TS_FIELD(training.fp8_weight_transpose_cache)));
  k.push_back(bool_key("fp8_gemm_fprop_split_accumulator", "training", "FP8 forward GEMMs accumulate in full fp32 (true) or with the tensor cores' faster reduced-precision accumulation (false, Transformer Engine's default for the forward).", TS_FIELD(training.fp8_gemm_fprop_split_accumulator)));
  k.push_back(bool_key("fp8_gemm_dgrad_split_accumulator", "training", "FP8 data-gradient GEMMs (dX = dY W) accumulate in full fp32 (true, Transformer Engine's default) or with fast accumulation (false: faster, error growing with K = out_features; 2.5% measured at the output head's K = 128,256, docs/fp8.md).", TS_FIELD(training.fp8_gemm_dgrad_split_accumulator)));
  k.push_back(bool_key("fp8_gemm_wgrad_split_accumulator", "training", "FP8 weight-gradient GEMMs (dW = dY^T X, K = tokens per micro batch) accumulate in full fp32 (true, Transformer Engine's default) or with fast accumulation (false: faster, less accurate).", TS_FIELD(training.fp8_gemm_wgrad_split_accumulator)));
  k.push_back(bool_key("use_distributed_optimizer", "training", "ZeRO-1 (multi-GPU): reduce-scatter gradients and keep the fp32 master weights and AdamW moments sharded over the data-parallel ranks; bf16 parameters are all-gathered after each step.", TS_FIELD(training.use_distributed_optimizer)));
  k.push_back(bool_key("use_torch_fsdp2", "training", "FSDP (ZeRO-3, multi-GPU; the name is Primus's): bf16 parameters, fp32 gradients, master weights and AdamW moments all sharded over the data-parallel ranks; each unit (embedding, decoder layer, head) is all-gathered just before use while the next is prefetched, and its gradients are reduce-scattered during the backward. Not with use_distributed_optimizer.", TS_FIELD(training.use_torch_fsdp2)));
  k.push_back(int_key("tensor_model_parallel_size", "training", "Tensor parallelism: ranks that split every layer's attention heads, MLP width and the vocabulary (Megatron's column- and row-parallel linears), neighbours in the rank order; a divisor of num_attention_heads and num_query_groups.", TS_FIELD(training.tensor_model_parallel_size)));
  k.push_back(bool_key("sequence_parallel", "training", "With tensor parallelism: residual states and norms hold 1/tensor_model_parallel_size of the tokens on each rank, all-gathered before each block's column-parallel linears and reduce-scattered after its row-parallel ones (instead of all-reduces). No effect without tensor parallelism.", TS_FIELD(training.sequence_parallel)));
  k.push_back(int_key("pipeline_model_parallel_size", "training", "Pipeline parallelism: stages that each hold consecutive layers (the first also the embedding, the last the final norm and output head), run with the 1F1B schedule over the micro-batches.", TS_FIELD(training.pipeline_model_parallel_size)));
  k.push_back(optional_count_key("virtual_pipeline_model_parallel_size", "training", "Interleaved 1F1B: model chunks per pipeline rank (layers are dealt out chunk by chunk over the ranks); null (0) is none: plain 1F1B. Needs micro-batches per step a multiple of pipeline_model_parallel_size.", TS_FIELD(training.virtual_pipeline_model_parallel_size)));
  k.push_back(optional_count_key("num_layers_per_virtual_pipeline_stage", "training", "Interleaved 1F1B given by layers per model chunk instead: virtual_pipeline_model_parallel_size = num_layers / pipeline_model_parallel_size / this; null (0) is none.", TS_FIELD(training.num_layers_per_virtual_pipeline_stage)));
  k.push_back(optional_count_key("decoder_first_pipeline_num_layers", "training", "Uneven pipeline: layers of the first stage (which also holds the embedding); the stages without a set count share the rest evenly; null (0) is an even share.", TS_FIELD(training.decoder_first_pipeline_num_layers)));
  k.push_back(optional_count_key("decoder_last_pipeline_num_layers", "training", "Uneven pipeline: layers of the last stage (which also holds the final norm, output head and loss); null (0) is an even share.", TS_FIELD(training.decoder_last_pipeline_num_layers)));
  k.push_back(int_key("context_parallel_size", "training", "Context parallelism: ranks that split each sequence (Megatron's causal load balancing, 2 x context_parallel_size chunks) and exchange keys and values in attention.", TS_FIELD(training.context_parallel_size)));
  k.push_back(bool_key("overlap_param_gather", "training", "ZeRO-1: all-gather the updated parameters on a communication stream, lowest offsets first, while the next forward runs; each layer waits only for the buckets it reads. Off: gathered before the next forward starts. No effect without use_distributed_optimizer: FSDP always overlaps its gathers, plain data parallelism has none (Megatron refuses it there; the shipped experiments set it for the distributed optimizer they turn on).", TS_FIELD(training.overlap_param_gather)));
  k.push_back(bool_key("overlap_grad_reduce", "training", "Multi-GPU: reduce each gradient bucket on a communication stream as soon as the last micro-batch's backward has finished it, overlapping the backward of earlier layers.", TS_FIELD(training.overlap_grad_reduce)));
  k.push_back(int_key("ddp_bucket_size", "training", "Multi-GPU: elements per gradient bucket (one all-reduce or reduce-scatter each).", TS_FIELD(training.ddp_bucket_size)));
  k.push_back(bool_key("use_precision_aware_optimizer", "training", "Megatron's precision-aware optimizer: lets main_grads_dtype, main_params_dtype, exp_avg_dtype and exp_avg_sq_dtype be bf16 (the AdamW arithmetic stays fp32). As in Megatron, only with use_distributed_optimizer (or use_torch_fsdp2); on one GPU that is a no-op.", TS_FIELD(training.use_precision_aware_optimizer)));
  k.push_back(choice_key<DType>("main_grads_dtype", "training", "Gradient buffer dtype: bf16 accumulates the micro-batches' gradients and reduces them over data-parallel ranks in bf16 (each GEMM still sums in fp32), half the memory of fp32. bf16 needs use_precision_aware_optimizer.", {{"fp32", DType::F32}, {"bf16", DType::BF16}}, TS_FIELD(training.main_grads_dtype)));
  k.push_back(bool_key("grad_reduce_in_bf16", "training", "Megatron's --grad-reduce-in-bf16: the gradient buffer is bf16, so the micro-batches' gradients accumulate and are reduced over data-parallel ranks in bf16, as with main_grads_dtype bf16 but without the precision-aware optimizer (Megatron's DDP option).", TS_FIELD(training.grad_reduce_in_bf16)));
  k.push_back(choice_key<DType>("main_params_dtype", "training", "Master weights: fp32 keeps an fp32 copy the update is applied to; bf16 keeps none and updates the bf16 parameters in place (fp32 arithmetic, rounded to nearest even; 2 bytes per parameter less than the default fp32 master kept as its low halves, store_param_remainders, and 4 less than a whole fp32 copy). bf16 needs use_precision_aware_optimizer and bf16 parameters (precision bf16, or auto on a GPU).", {{"fp32", DType::F32}, {"bf16", DType::BF16}}, TS_FIELD(training.main_params_dtype)));
  k.push_back(bool_key("store_param_remainders", "training", "Megatron's store_param_remainders: an fp32 master copy beside bf16 parameters keeps only the 16 bits the bf16 parameters lack, the parameters being its high halves (rounded to nearest, ties away from zero), so the master holds every fp32 value exactly in 2 bytes a parameter instead of 4. The update's arithmetic and the master's values are those of a whole fp32 copy; the parameters differ from a round-to-nearest-even copy only where an fp32 value lies exactly halfway between two bf16 values (by one bf16 step). Unlike Megatron, Tessera applies it with or without use_precision_aware_optimizer. Checkpoints hold the fp32 values either way. false: a whole fp32 copy.", TS_FIELD(training.store_param_remainders)));
  k.push_back(choice_key<DType>("exp_avg_dtype", "training", "AdamW first moment storage: bf16 is read into fp32, updated there and rounded back (2 bytes per parameter less). bf16 needs use_precision_aware_optimizer.", {{"fp32", DType::F32}, {"bf16", DType::BF16}}, TS_FIELD(training.exp_avg_dtype)));
  k.push_back(choice_key<DType>("exp_avg_sq_dtype", "training", "AdamW second moment storage, as exp_avg_dtype. bf16 needs use_precision_aware_optimizer.", {{"fp32", DType::F32}, {"bf16", DType::BF16}}, TS_FIELD(training.exp_avg_sq_dtype)));
  k.push_back(float_key("dist_timeout_minutes", "training", "Multi-GPU: how long the rendezvous waits for every rank and a collective may take before the job is aborted, naming the late or dead rank (fractions allowed).", TS_FIELD(training.dist_timeout_minutes)));
  k.push_back(int_key("expert_model_parallel_size", "training", "Ranks the experts of each MoE layer are spread over (expert parallelism, docs/distributed.md): tokens travel to their experts' ranks by all-to-all; each rank holds only its experts' weights, gradients and optimizer state. Divides num_experts and the data-parallel ranks (of each tensor-parallel part and pipeline stage); not with use_torch_fsdp2 or context parallelism.", TS_FIELD(training.expert_model_parallel_size)));
  k.push_back(bool_key("moe_force_balance", "training", "Benchmark mode: route tokens round-robin over the experts (exactly balanced) instead of by the router's choice; the routing weights still come from the router. Published MoE throughputs are force-balanced; compare like with like.", TS_FIELD(training.moe_force_balance)));
  // ---- data ----
  k.push_back(bool_key("mock_data", "data", "Train on random tokens (for speed runs), as Primus's mock_data.", TS_FIELD(data.mock_data)));
  k.push_back(string_key("data_path", "data", "Megatron indexed-data blend split into train/valid/test by `split`: \"prefix\" or \"w1 prefix1 w2 prefix2 ...\" (prefix = path without .bin/.idx).", TS_FIELD(data.data_path)));
  k.push_back(string_key("train_data_path", "data", "Training data: a Megatron blend like data_path (used whole), or a directory/file of plain or Brown-corpus-tagged text (split by `split`).", TS_FIELD(data.train_data_path)));
  k.push_back(string_key("valid_data_path", "data", "Validation blend, used instead of the split's validation part.", TS_FIELD(data.valid_data_path)));
  // Megatron takes blends as several words (--data-path 0.7 A 0.3 B).
  for (size_t i = k.size() - 3; i < k.size(); ++i) k[i].words_joined_by = " ";
  k.push_back(string_key("data_cache_path", "data", "Directory for cached sample indices; empty puts them beside the data.", TS_FIELD(data.data_cache_path)));
  k.push_back(string_key("split", "data", "Train/valid/test proportions over documents, e.g. \"969,30,1\".", TS_FIELD(data.split)));
  k.push_back(bool_key("eod_mask_loss", "data", "Megatron's: no loss at positions whose input token is the end-of-document token (predicting a document's first token from the previous one's end). Losses are averaged over the positions that count.", TS_FIELD(data.eod_mask_loss)));
  k.push_back(bool_key("reset_position_ids", "data", "Megatron's: token positions (the rotary embedding's) restart at 0 at each document of a sample: after an end-of-document token, and where the dataset's documents meet (chat data has no end-of-document tokens).", TS_FIELD(data.reset_position_ids)));
  k.push_back(bool_key("reset_attention_mask", "data", "Megatron's: a token attends only to the earlier tokens of its own document within the sample (documents as reset_position_ids finds them), so packed documents do not see each other. On GPUs it runs on Tessera's attention kernels with document starts (docs/finetuning.md); cuDNN is not used for it.", TS_FIELD(data.reset_attention_mask)));
  k.push_back(choice_key<PackingStrategy>("packing_strategy", "data", "How indexed documents become samples: wrapped cuts their concatenation into windows of seq_length+1 (Megatron's GPT dataset, TRL's wrapped packing: a document may start in one sample and end in the next); bfd keeps every document whole, packing them best-fit decreasing into sequences of seq_length padded at the end (TRL's bfd; for fine-tuning: with reset_position_ids and reset_attention_mask the documents do not see each other). The log gives the packing efficiency.", {{"wrapped", PackingStrategy::Wrapped}, {"bfd", PackingStrategy::Bfd}}, TS_FIELD(data.packing_strategy)));
  k.push_back(choice_key<LossMask>("loss_mask", "data", "Chat data (preprocess --chat): which tokens the loss covers: assistant (every assistant turn with its closing token: TRL's assistant_only_loss, Megatron-Bridge's answer_only_loss), completion (the final assistant turn only) or all. Datasets without roles train on every token. Losses are averaged over the tokens that count.", {{"assistant", LossMask::Assistant}, {"completion", LossMask::Completion}, {"all", LossMask::All}}, TS_FIELD(data.loss_mask)));
  k.push_back(choice_key<TokenizerType>("tokenizer_type", "data", "Tokenizer: ByteLevel maps each UTF-8 byte to a token (256) plus end-of-document; HuggingFaceTokenizer reads tokenizer_model (Primus's Llama2Tokenizer, Llama3Tokenizer, MixtralTokenizer, DeepSeekV2Tokenizer, DeepSeekV3Tokenizer and Qwen2Tokenizer are Hugging Face tokenizers too, read the same way); NullTokenizer (Megatron's) takes whitespace-separated ids as text, vocab_size of them plus an end-of-document id; GPT2BPETokenizer reads GPT-2's vocab_file (vocab.json) and merge_file (merges.txt).", {{"ByteLevel", TokenizerType::ByteLevel}, {"HuggingFaceTokenizer", TokenizerType::HuggingFace}, {"NullTokenizer", TokenizerType::Null}, {"GPT2BPETokenizer", TokenizerType::Gpt2Bpe}, {"Llama2Tokenizer", TokenizerType::HuggingFace}, {"Llama3Tokenizer", TokenizerType::HuggingFace}, {"MixtralTokenizer", TokenizerType::HuggingFace}, {"DeepSeekV2Tokenizer", TokenizerType::HuggingFace}, {"DeepSeekV3Tokenizer", TokenizerType::HuggingFace}, {"Qwen2Tokenizer", TokenizerType::HuggingFace}}, TS_FIELD(data.tokenizer_type)));
  k.push_back(string_key("tokenizer_model", "data", "A Hugging Face tokenizer.json path (or a directory holding one), a shipped name (llama2, llama3, llama3.1, qwen3), or the Hugging Face hub name of one of them as Primus writes it (meta-llama/Llama-3.1-8B, ...).", TS_FIELD(data.tokenizer_model)));
  k.push_back(string_key("vocab_file", "data", "GPT2BPETokenizer: GPT-2's vocab.json (token -> id).", TS_FIELD(data.vocab_file)));
  k.push_back(string_key("merge_file", "data", "GPT2BPETokenizer: GPT-2's merges.txt (the BPE merges in rank order).", TS_FIELD(data.merge_file)));
  k.push_back(int_key("eval_interval", "data", "Evaluate the validation loss every this many iterations (and at the end); 0 disables.", TS_FIELD(data.eval_interval)));
  k.push_back(int_key("eval_iters", "data", "Micro-batches of the validation split per evaluation (times the data-parallel size); 0 turns evaluation off (eval_interval 0), as in Megatron.", TS_FIELD(data.eval_iters)));
  k.push_back(float_key("target_loss", "data", "Stop when the validation loss reaches this and report the time to target; 0 disables.", TS_FIELD(data.target_loss)));
  k.push_back(bool_key("skip_train", "data", "Train nothing: evaluate the starting weights (from load, hf_init_path or the initialisation) on eval_iters validation micro-batches, then exit.", TS_FIELD(data.skip_train)));
  // ---- checkpoint ----
  k.push_back(string_key("save", "checkpoint", "Directory to write checkpoints to (every save_interval iterations, at the end, and on SIGTERM).", TS_FIELD(checkpoint.save)));
  k.push_back(string_key("load", "checkpoint", "Checkpoint directory to resume from (its latest complete checkpoint).", TS_FIELD(checkpoint.load)));
  k.push_back(int_key("save_interval", "checkpoint", "Iterations between checkpoints; 0 saves only at the end.", TS_FIELD(checkpoint.save_interval)));
  k.push_back(int_key("ckpt_keep_last", "checkpoint", "Checkpoints kept in `save` (older ones are deleted); 0 keeps all.", TS_FIELD(checkpoint.ckpt_keep_last)));
  k.push_back(bool_key("disable_last_saving", "checkpoint", "Primus's: no checkpoint at the end of the run (only every save_interval iterations, at an early exit and on SIGTERM); the log says which iteration the last one holds.", TS_FIELD(checkpoint.disable_last_saving)));
  k.push_back(string_key("hf_init_path", "checkpoint", "Hugging Face model directory (config.json + *.safetensors) whose weights initialise the model.", TS_FIELD(checkpoint.hf_init_path)));
  k.push_back(string_key("reference_load", "checkpoint", "DPO's and GRPO's reference (TRL's ref_model): a checkpoint directory (a save directory: its latest checkpoint) of the same model whose weights are the reference, in place of the starting weights: the frozen copy (dpo_precompute_ref_log_probs false, GRPO with grpo_beta) holds them, and the precomputed log-probabilities are theirs (kept under their digest). A run with it resumes with its reference. Needs starting weights of its own (load or hf_init_path); not with LoRA, whose reference is its base.", TS_FIELD(checkpoint.reference_load)));
  k.push_back(string_key("pretrained_checkpoint", "checkpoint", "LoRA's base (Megatron-Bridge's pretrained_checkpoint): a checkpoint directory (save of a pretraining or SFT run) whose latest checkpoint gives the frozen weights; load then resumes the adapters. Without it the base comes from hf_init_path, or the initialisation.", TS_FIELD(checkpoint.pretrained_checkpoint)));
  k.push_back(flag_key("finetune", "checkpoint", "Megatron's --finetune: the checkpoint under load gives the model's weights only; the iteration, the data position, the learning-rate schedule and the optimizer state start from zero (fine-tuning a pretrained model). Save to another directory than load.", TS_FIELD(checkpoint.finetune)));
  k.push_back(flag_key("no_load_optim", "checkpoint", "Megatron's --no-load-optim: resume the weights and counters from load but start the optimizer state (AdamW moments) from zero.", TS_FIELD(checkpoint.no_load_optim)));
  // ---- logging ----
  k.push_back(int_key("log_interval", "logging", "Print the iteration line every this many iterations; its loss (and metrics.jsonl's lm_loss) is the mean over those iterations, as Megatron logs it (skipped iterations left out).", TS_FIELD(logging.log_interval)));
  k.push_back(bool_key("log_progress", "logging", "Show a progress bar when stdout is a terminal.", TS_FIELD(logging.log_progress)));
  k.push_back(bool_key("profile", "logging", "Record a Chrome/Perfetto trace (GPU kernels, memory copies, CUDA API calls, op and layer ranges) of iterations [profile_step_start, profile_step_end) to {experiment}/traces/.", TS_FIELD(logging.profile)));
  k.push_back(int_key("profile_step_start", "logging", "First profiled iteration.", TS_FIELD(logging.profile_step_start)));
  k.push_back(int_key("profile_step_end", "logging", "Iteration at which profiling stops (exclusive).", TS_FIELD(logging.profile_step_end)));
  k.push_back(string_key("profile_ranks", "logging", "Ranks that record a trace: comma-separated ids (also Megatron's list, [0,1] or --profile-ranks 0 1), or all.", TS_FIELD(logging.profile_ranks)));
  k.back().words_joined_by = ",";
  k.back().accepts_list = true;
  k.push_back(string_key("tensorboard_dir", "logging", "Write TensorBoard event files (events.out.tfevents.*, rank 0) to this directory; a relative path lies under the experiment directory (tensorboard: Primus's {experiment}/tensorboard); empty: none.", TS_FIELD(logging.tensorboard_dir)));
  k.push_back(int_key("tensorboard_log_interval", "logging", "Write the per-iteration scalars (lm loss, learning-rate, batch-size, grad-norm, memory: that iteration's values) every this many iterations, independently of log_interval, as Megatron.", TS_FIELD(logging.tensorboard_log_interval)));
  k.push_back(bool_key("log_learning_rate_to_tensorboard", "logging", "Write learning-rate (and learning-rate vs samples) to TensorBoard.", TS_FIELD(logging.log_learning_rate_to_tensorboard)));
  k.push_back(bool_key("log_timers_to_tensorboard", "logging", "Write iteration-time (seconds per iteration) and throughput (TFLOP/s/GPU) to TensorBoard every log_interval.", TS_FIELD(logging.log_timers_to_tensorboard)));
  k.push_back(bool_key("log_throughput_to_tensorboard", "logging", "Write throughput/tflops/device, throughput/tflops, throughput/tokens_per_sec/device and throughput/tokens_per_sec to TensorBoard every log_interval.", TS_FIELD(logging.log_throughput_to_tensorboard)));
  k.push_back(bool_key("log_memory_to_tensorboard", "logging", "Write mem-allocated-bytes and mem-max-allocated-bytes (peak since training started) to TensorBoard every tensorboard_log_interval.", TS_FIELD(logging.log_memory_to_tensorboard)));
  k.push_back(bool_key("log_validation_ppl_to_tensorboard", "logging", "Write lm loss validation ppl (exp of the validation loss, capped at e^20) to TensorBoard at each evaluation.", TS_FIELD(logging.log_validation_ppl_to_tensorboard)));
  return k;
}

#undef TS_FIELD

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// At least the edit distance of two words: the difference of their lengths. A word too long
// to be near any key (a key of megabytes in a hostile file) then costs no quadratic distance.
size_t length_gap(std::string_view a, std::string_view b) {
  return a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
}

}  // namespace

std::span<const KeySpec> config_keys() {
  static const std::vector<KeySpec> kKeys = build_keys();
  return kKeys;
}

const KeySpec* find_key(std::string_view name) {
  for (const auto& k : config_keys())
    if (k.name == name) return &k;
  return nullptr;
}

std::string suggest_key(std::string_view unknown) {
  std::string best;
  size_t best_d = std::string::npos;
  const size_t close = std::max<size_t>(2, unknown.size() / 3);
  for (const auto& k : config_keys()) {
    // A key containing the typed word is a good suggestion even when far by edits.
    const bool contains = k.name.find(unknown) != std::string_view::npos && unknown.size() >= 4;
    size_t d = !contains && length_gap(unknown, k.name) > close ? length_gap(unknown, k.name)
                                                                : edit_distance(unknown, k.name);
    if (contains) d = std::min(d, size_t{2});
    if (d < best_d) best_d = d, best = std::string(k.name);
  }
  return best_d <= close ? best : std::string();
}

std::vector<std::string> nearest_names(std::string_view word, std::span<const std::string> names,
                                       size_t limit) {
  const auto lower = [](std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  const std::string w = lower(word);
  const size_t close = std::max<size_t>(2, w.size() / 3);
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& n : names)
    if (length_gap(w, n) <= close)
      if (const size_t d = edit_distance(w, lower(n)); d <= close) scored.emplace_back(d, n);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  // Only the nearest, and those one edit further unless the nearest differs in case alone
  // (llama3.1_8b is llama3.1_8B, not llama3.1_70B or llama3_8B).
  const size_t furthest = scored.empty() || scored[0].first == 0 ? 0 : scored[0].first + 1;
  for (size_t i = 0; i < scored.size() && i < limit && scored[i].first <= furthest; ++i)
    out.push_back(scored[i].second);
  return out;
}

std::string describe_type(const KeySpec& key) {
  switch (key.type) {
    case KeyType::Int: return "an integer";
    case KeyType::Float: return "a finite number";
    case KeyType::Bool: return "true or false";
    case KeyType::String: return "a string";
    case KeyType::Choice: {
      std::string s = "one of: ";
      for (size_t i = 0; i < key.choices.size(); ++i) s += (i ? ", " : "") + std::string(key.choices[i]);
      return s;
    }
  }
  return "?";
}

namespace {

// An experiment with `text` set as the value of `key` by the key's own parser.
Experiment with_key_value(std::string_view key, std::string_view text) {
  Experiment e;
  const std::string expected = find_key(key)->set(e, std::string(text));
  if (!expected.empty())
    throw ConfigError("command line", std::string(key), std::string(text), expected);
  return e;
}

}  // namespace

DeviceChoice parse_device_choice(std::string_view text) {
  return with_key_value("device", text).training.device;
}

AttentionBackend parse_attention_backend(std::string_view text) {
  return with_key_value("attention_backend", text).training.attention_backend;
}

}  // namespace tessera
