#include "tessera/config/validate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include "tessera/config/blend.h"
#include "tessera/config/keys.h"
#include "tessera/config/moe_layer_freq.h"
#include "tessera/config/profile_ranks.h"
#include "tessera/config/lora_targets.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/core/data_root.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

class Checker {
 public:
  explicit Checker(const Experiment& e) : e_(e) {}
  const Experiment& experiment() const { return e_; }

  // Fails with `key`'s origin and current value when `ok` is false.
  void require(bool ok, const char* key, const std::string& expected) const {
    if (!ok) fail(key, expected);
  }

  [[noreturn]] void fail(const char* key, const std::string& expected) const {
    const KeySpec* spec = find_key(key);
    throw ConfigError(origin(key), key, spec ? spec->get(e_) : "?", expected);
  }

  // The file and line, or command line, that set `key`.
  std::string origin(const std::string& key) const {
    const auto it = e_.origin.find(key);
    return it == e_.origin.end() ? std::string("default") : it->second;
  }

  // `key`'s value and where it came from, e.g. "20, set at default.yaml:31".
  std::string value_and_origin(const char* key) const {
    const std::string o = origin(key);
    return find_key(key)->get(e_) + (o == "default"        ? ", the default"
                                     : o == "command line" ? ", set on the command line"
                                                           : ", set at " + o);
  }

 private:
  const Experiment& e_;
};

void check_experiment_names(const Checker& c, const Experiment& e) {
  for (const char* key : {"work_group", "user_name", "exp_name"}) {
    const std::string v = find_key(key)->get(e);
    c.require(v != "null" && v.find('/') == std::string::npos && v != "." && v != "..", key,
              "a non-empty name without '/'");
  }
  c.require(!e.workspace.empty(), "workspace", "a directory path");
}

// Width of the query, key and value heads of a model without multi-latent attention.
int64_t attention_head_dim(const ModelConfig& m) {
  return m.kv_channels ? m.kv_channels : m.hidden_size / m.num_attention_heads;
}

void check_model(const Checker& c, const ModelConfig& m) {
  c.require(m.num_layers >= 1, "num_layers", "at least 1");
  c.require(m.hidden_size >= 1, "hidden_size", "at least 1");
  c.require(m.num_attention_heads >= 1, "num_attention_heads", "at least 1");
  c.require(m.num_query_groups >= 0, "num_query_groups", "0 (one per head) or a positive count");
  const int64_t groups = m.num_query_groups ? m.num_query_groups : m.num_attention_heads;
  c.require(m.num_attention_heads % groups == 0, "num_query_groups",
            fmt::format("a divisor of num_attention_heads ({})", m.num_attention_heads));
  c.require(m.kv_channels >= 0, "kv_channels", "0 (derived) or a positive head dimension");
  // Multi-latent attention sizes its heads with its own keys (check_mla); kv_channels is unused.
  if (m.kv_channels == 0 && !m.multi_latent_attention)
    c.require(
        m.hidden_size % m.num_attention_heads == 0, "num_attention_heads",
        fmt::format("a divisor of hidden_size ({}) unless kv_channels is set", m.hidden_size));
  const int64_t head_dim = attention_head_dim(m);
  if (!m.multi_latent_attention)
    c.require(head_dim % 2 == 0, m.kv_channels ? "kv_channels" : "hidden_size",
              fmt::format("an even head dimension for rotary embeddings (got {})", head_dim));
  c.require(m.ffn_hidden_size >= 0, "ffn_hidden_size", "0 (derived) or a positive width");
  c.require(m.max_position_embeddings >= 1, "max_position_embeddings", "at least 1");
  c.require(m.vocab_size >= 0, "vocab_size", "0 (from the tokenizer) or a positive size");
  c.require(m.make_vocab_size_divisible_by >= 1, "make_vocab_size_divisible_by", "at least 1");
  c.require(m.rotary_base > 1.0, "rotary_base", "a base frequency greater than 1");
  c.require(m.norm_epsilon > 0, "norm_epsilon", "a positive number");
  c.require(m.sliding_window >= 0, "sliding_window", "0 (full attention) or a positive window");
  c.require(m.init_method_std > 0, "init_method_std", "a positive standard deviation");
  if (m.use_rope_scaling) {
    c.require(m.rope_scaling_factor >= 1, "rope_scaling_factor", "at least 1");
    c.require(m.rope_high_freq_factor > m.rope_low_freq_factor, "rope_high_freq_factor",
              "greater than rope_low_freq_factor");
    c.require(m.rope_original_max_position_embeddings >= 1, "rope_original_max_position_embeddings",
              "at least 1");
  }
}

// Multi-latent attention (DeepSeek) and its YaRN RoPE: Megatron's MLA keys, and the layouts
// Tessera's MLA block does not run yet. Nothing is checked for other attention unless it asks
// for YaRN.
void check_mla(const Checker& c, const ModelConfig& m, const TrainingConfig& t) {
  const bool mla = m.multi_latent_attention;
  if (m.rope_type == RopeType::Yarn)
    c.require(mla, "rope_type",
              "rope or null without multi_latent_attention (DeepSeek's YaRN, with its softmax "
              "scaling, belongs to multi-latent attention)");
  if (mla && m.rope_type != RopeType::Rope) {  // yarn, Megatron's default for MLA
    c.require(m.rotary_scaling_factor >= 1, "rotary_scaling_factor",
              "at least 1 (1 leaves the frequencies unscaled)");
    c.require(m.original_max_position_embeddings >= 1, "original_max_position_embeddings",
              "at least 1");
    c.require(m.beta_slow > 0, "beta_slow", "a positive number of rotations");
    c.require(m.beta_fast > m.beta_slow, "beta_fast",
              fmt::format("greater than beta_slow ({}): the band of interpolated frequencies "
                          "runs from beta_fast down to beta_slow rotations",
                          m.beta_slow));
    c.require(m.mscale >= 0, "mscale", "a non-negative number");
    c.require(m.mscale_all_dim >= 0, "mscale_all_dim", "a non-negative number");
  }
  if (!mla) return;
  c.require(m.kv_lora_rank >= 1, "kv_lora_rank",
            "a positive width with multi_latent_attention: keys and values come from a latent "
            "of this width (DeepSeek: 512)");
  c.require(m.q_lora_rank >= 0, "q_lora_rank",
            "null (queries projected directly from the hidden state) or a positive width");
  c.require(m.qk_head_dim >= 1, "qk_head_dim", "a positive per-head dimension");
  c.require(m.v_head_dim >= 1, "v_head_dim", "a positive per-head dimension");
  c.require(m.qk_pos_emb_head_dim >= 2 && m.qk_pos_emb_head_dim % 2 == 0, "qk_pos_emb_head_dim",
            "a positive even dimension (RoPE rotates pairs of elements)");
  c.require(m.num_query_groups == 0 || m.num_query_groups == m.num_attention_heads,
            "num_query_groups",
            fmt::format("0 or num_attention_heads ({}) with multi_latent_attention: every head has "
                        "its own key and value, up-projected from the shared latent",
                        m.num_attention_heads));
  c.require(!m.use_rope_scaling, "use_rope_scaling",
            "false with multi_latent_attention (its RoPE scaling is rope_type yarn)");
  c.require(!m.add_qkv_bias, "add_qkv_bias",
            "false with multi_latent_attention (its projections have no bias)");
  c.require(!m.qk_layernorm, "qk_layernorm",
            "false with multi_latent_attention (its latents are normalised instead)");
  // The MLA block declares no tensor-parallel split and no context-parallel exchange of its
  // keys and values, and has not been laid out over pipeline stages.
  c.require(t.context_parallel_size == 1, "context_parallel_size",
            "1 with multi_latent_attention: its keys and values are not exchanged between "
            "context-parallel ranks yet");
  c.require(t.tensor_model_parallel_size == 1, "tensor_model_parallel_size",
            "1 with multi_latent_attention: its projections are not split over tensor-parallel "
            "ranks yet (use expert_model_parallel_size and data parallelism)");
  c.require(t.pipeline_model_parallel_size == 1, "pipeline_model_parallel_size",
            "1 with multi_latent_attention: its layers are not laid out over pipeline stages yet");
}

// Mixture of experts: Megatron's rules for its MoE keys (TransformerConfig's checks), plus
// what Tessera does not run (token dropping). Nothing is checked for a dense model.
void check_moe(const Checker& c, const ModelConfig& m, const TrainingConfig& t,
               int data_parallel_size) {
  c.require(m.num_experts >= 0, "num_experts", "0 (a dense model) or a positive count");
  c.require(t.expert_model_parallel_size >= 1, "expert_model_parallel_size", "at least 1");
  if (m.num_experts == 0) {
    c.require(t.expert_model_parallel_size == 1, "expert_model_parallel_size",
              "1 for a dense model (num_experts is 0)");
    return;
  }
  // MoE layers are laid out over data-, expert- and tensor-parallel ranks and pipeline stages:
  // under tensor parallelism the shared expert is split like a dense MLP while every
  // tensor-parallel rank runs the router and the routed experts on the whole micro-batch (no
  // expert tensor parallelism), so its input must be whole on each rank (no sequence
  // parallelism); the sequence-level losses see whole sequences (no context parallelism).
  const int64_t cp = t.context_parallel_size;
  if (cp > 1) {
    c.require(t.expert_model_parallel_size == 1, "expert_model_parallel_size",
              fmt::format("1 with context_parallel_size ({}) above 1: expert parallelism does "
                          "not compose with context parallelism yet",
                          cp));
    c.fail("context_parallel_size",
           fmt::format("1 for a mixture-of-experts model (num_experts {}): MoE layers are not "
                       "split over context-parallel ranks yet (use expert_model_parallel_size, "
                       "tensor, pipeline and data parallelism)",
                       m.num_experts));
  }
  c.require(t.tensor_model_parallel_size == 1 || !t.sequence_parallel, "sequence_parallel",
            fmt::format("false for a mixture-of-experts model with tensor_model_parallel_size "
                        "{}: each tensor-parallel rank runs the routed experts on the whole "
                        "micro-batch, which sequence parallelism would split",
                        t.tensor_model_parallel_size));
  c.require(m.moe_shared_expert_intermediate_size % t.tensor_model_parallel_size == 0,
            "moe_shared_expert_intermediate_size",
            fmt::format("a multiple of tensor_model_parallel_size ({}): the shared expert is "
                        "split over the tensor-parallel ranks like a dense MLP",
                        t.tensor_model_parallel_size));
  const int64_t E = m.num_experts;
  c.require(m.moe_router_topk >= 1 && m.moe_router_topk <= E, "moe_router_topk",
            fmt::format("between 1 and num_experts ({})", E));
  c.require(m.moe_ffn_hidden_size >= 0, "moe_ffn_hidden_size",
            "0 (ffn_hidden_size) or a positive width");
  c.require(m.moe_shared_expert_intermediate_size >= 0, "moe_shared_expert_intermediate_size",
            "0 (no shared expert) or a positive width");
  std::string why;
  c.require(parse_moe_layer_freq(m.moe_layer_freq, m.num_layers, &why).has_value(),
            "moe_layer_freq", why);
  c.require(m.moe_aux_loss_coeff >= 0, "moe_aux_loss_coeff", "a non-negative weight");
  c.require(m.moe_z_loss_coeff >= 0, "moe_z_loss_coeff", "a non-negative weight");
  c.require(m.moe_router_topk_scaling_factor >= 0, "moe_router_topk_scaling_factor",
            "0 (unscaled) or a positive factor");
  c.require(
      !m.moe_router_enable_expert_bias || m.moe_router_score_function == MoeScoreFunction::Sigmoid,
      "moe_router_enable_expert_bias",
      "false unless moe_router_score_function is sigmoid (the aux-loss-free bias is "
      "DeepSeek-V3's, for sigmoid scores)");
  c.require(m.moe_router_bias_update_rate >= 0, "moe_router_bias_update_rate",
            "a non-negative rate");
  c.require(!m.moe_router_pre_softmax || m.moe_router_score_function == MoeScoreFunction::Softmax,
            "moe_router_pre_softmax", "false with moe_router_score_function sigmoid");
  c.require(m.moe_router_num_groups >= 0, "moe_router_num_groups", "0 (off) or a positive count");
  c.require((m.moe_router_num_groups == 0) == (m.moe_router_group_topk == 0),
            m.moe_router_num_groups == 0 ? "moe_router_group_topk" : "moe_router_num_groups",
            "set together with the other of moe_router_num_groups / moe_router_group_topk "
            "(both 0: no group-limited routing)");
  if (m.moe_router_num_groups > 0) {
    const int64_t groups = m.moe_router_num_groups;
    c.require(E % groups == 0, "moe_router_num_groups",
              fmt::format("a divisor of num_experts ({})", E));
    c.require(m.moe_router_group_topk >= 1 && m.moe_router_group_topk <= groups &&
                  m.moe_router_group_topk <= m.moe_router_topk,
              "moe_router_group_topk",
              fmt::format("between 1 and moe_router_num_groups ({}) and at most moe_router_topk "
                          "({}): each chosen group contributes its top topk / group_topk scores",
                          groups, m.moe_router_topk));
    c.require(m.moe_router_topk <= m.moe_router_group_topk * (E / groups), "moe_router_topk",
              fmt::format("at most moe_router_group_topk x experts per group = {} x {}",
                          m.moe_router_group_topk, E / groups));
  }
  // The key's parser takes null (stored negative) or finite numbers >= 0.
  c.require(m.moe_expert_capacity_factor != 0, "moe_expert_capacity_factor",
            "null (dropless) or a positive number");
  c.require(!m.moe_pad_expert_input_to_capacity, "moe_pad_expert_input_to_capacity",
            "false: padding the experts' inputs to their capacity is not implemented");
  const int64_t ep = t.expert_model_parallel_size;
  c.require(E % ep == 0, "expert_model_parallel_size",
            fmt::format("a divisor of num_experts ({}): each expert-parallel rank holds an equal "
                        "share of the experts",
                        E));
  c.require(data_parallel_size % ep == 0, "expert_model_parallel_size",
            fmt::format("a divisor of the data-parallel ranks ({}{}): the experts are spread over "
                        "that many ranks (the shipped MoE experiments spread them over a node's "
                        "8 GPUs, as Primus's do; on fewer, set it to a divisor of the GPUs, 1 on "
                        "one)",
                        data_parallel_size,
                        t.pipeline_model_parallel_size > 1 ? " of each pipeline stage" : ""));
  c.require(ep == 1 || !t.use_torch_fsdp2, "expert_model_parallel_size",
            "1 with use_torch_fsdp2 (expert parallelism composes with plain data parallelism "
            "and use_distributed_optimizer)");
}

// How long the run goes: train_iters, or train_samples (which loading turned into train_iters,
// so its mistakes are named here, by train_samples, before the checks of train_iters), and
// the early exits.
void check_run_length(const Checker& c, const TrainingConfig& t) {
  c.require(t.exit_interval >= 0, "exit_interval", "0 (off) or a positive interval");
  c.require(t.exit_duration_in_mins >= 0, "exit_duration_in_mins",
            "0 (off) or a positive number of minutes");
  c.require(t.train_samples >= 0, "train_samples",
            "0 (train_iters gives the run's length) or a positive count");
  if (t.train_samples == 0) {
    c.require(t.train_iters >= 1, "train_iters", "at least 1 (0 only with train_samples set)");
    return;
  }
  if (t.global_batch_size < 1) return;  // check_batch names it
  const int64_t iters = t.train_samples / t.global_batch_size;
  c.require(iters >= 1, "train_samples",
            fmt::format("at least global_batch_size ({}): train_iters = train_samples / "
                        "global_batch_size",
                        t.global_batch_size));
  c.require(t.train_iters == iters, "train_samples",
            fmt::format("one run length: train_samples / global_batch_size = {} iterations, but "
                        "train_iters is {}; set one of them (--train_iters 0 leaves the length "
                        "to train_samples)",
                        iters, c.value_and_origin("train_iters")));
  c.require(
      t.lr_decay_iters != 0 || t.lr_warmup_iters <= iters, "train_samples",
      fmt::format("at least lr_warmup_iters x global_batch_size = {} x {} = {}: the "
                  "learning-rate warm-up must end by the end of the run",
                  t.lr_warmup_iters, t.global_batch_size, t.lr_warmup_iters * t.global_batch_size));
}

// The ranks that each train on other samples: what tensor, pipeline and context parallelism
// leave of the world (check_model_parallel has checked that they divide it).
int64_t data_parallel_size(const TrainingConfig& t, int world_size) {
  return world_size /
         (t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size);
}

void check_batch(const Checker& c, const TrainingConfig& t, const ModelConfig& m,
                 int64_t data_parallel_size) {
  c.require(t.train_iters >= 1, "train_iters", "at least 1");
  c.require(t.micro_batch_size >= 1, "micro_batch_size", "at least 1");
  c.require(t.seq_length >= 1, "seq_length", "at least 1");
  c.require(t.seq_length <= m.max_position_embeddings, "seq_length",
            fmt::format("at most max_position_embeddings ({})", m.max_position_embeddings));
  const int64_t per_step = t.micro_batch_size * data_parallel_size;
  c.require(
      t.global_batch_size >= 1 && t.global_batch_size % per_step == 0, "global_batch_size",
      fmt::format("a positive multiple of micro_batch_size x data-parallel size = {} x {} = {}",
                  t.micro_batch_size, data_parallel_size, per_step));
}

// How the layers are dealt out over the pipeline: evenly over its stages (and over each
// stage's model chunks when interleaved), or with Megatron's uneven first and last stages.
void check_pipeline(const Checker& c, const TrainingConfig& t, int64_t layers) {
  const int64_t pp = t.pipeline_model_parallel_size;
  const bool interleaved =
      t.virtual_pipeline_model_parallel_size > 0 || t.num_layers_per_virtual_pipeline_stage > 0;
  const bool uneven =
      t.decoder_first_pipeline_num_layers > 0 || t.decoder_last_pipeline_num_layers > 0;
  const std::pair<const char*, int64_t> stage_keys[] = {
      {"virtual_pipeline_model_parallel_size", t.virtual_pipeline_model_parallel_size},
      {"num_layers_per_virtual_pipeline_stage", t.num_layers_per_virtual_pipeline_stage},
      {"decoder_first_pipeline_num_layers", t.decoder_first_pipeline_num_layers},
      {"decoder_last_pipeline_num_layers", t.decoder_last_pipeline_num_layers}};
  for (const auto& [key, value] : stage_keys) {
    c.require(value >= 0, key, "0 (none) or a positive integer");
    c.require(pp > 1 || value == 0, key,
              "0 without pipeline parallelism (pipeline_model_parallel_size 1)");
  }
  if (pp == 1) return;
  if (interleaved) {
    c.require(
        t.virtual_pipeline_model_parallel_size == 0 || t.num_layers_per_virtual_pipeline_stage == 0,
        "num_layers_per_virtual_pipeline_stage",
        "0 when virtual_pipeline_model_parallel_size is set (one of the two gives the "
        "model chunks per pipeline rank)");
    c.require(!uneven,
              t.decoder_first_pipeline_num_layers > 0 ? "decoder_first_pipeline_num_layers"
                                                      : "decoder_last_pipeline_num_layers",
              "0 with an interleaved pipeline (virtual stages are even)");
    if (t.num_layers_per_virtual_pipeline_stage > 0)
      c.require(layers % (pp * t.num_layers_per_virtual_pipeline_stage) == 0,
                "num_layers_per_virtual_pipeline_stage",
                fmt::format("num_layers ({}) divisible by pipeline_model_parallel_size x this "
                            "(each of the {} ranks holds whole chunks of this many layers)",
                            layers, pp));
    const int64_t chunks = virtual_pipeline_chunks(t, layers);
    c.require(layers % (pp * chunks) == 0, "virtual_pipeline_model_parallel_size",
              fmt::format("num_layers ({}) divisible by pipeline_model_parallel_size x this = {} "
                          "x {}: every model chunk holds as many layers",
                          layers, pp, chunks));
    return;
  }
  if (!uneven) {
    c.require(layers % pp == 0, "pipeline_model_parallel_size",
              fmt::format("a divisor of num_layers ({}): every stage holds as many layers "
                          "(or set decoder_first_pipeline_num_layers / "
                          "decoder_last_pipeline_num_layers)",
                          layers));
    return;
  }
  const int64_t first = t.decoder_first_pipeline_num_layers,
                last = t.decoder_last_pipeline_num_layers;
  const int64_t middle_stages = pp - (first > 0) - (last > 0), rest = layers - first - last;
  const char* blamed =
      last > 0 ? "decoder_last_pipeline_num_layers" : "decoder_first_pipeline_num_layers";
  c.require(rest >= middle_stages && (middle_stages == 0 ? rest == 0 : rest % middle_stages == 0),
            blamed,
            fmt::format("first and last stage layers that leave the other {} stage(s) an equal, "
                        "non-zero share of num_layers ({}); {} remain",
                        middle_stages, layers, rest));
}

// Megatron's mesh: tensor x pipeline x context parallel sizes dividing the world, each model
// dimension the tensor-parallel ranks split divisible by their number, layers dealt out evenly
// over the pipeline's stages (and chunks). Each mistake names the size that does not fit.
void check_model_parallel(const Checker& c, const Experiment& e, int world_size) {
  const TrainingConfig& t = e.training;
  const ModelConfig& m = e.model_config;
  const int64_t tp = t.tensor_model_parallel_size, pp = t.pipeline_model_parallel_size,
                cp = t.context_parallel_size;
  const std::pair<const char*, int64_t> sizes[] = {{"tensor_model_parallel_size", tp},
                                                   {"pipeline_model_parallel_size", pp},
                                                   {"context_parallel_size", cp}};
  for (const auto& [key, size] : sizes) c.require(size >= 1, key, "a positive integer (1: off)");
  // Blame the first size whose product with those before it stops dividing the world.
  int64_t model = 1;
  for (const auto& [key, size] : sizes) {
    model *= size;
    c.require(world_size % model == 0, key,
              fmt::format("tensor x pipeline x context parallel sizes ({} x {} x {}) to divide "
                          "the number of ranks, {} (the data-parallel size is what they leave)",
                          tp, pp, cp, world_size));
  }
  const int64_t groups = m.num_query_groups ? m.num_query_groups : m.num_attention_heads;
  c.require(m.num_attention_heads % tp == 0 && groups % tp == 0, "tensor_model_parallel_size",
            fmt::format("a divisor of num_attention_heads ({}) and num_query_groups ({}): each "
                        "tensor-parallel rank computes whole heads",
                        m.num_attention_heads, groups));
  c.require(m.ffn_hidden_size % tp == 0, "tensor_model_parallel_size",
            fmt::format("a divisor of ffn_hidden_size ({}): each tensor-parallel rank holds an "
                        "equal share of the MLP",
                        m.ffn_hidden_size));
  if (t.sequence_parallel && tp > 1)
    c.require(t.seq_length % tp == 0, "seq_length",
              fmt::format("a multiple of tensor_model_parallel_size ({}) with sequence_parallel: "
                          "each rank holds an equal share of the tokens",
                          tp));
  if (cp > 1)
    c.require(t.seq_length % (2 * cp) == 0, "seq_length",
              fmt::format("a multiple of 2 x context_parallel_size = {}: each context-parallel "
                          "rank holds two of 2 x {} equal chunks (causal load balancing)",
                          2 * cp, cp));
  check_pipeline(c, t, m.num_layers);
}

// The interleaved schedule runs the micro-batches of a step in groups of one per stage.
void check_pipeline_batch(const Checker& c, const TrainingConfig& t, int64_t layers,
                          int64_t data_parallel_size) {
  const int64_t pp = t.pipeline_model_parallel_size;
  if (pp == 1 || virtual_pipeline_chunks(t, layers) <= 1) return;
  const int64_t micro_batches = t.global_batch_size / (t.micro_batch_size * data_parallel_size);
  c.require(micro_batches % pp == 0, "global_batch_size",
            fmt::format("micro-batches per step (global_batch_size / (micro_batch_size x "
                        "data-parallel size) = {}) a multiple of pipeline_model_parallel_size "
                        "({}) with an interleaved pipeline",
                        micro_batches, pp));
}

// Layouts parallelize cannot build (yet) are refused here, before anything is written.
void check_laid_out(const Checker& c, const Experiment& e) {
  const TrainingConfig& t = e.training;
  // FSDP composes with tensor and context parallelism (torchtitan's 2D and its CP): each
  // tensor-parallel part is sharded over the data x context-parallel ranks that hold it.
  c.require(!t.use_torch_fsdp2 || t.pipeline_model_parallel_size == 1, "use_torch_fsdp2",
            "false with pipeline_model_parallel_size above 1 (FSDP shards whole layers over the "
            "data-parallel ranks and composes with tensor and context parallelism only; use "
            "use_distributed_optimizer with pipelines)");
  c.require(
      t.pipeline_model_parallel_size == 1 || e.model_config.untie_embeddings_and_output_weights,
      "untie_embeddings_and_output_weights",
      "true with pipeline_model_parallel_size above 1: the embedding (first stage) and the "
      "output head (last stage) are separate weights");
}

void check_data_parallel(const Checker& c, const TrainingConfig& t) {
  c.require(t.ddp_bucket_size >= 1, "ddp_bucket_size", "at least 1 element");
  c.require(!(t.use_torch_fsdp2 && t.use_distributed_optimizer), "use_torch_fsdp2",
            "false when use_distributed_optimizer is true (FSDP already shards the optimizer "
            "state; choose one)");
  c.require(t.dist_timeout_minutes > 0, "dist_timeout_minutes", "a positive number of minutes");
}

// Megatron's rules for the precision-aware optimizer: the four dtypes stay fp32 without it,
// and it runs inside the distributed optimizer (here: ZeRO-1, or FSDP, which shards the same
// state), so a one-GPU run sets use_distributed_optimizer too, as Megatron's does.
void check_optimizer_precision(const Checker& c, const TrainingConfig& t) {
  for (const char* key :
       {"main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"})
    c.require(t.use_precision_aware_optimizer || find_key(key)->get(c.experiment()) == "fp32", key,
              "fp32 unless use_precision_aware_optimizer is true (Megatron's rule: the "
              "optimizer's tensors are lowered only by the precision-aware optimizer)");
  if (!t.use_precision_aware_optimizer) return;
  c.require(t.use_distributed_optimizer || t.use_torch_fsdp2, "use_precision_aware_optimizer",
            "false unless use_distributed_optimizer (or use_torch_fsdp2) is true: as in Megatron, "
            "the precision-aware optimizer is the distributed optimizer's (on one GPU, "
            "--use_distributed_optimizer true changes nothing else)");
  c.require(t.main_params_dtype == DType::F32 ||
                (t.device != DeviceChoice::Cpu && t.precision != Precision::Fp32),
            "main_params_dtype",
            "fp32 unless the parameters are bf16 (precision bf16, or auto on a GPU): bf16 main "
            "parameters are the bf16 parameters themselves");
}

// The warm-up must end by the end of the decay (lr_decay_iters; 0 means train_iters). Of the
// two keys, the one the user changed on the command line is blamed: `--train_iters 5`
// against an experiment's 20 warm-up steps is a problem of the 5, not of the file.
void check_warmup(const Checker& c, const TrainingConfig& t) {
  const char* end_key = t.lr_decay_iters ? "lr_decay_iters" : "train_iters";
  const int64_t end = t.lr_decay_iters ? t.lr_decay_iters : t.train_iters;
  if (t.lr_warmup_iters <= end) return;
  const std::string why =
      t.lr_decay_iters ? "the learning-rate warm-up must end by lr_decay_iters"
                       : "the learning-rate warm-up must end by lr_decay_iters (0: train_iters)";
  const std::string fix =
      fmt::format("lower --lr_warmup_iters to {} or less, or raise {} to {} or more", end,
                  t.lr_decay_iters ? "--lr_decay_iters" : "--train_iters (or --lr_decay_iters)",
                  t.lr_warmup_iters);
  if (c.origin(end_key) == "command line" && c.origin("lr_warmup_iters") != "command line")
    c.fail(end_key, fmt::format("at least lr_warmup_iters ({}): {}; {}",
                                c.value_and_origin("lr_warmup_iters"), why, fix));
  c.fail("lr_warmup_iters",
         fmt::format("at most {} ({}): {}; {}", end_key, c.value_and_origin(end_key), why, fix));
}

// Megatron's sample-based schedule keys, the warm-up fraction and WSD: one spelling of each
// phase (loading lets a later file or the command line replace an earlier one's), and the
// phases in order.
void check_schedule(const Checker& c, const TrainingConfig& t) {
  const std::pair<const char*, int64_t> counts[] = {
      {"lr_warmup_samples", t.lr_warmup_samples},
      {"lr_decay_samples", t.lr_decay_samples},
      {"lr_wsd_decay_iters", t.lr_wsd_decay_iters},
      {"lr_wsd_decay_samples", t.lr_wsd_decay_samples}};
  for (const auto& [key, value] : counts)
    c.require(value >= 0, key, "null or a non-negative count");
  const auto one_of = [&](const char* a, bool a_set, const char* b, bool b_set) {
    c.require(!(a_set && b_set), b,
              fmt::format("unset when {} is set ({}): both give the same phase of the "
                          "schedule; set one of them",
                          a, c.value_and_origin(a)));
  };
  one_of("lr_warmup_iters", t.lr_warmup_iters > 0, "lr_warmup_samples", t.lr_warmup_samples > 0);
  one_of("lr_warmup_iters", t.lr_warmup_iters > 0, "lr_warmup_fraction", t.lr_warmup_fraction >= 0);
  one_of("lr_warmup_samples", t.lr_warmup_samples > 0, "lr_warmup_fraction",
         t.lr_warmup_fraction >= 0);
  one_of("lr_decay_iters", t.lr_decay_iters > 0, "lr_decay_samples", t.lr_decay_samples > 0);
  one_of("lr_wsd_decay_iters", t.lr_wsd_decay_iters > 0, "lr_wsd_decay_samples",
         t.lr_wsd_decay_samples > 0);
  c.require(t.lr_warmup_fraction <= 1, "lr_warmup_fraction",
            "null or a fraction of the decay between 0 and 1");
  const LrSchedulePhases p = lr_schedule_phases(t);
  const char* unit = p.in_samples ? "samples" : "iterations";
  if (t.lr_decay_style == LrDecayStyle::Wsd) {
    c.require(p.wsd_decay > 0, p.in_samples ? "lr_wsd_decay_samples" : "lr_wsd_decay_iters",
              fmt::format("a positive count with lr_decay_style WSD: the annealing phase that "
                          "ends the decay, in {} (Megatron requires it too)",
                          unit));
    c.require(p.wsd_decay <= p.decay_end - p.warmup,
              t.lr_wsd_decay_samples > 0 ? "lr_wsd_decay_samples" : "lr_wsd_decay_iters",
              fmt::format("at most the decay after the warm-up, {} - {} = {} {}: annealing starts "
                          "once the warm-up is over",
                          p.decay_end, p.warmup, p.decay_end - p.warmup, unit));
  }
  // Iteration-based warm-ups are checked by check_warmup, which names the keys to change.
  if (t.lr_warmup_samples > 0 || t.lr_decay_samples > 0 || t.lr_warmup_fraction >= 0)
    c.require(p.warmup <= p.decay_end,
              t.lr_warmup_samples > 0 ? "lr_warmup_samples" : "lr_warmup_fraction",
              fmt::format("a warm-up ({} {}) that ends by the end of the decay ({} {})", p.warmup,
                          unit, p.decay_end, unit));
}

void check_optimizer(const Checker& c, const TrainingConfig& t) {
  c.require(t.lr >= 0, "lr", "a non-negative learning rate");
  c.require(t.min_lr >= 0 && t.min_lr <= t.lr, "min_lr",
            fmt::format("between 0 and lr ({})", t.lr));
  c.require(t.lr_warmup_iters >= 0, "lr_warmup_iters", "a non-negative count");
  c.require(t.lr_decay_iters >= 0, "lr_decay_iters", "0 (train_iters) or a positive count");
  check_schedule(c, t);
  if (t.lr_warmup_samples == 0 && t.lr_decay_samples == 0 && t.lr_warmup_fraction < 0)
    check_warmup(c, t);
  c.require(t.weight_decay >= 0, "weight_decay", "a non-negative number");
  c.require(t.adam_beta1 >= 0 && t.adam_beta1 < 1, "adam_beta1", "a number in [0, 1)");
  c.require(t.adam_beta2 >= 0 && t.adam_beta2 < 1, "adam_beta2", "a number in [0, 1)");
  c.require(t.adam_eps > 0, "adam_eps", "a positive number");
  c.require(t.clip_grad >= 0, "clip_grad", "0 (off) or a positive norm");
}

// How each step runs: seed, precision, recompute, the NaN guard and cross-entropy chunks.
void check_step(const Checker& c, const TrainingConfig& t, const ModelConfig& m) {
  c.require(t.seed >= 0, "seed", "a non-negative integer");
  c.require(!(t.device == DeviceChoice::Cpu && t.precision == Precision::Bf16), "precision",
            "fp32 or auto with device cpu (the CPU backend is the fp32 reference)");
  (void)m;
  c.require(t.recompute_num_layers >= 0, "recompute_num_layers", "null or a non-negative count");
  // Loading made a recompute_num_layers without a granularity full (Primus's pairing).
  c.require(t.recompute_num_layers == 0 || t.recompute_granularity == RecomputeGranularity::Full,
            "recompute_num_layers", "null (0) unless recompute_granularity is full");
  c.require(t.recompute_method == RecomputeMethod::None ||
                t.recompute_granularity == RecomputeGranularity::Full,
            "recompute_method",
            "null unless recompute_granularity is full (as in Megatron, the method divides whole "
            "layers; selective recompute has none)");
  c.require(t.recompute_method != RecomputeMethod::Uniform || t.recompute_num_layers >= 1,
            "recompute_num_layers",
            "at least 1 with recompute_method uniform: the layers of each recomputed group");
  c.require(t.max_consecutive_nan_iters >= 1, "max_consecutive_nan_iters", "at least 1");
  c.require(t.cross_entropy_chunk_tokens >= 1, "cross_entropy_chunk_tokens", "at least 1");
}

void check_fp8(const Checker& c, const TrainingConfig& t) {
  c.require(t.device != DeviceChoice::Cpu, "fp8",
            "null with device cpu: FP8 GEMMs need a GPU with FP8 tensor cores (Hopper or newer)");
  c.require(t.precision != Precision::Fp32, "fp8",
            "null with precision fp32: FP8 training keeps bf16 activations and weights "
            "(precision bf16 or auto)");
  c.require(t.fp8_amax_history_len >= 1, "fp8_amax_history_len", "at least 1");
  c.require(t.fp8_margin >= 0 && t.fp8_margin <= 32, "fp8_margin", "an integer in [0, 32]");
  // The multiples the device's FP8 GEMMs need are checked against its backend (Trainer).
  if (t.fp8_recipe != Fp8Recipe::Blockwise) return;
  // Block-scaled GEMMs take whole 128-blocks: the tokens are wgrad's K.
  c.require(t.micro_batch_size * t.seq_length % 128 == 0, "seq_length",
            fmt::format("micro_batch_size x seq_length (now {}) a multiple of 128 with fp8_recipe "
                        "blockwise",
                        t.micro_batch_size * t.seq_length));
  c.require(!t.fp8_lm_head || t.cross_entropy_chunk_tokens % 128 == 0, "cross_entropy_chunk_tokens",
            "a multiple of 128 with fp8_lm_head and blockwise");
}

// FP8 attention is the warpgroup forward's FP8 form (Tessera's kernels, not cuDNN's): heads of
// 128, one sequence's keys.
void check_fp8_attention(const Checker& c, const ModelConfig& m, const TrainingConfig& t) {
  const char* key = "fp8_dot_product_attention";
  c.require(t.device != DeviceChoice::Cpu, key,
            "false with device cpu: FP8 attention runs on Hopper GPUs' tensor cores");
  c.require(t.precision != Precision::Fp32, key,
            "false with precision fp32: FP8 attention reads bf16 queries, keys and values");
  c.require(!m.multi_latent_attention, key,
            "false with multi_latent_attention: its heads (192 and 128) are not one width of 128");
  c.require(attention_head_dim(m) == 128, key,
            fmt::format("false with heads of {}: FP8 attention takes heads of 128",
                        attention_head_dim(m)));
  c.require(t.context_parallel_size == 1, key,
            "false with context_parallel_size above 1: context parallelism's attention is bf16");
  c.require(t.attention_backend != AttentionBackend::Vendor, key,
            "false with attention_backend cudnn (or fused): FP8 attention runs on Tessera's "
            "warpgroup kernels");
}

// The run's tokenizer as a dataset would record it (without the vocabulary, which only
// loading the tokenizer tells); the tokenizer.json is hashed once, on first use.
class RunTokenizer {
 public:
  explicit RunTokenizer(const DataConfig& d) : d_(d) {}
  const TokenizerRecord& record() {
    if (!record_) {
      record_.emplace();
      record_->tokenizer_type = d_.tokenizer_type;
      if (d_.tokenizer_type == TokenizerType::HuggingFace) {
        record_->tokenizer_model = d_.tokenizer_model;
        record_->tokenizer_json_sha256 = file_sha256(tokenizer_json_path(d_.tokenizer_model));
      }
    }
    return *record_;
  }

 private:
  const DataConfig& d_;
  std::optional<TokenizerRecord> record_;
};

// Every prefix of a blend must name a dataset (PREFIX.bin and PREFIX.idx), checked here so
// that a typo stops the run before its experiment directory is made. A dataset that records
// its tokenizer (dataset_meta_path) must have been made with the run's: the same ids under
// another vocabulary train on nonsense. Datasets without a record (Megatron's tools, older
// Tessera) are not checked. parse_blend names the key and the offending token (a weight that
// is not a number).
void check_blend(const Checker& c, const char* key, const std::string& value, RunTokenizer& run) {
  const auto blend = parse_blend(value, key, c.origin(key));
  // A single train_data_path word that names neither text nor a dataset is most likely a
  // missing corpus.
  const std::string expected =
      std::string_view(key) == "train_data_path" && blend.size() == 1
          ? "an existing file or directory of text, or a Megatron blend of indexed datasets "
            "(PREFIX.bin/.idx); for the Brown corpus, run scripts/setup.sh, which installs it "
            "under node_modules/"
          : "a Megatron blend of existing indexed datasets, PREFIX.bin + PREFIX.idx (written by "
            "`tessera preprocess`; the default experiment's by scripts/setup.sh)";
  for (const auto& b : blend) {
    std::vector<std::string> missing;
    std::error_code ec;
    for (const char* ext : {".bin", ".idx"})
      if (!fs::is_regular_file(b.prefix + ext, ec)) missing.push_back(b.prefix + ext);
    // A shipped experiment's dataset (${TESSERA_DATA_DIR}) missing: say which data root was
    // searched, and why that one.
    std::string searched;
    if (!missing.empty()) {
      const DataRoot root = data_root();
      if (fs::path(b.prefix).parent_path().lexically_normal() ==
          fs::path(root.dataset_dir()).lexically_normal())
        searched = ". " + root.explain();
    }
    c.require(missing.empty(), key,
              fmt::format("{}; {} not found{}", expected, fmt::join(missing, " and "), searched));
    const std::optional<TokenizerRecord> made_with = read_tokenizer_record(b.prefix);
    if (!made_with) continue;
    const TokenizerRecord& r = run.record();
    c.require(made_with->tokenizer_type == r.tokenizer_type &&
                  made_with->tokenizer_json_sha256 == r.tokenizer_json_sha256,
              key,
              fmt::format("datasets made with this run's tokenizer, {}; {} was made with {}, "
                          "as {} records: preprocess it again with this tokenizer, or set "
                          "tokenizer_type / tokenizer_model to the dataset's",
                          describe_tokenizer_record(r), b.prefix,
                          describe_tokenizer_record(*made_with), dataset_meta_path(b.prefix)));
  }
}

void check_blends(const Checker& c, const DataConfig& d) {
  RunTokenizer run(d);
  if (!d.data_path.empty()) check_blend(c, "data_path", d.data_path, run);
  if (!d.valid_data_path.empty()) check_blend(c, "valid_data_path", d.valid_data_path, run);
  if (!d.train_data_path.empty() && !is_text_corpus_path(d.train_data_path))
    check_blend(c, "train_data_path", d.train_data_path, run);
}

void check_data(const Checker& c, const DataConfig& d) {
  c.require(d.mock_data || !d.train_data_path.empty() || !d.data_path.empty(), "train_data_path",
            "a data path (train_data_path or data_path), or mock_data: true");
  c.require(d.data_path.empty() || d.train_data_path.empty(), "data_path",
            fmt::format("empty when train_data_path is set, as in Megatron (data_path is split "
                        "into train/valid/test, train_data_path is used whole); train_data_path "
                        "is '{}': clear one of them, e.g. --train_data_path null",
                        d.train_data_path));
  c.require(d.tokenizer_type != TokenizerType::HuggingFace || names_a_tokenizer(d.tokenizer_model),
            "tokenizer_model",
            tokenizer_model_expectation() + " with tokenizer_type HuggingFaceTokenizer");
  if (d.tokenizer_type == TokenizerType::Gpt2Bpe)
    for (const char* key : {"vocab_file", "merge_file"})
      c.require(fs::is_regular_file(find_key(key)->get(c.experiment())), key,
                "an existing file with tokenizer_type GPT2BPETokenizer (GPT-2's vocab.json and "
                "merges.txt)");
  // GRPO's paths are files of prompts (check_grpo), read when the run starts.
  if (c.experiment().training.objective == Objective::Grpo) {
    for (const auto& [key, path] : {std::pair{"train_data_path", &d.train_data_path},
                                    std::pair{"valid_data_path", &d.valid_data_path}})
      if (!path->empty())
        c.require(fs::is_regular_file(*path), key, "an existing JSON-lines file of prompts with objective grpo");
  } else if (!d.mock_data) {
    check_blends(c, d);
  }
  const std::vector<double> split = parse_split(d.split);
  c.require(split.size() == 3 && split[0] > 0, "split",
            "three non-negative proportions train,valid,test with train > 0, e.g. \"969,30,1\"");
  c.require(d.eval_interval >= 0, "eval_interval", "0 (off) or a positive interval");
  c.require(d.eval_iters >= 0, "eval_iters", "0 (no evaluation) or a positive count");
  c.require(d.target_loss >= 0, "target_loss", "0 (off) or a positive loss");
  c.require(d.target_loss == 0 || d.eval_interval > 0, "target_loss",
            "0 unless eval_interval is set (the target is checked at every evaluation)");
}

void check_checkpoint(const Checker& c, const CheckpointConfig& k) {
  c.require(k.save_interval >= 0, "save_interval",
            "0 (save only at the end) or a positive interval");
  c.require(k.ckpt_keep_last >= 0, "ckpt_keep_last", "0 (keep all) or a positive count");
  // Checked here, before the run makes anything, as the experiment directory is; a name
  // the file system refuses (over 255 bytes) is named as such, not left to the first save.
  const auto save_problem = k.save.empty() ? std::nullopt : output_directory_problem(k.save);
  c.require(!save_problem, "save",
            "a directory for checkpoints that can be created and written (" +
                save_problem.value_or("") + ")");
  // A missing `load` is allowed only when it is the save directory: the first run of a
  // job that is requeued with the same command line.
  const auto same_dir = [](const std::string& a, const std::string& b) {
    return (fs::path(a) / "").lexically_normal() == (fs::path(b) / "").lexically_normal();
  };
  std::error_code ec;
  c.require(k.load.empty() || fs::is_directory(k.load, ec) || same_dir(k.load, k.save), "load",
            "an existing checkpoint directory, or the save directory");
  c.require(k.hf_init_path.empty() || fs::exists(fs::path(k.hf_init_path) / "config.json", ec),
            "hf_init_path", "a Hugging Face model directory holding config.json");
  c.require(!k.finetune || (!k.load.empty() && fs::is_directory(k.load, ec)), "finetune",
            "load naming an existing checkpoint directory, whose latest checkpoint gives the "
            "weights to fine-tune");
  c.require(!k.finetune || k.save.empty() || !same_dir(k.load, k.save), "finetune",
            "save in another directory than load: a restarted run would take its own "
            "checkpoint's weights and start again from iteration 0");
}

void check_logging(const Checker& c, const LoggingConfig& lg, int64_t train_iters, int world_size) {
  c.require(lg.log_interval >= 1, "log_interval", "at least 1");
  if (!lg.profile) return;  // the window and ranks matter only when something is recorded
  c.require(lg.profile_step_start >= 1 && lg.profile_step_start <= train_iters,
            "profile_step_start",
            fmt::format("an iteration between 1 and train_iters ({})", train_iters));
  c.require(lg.profile_step_end > lg.profile_step_start, "profile_step_end",
            fmt::format("greater than profile_step_start ({}): iterations [start, end) are "
                        "recorded",
                        lg.profile_step_start));
  const auto ranks = parse_profile_ranks(lg.profile_ranks);
  c.require(ranks.has_value(), "profile_ranks",
            "all, or comma-separated distinct rank ids such as 0 or 0,4");
  c.require(ranks->all || ranks->ids.back() < world_size, "profile_ranks",
            fmt::format("rank ids below the number of ranks ({})", world_size));
}

// skip_train runs nothing but an evaluation.
void check_skip_train(const Checker& c, const DataConfig& d) {
  c.require(!d.skip_train || d.eval_iters >= 1, "eval_iters",
            "at least 1 with skip_train (the evaluation is all the run does)");
}

// Checked here, before the run makes anything, as the experiment and save directories are.
void check_tensorboard(const Checker& c, const Experiment& e) {
  c.require(e.logging.tensorboard_log_interval >= 1, "tensorboard_log_interval", "at least 1");
  if (e.logging.tensorboard_dir.empty()) return;
  const auto problem = output_directory_problem(e.tensorboard_directory());
  c.require(!problem, "tensorboard_dir",
            "a directory that can be created and written (" + problem.value_or("") + ")");
}

}  // namespace

int64_t virtual_pipeline_chunks(const TrainingConfig& t, int64_t num_layers) {
  if (t.pipeline_model_parallel_size <= 1) return 1;
  if (t.virtual_pipeline_model_parallel_size > 0) return t.virtual_pipeline_model_parallel_size;
  if (t.num_layers_per_virtual_pipeline_stage > 0)
    return std::max<int64_t>(
        1, num_layers / t.pipeline_model_parallel_size / t.num_layers_per_virtual_pipeline_stage);
  return 1;
}

// DPO runs one sequence (one side of a pair) at a time through the model, on one stage (a
// sequence may be split over context-parallel ranks), against reference log-probabilities
// computed at its start.
void check_dpo(const Checker& c, const Experiment& e) {
  const TrainingConfig& t = e.training;
  if (t.objective != Objective::Dpo) return;
  c.require(t.dpo_beta > 0, "dpo_beta", "a positive beta");
  c.require(t.dpo_label_smoothing >= 0 && t.dpo_label_smoothing < 0.5, "dpo_label_smoothing",
            "a share in [0, 0.5)");
  c.require(t.dpo_rpo_alpha >= 0, "dpo_rpo_alpha", "0 (off) or a positive weight");
  if (!t.dpo_precompute_ref_log_probs) {
    c.require(!t.dpo_reference_free, "dpo_precompute_ref_log_probs",
              "true with dpo_reference_free (a run without a reference holds no copy of it)");
    c.require(t.lora_rank == 0, "dpo_precompute_ref_log_probs",
              "true with lora_rank: the LoRA reference is the frozen base with the adapters at "
              "zero, whose log-probabilities are computed once");
  }
  c.require(t.micro_batch_size == 1, "micro_batch_size",
            "1 with objective dpo: each side of a pair runs as its own sequence");
  c.require(!e.data.mock_data && !e.data.data_path.empty(), "data_path",
            "a preference dataset with objective dpo (tessera preprocess --preference)");
  c.require(e.data.packing_strategy == PackingStrategy::Wrapped, "packing_strategy",
            "wrapped with objective dpo (each side is its own sequence)");
}

std::vector<std::pair<std::string, double>> grpo_reward_terms(const std::string& text) {
  std::vector<std::pair<std::string, double>> terms;
  std::stringstream in(text);
  for (std::string term; std::getline(in, term, ',');) {
    const size_t colon = term.find(':');
    std::string name = term.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (name != "answer" && name != "format" && name != "overlong" && name != "command")
      throw std::invalid_argument(fmt::format("'{}' is not a reward", name));
    for (const auto& [seen, weight] : terms)
      if (seen == name) throw std::invalid_argument(fmt::format("'{}' is named twice", name));
    double weight = 1.0;
    if (colon != std::string::npos) {
      const std::string w = term.substr(colon + 1);
      size_t used = 0;
      try {
        weight = std::stod(w, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || w.find_first_not_of(' ', used) != std::string::npos || !std::isfinite(weight))
        throw std::invalid_argument(fmt::format("'{}' is not a weight", w));
    }
    terms.emplace_back(name, weight);
  }
  if (terms.empty()) throw std::invalid_argument("no reward is named");
  return terms;
}

int64_t grpo_generation_slots(const TrainingConfig& t, int64_t data_parallel_size) {
  const int64_t per_rank = t.global_batch_size / data_parallel_size;
  return t.grpo_max_num_seqs > 0 ? std::min(t.grpo_max_num_seqs, per_rank) : per_rank;
}

int grpo_training_ranks(const TrainingConfig& t, int job_ranks) {
  if (t.objective != Objective::Grpo || t.grpo_generation_gpus <= 0) return job_ranks;
  return std::max(1, job_ranks - static_cast<int>(t.grpo_generation_gpus));
}

int64_t grpo_link_completions(const Experiment& e, int64_t data_parallel_size) {
  const TrainingConfig& t = e.training;
  const int64_t evaluated = e.data.eval_iters * t.global_batch_size / t.grpo_num_generations;
  return std::max(t.global_batch_size / data_parallel_size, (evaluated + data_parallel_size - 1) / data_parallel_size);
}

GrpoGenerationShare grpo_generation_share(const Experiment& e, int64_t training_ranks, int64_t served) {
  const TrainingConfig& t = e.training;
  const int64_t wanted = t.global_batch_size / training_ranks * served;
  return {t.grpo_max_num_seqs > 0 ? std::min(t.grpo_max_num_seqs, wanted) : wanted,
          grpo_link_completions(e, training_ranks) * served};
}

std::vector<std::string> parse_stop_strings(const std::string& value) {
  if (value.empty()) return {};
  std::vector<std::string> out;
  if (value.front() != '[') {
    out.push_back(value);
    return out;
  }
  YAML::Node list;
  try {
    list = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument("a list that does not parse (" + e.msg + ")");
  }
  if (!list.IsSequence()) throw std::invalid_argument("not a list");
  for (const YAML::Node& item : list) {
    if (!item.IsScalar()) throw std::invalid_argument("an item that is not a string");
    if (item.Scalar().empty()) throw std::invalid_argument("an empty stop string");
    out.push_back(item.Scalar());
  }
  return out;
}


// GRPO generates its completions with the policy's own weights in place, one rank's whole
// model (model/generator.h), and trains on one completion per sequence.
void check_grpo(const Checker& c, const Experiment& e) {
  const TrainingConfig& t = e.training;
  if (t.objective != Objective::Grpo) return;
  c.require(!e.data.train_data_path.empty() && e.data.data_path.empty() && !e.data.mock_data,
            e.data.data_path.empty() ? "train_data_path" : "data_path",
            "objective grpo's prompts: train_data_path naming a JSON-lines file of prompts with "
            "their answers (and valid_data_path, held-out ones), no data_path");
  c.require(t.grpo_num_generations >= 2, "grpo_num_generations",
            "2 or more: a group's advantages are relative to its other completions");
  c.require(t.global_batch_size % t.grpo_num_generations == 0, "global_batch_size",
            fmt::format("a multiple of grpo_num_generations ({}): whole groups of completions",
                        t.grpo_num_generations));
  c.require(t.grpo_max_completion_length >= 1 && t.grpo_max_completion_length < t.seq_length,
            "grpo_max_completion_length",
            fmt::format("1 or more and below seq_length ({}), which holds the prompt too", t.seq_length));
  c.require(t.grpo_max_num_seqs >= 0, "grpo_max_num_seqs",
            "0 (all of a rank's completions at once) or a positive count");
  c.require(t.grpo_temperature > 0 && std::isfinite(t.grpo_temperature), "grpo_temperature",
            "a positive temperature (greedy completions of one prompt are all the same)");
  c.require(t.grpo_top_k >= 0, "grpo_top_k", "0 (all tokens) or a positive count");
  c.require(t.grpo_top_p > 0 && t.grpo_top_p <= 1, "grpo_top_p", "a probability in (0, 1]");
  c.require(t.grpo_min_p >= 0 && t.grpo_min_p <= 1, "grpo_min_p", "a share in [0, 1]");
  c.require(t.grpo_epsilon >= 0 && t.grpo_epsilon < 1, "grpo_epsilon", "a clip in [0, 1)");
  c.require(t.grpo_epsilon_high >= 0 && std::isfinite(t.grpo_epsilon_high), "grpo_epsilon_high",
            "a clip of 0 or more");
  c.require(t.grpo_beta >= 0 && std::isfinite(t.grpo_beta), "grpo_beta", "0 (no KL term) or a positive weight");
  c.require(t.grpo_num_iterations >= 1, "grpo_num_iterations", "1 or more optimizer steps per generation batch");
  c.require(t.grpo_overlong_cache >= 0 && t.grpo_overlong_cache < t.grpo_max_completion_length,
            "grpo_overlong_cache",
            fmt::format("0 or more tokens below grpo_max_completion_length ({})", t.grpo_max_completion_length));
  c.require(t.grpo_reward_timeout > 0, "grpo_reward_timeout", "a positive number of seconds");
  try {
    parse_stop_strings(t.grpo_stop_strings);
  } catch (const std::invalid_argument& err) {
    c.fail("grpo_stop_strings", fmt::format("one string or a list of non-empty strings ({})", err.what()));
  }
  std::vector<std::pair<std::string, double>> terms;
  try {
    terms = grpo_reward_terms(t.grpo_rewards);
  } catch (const std::invalid_argument& err) {
    c.fail("grpo_rewards",
           fmt::format("comma-separated name[:weight] of answer, format, overlong and command ({})", err.what()));
  }
  const auto uses = [&](const char* name) {
    return std::any_of(terms.begin(), terms.end(), [&](const auto& term) { return term.first == name; });
  };
  if (uses("answer") && t.grpo_answer_format == AnswerFormat::Regex)
    c.require(!t.grpo_answer_regex.empty(), "grpo_answer_regex",
              "a pattern with grpo_answer_format regex");
  for (const auto& [key, pattern] : {std::pair{"grpo_answer_regex", &t.grpo_answer_regex},
                                     std::pair{"grpo_format_regex", &t.grpo_format_regex}}) {
    if (pattern->empty()) continue;
    try {
      std::regex(*pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& err) {
      c.fail(key, fmt::format("an ECMAScript regular expression ({})", err.what()));
    }
  }
  if (uses("format"))
    c.require(!t.grpo_format_regex.empty(), "grpo_format_regex", "a pattern with the format reward");
  if (uses("command"))
    c.require(!t.grpo_reward_command.empty(), "grpo_reward_command", "a command with the command reward");
  c.require(t.tensor_model_parallel_size == 1 && t.pipeline_model_parallel_size == 1 &&
                t.context_parallel_size == 1 && t.expert_model_parallel_size == 1,
            t.tensor_model_parallel_size > 1     ? "tensor_model_parallel_size"
            : t.pipeline_model_parallel_size > 1 ? "pipeline_model_parallel_size"
            : t.context_parallel_size > 1        ? "context_parallel_size"
                                                 : "expert_model_parallel_size",
            "1 with objective grpo: each rank generates with its whole model (data parallelism "
            "and ZeRO-1 split the completions)");
  c.require(!t.use_torch_fsdp2, "use_torch_fsdp2",
            "false with objective grpo: generation reads the whole model on each rank");
  c.require(t.grpo_generation_gpus >= 0, "grpo_generation_gpus",
            "0 (colocated) or the number of ranks that only generate (split)");
  c.require(!t.grpo_async_generation || t.grpo_generation_gpus > 0, "grpo_async_generation",
            "false without grpo_generation_gpus: colocated, generation and training share the GPUs");
  if (t.grpo_generation_gpus > 0) {
    c.require(t.lora_rank == 0, "lora_rank",
              "0 with grpo_generation_gpus: the generation ranks receive whole weights, not adapters");
    c.require(!t.grpo_offload_optimizer_state, "grpo_offload_optimizer_state",
              "false with grpo_generation_gpus: the training ranks hold no KV cache");
  }
  c.require(e.data.target_loss == 0, "target_loss",
            "0 with objective grpo: its validation measures held-out accuracy, not a loss");
  c.require(!e.data.skip_train || !e.data.valid_data_path.empty(), "valid_data_path",
            "a file of held-out prompts with skip_train and objective grpo");
  c.require(!e.data.reset_position_ids && !e.data.reset_attention_mask,
            e.data.reset_position_ids ? "reset_position_ids" : "reset_attention_mask",
            "false with objective grpo: each completion is its own sequence");
}

// LoRA adapts the projections of a dense model: data parallelism copies it (FSDP sharding its
// frozen base), tensor parallelism splits each adapter with its weight; pipeline stages would
// have to gather their adapters for the peft files, expert parallelism split them.
void check_lora(const Checker& c, const Experiment& e) {
  const TrainingConfig& t = e.training;
  c.require(t.lora_rank >= 0, "lora_rank", "0 (off) or a positive rank");
  if (t.lora_rank == 0) return;
  c.require(t.lora_alpha > 0, "lora_alpha", "a positive scale numerator");
  c.require(t.lora_dropout == 0, "lora_dropout",
            "0.0: dropout on the adapters' input is not implemented");
  try {
    lora_targets(t.lora_target_modules);
  } catch (const ConfigError&) {
    c.require(false, "lora_target_modules",
              "comma-separated projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
              "down_proj, Megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2) or all-linear");
  }
  const std::pair<const char*, bool> layouts[] = {
      {"pipeline_model_parallel_size", t.pipeline_model_parallel_size > 1},
      {"expert_model_parallel_size", t.expert_model_parallel_size > 1}};
  for (const auto& [key, on] : layouts)
    c.require(!on, key, "off with lora_rank: LoRA runs on model replicas (data parallelism: plain, "
                        "use_distributed_optimizer, or use_torch_fsdp2 sharding the frozen base), their "
                        "tensor-parallel parts and their context-parallel shares of the sequence so far");
  c.require(e.model_config.num_experts == 0 && !e.model_config.multi_latent_attention,
            e.model_config.num_experts > 0 ? "num_experts" : "multi_latent_attention",
            "a dense model with grouped-query attention with lora_rank (MoE experts and "
            "multi-latent attention take no adapters yet)");
  const CheckpointConfig& k = e.checkpoint;
  c.require(!k.finetune, "finetune",
            "false with lora_rank: the frozen base comes from pretrained_checkpoint (or "
            "hf_init_path), and load resumes the adapters");
  std::error_code ec;
  c.require(k.pretrained_checkpoint.empty() || fs::is_directory(k.pretrained_checkpoint, ec),
            "pretrained_checkpoint", "an existing checkpoint directory");
  c.require(k.pretrained_checkpoint.empty() || k.hf_init_path.empty(), "pretrained_checkpoint",
            "unset with hf_init_path: the base comes from one of them");
}

void check_reference_load(const Checker& c, const Experiment& e) {
  const CheckpointConfig& k = e.checkpoint;
  if (k.reference_load.empty()) return;
  const TrainingConfig& t = e.training;
  std::error_code ec;
  c.require(fs::is_directory(k.reference_load, ec), "reference_load", "an existing checkpoint directory");
  c.require((t.objective == Objective::Dpo && !t.dpo_reference_free) ||
                (t.objective == Objective::Grpo && t.grpo_beta > 0),
            "reference_load",
            "unset unless a reference is used: objective dpo (not dpo_reference_free) or objective "
            "grpo with grpo_beta above 0");
  c.require(t.lora_rank == 0, "reference_load", "unset with lora_rank: LoRA's reference is its base, adapters off");
  c.require(!k.load.empty() || !k.hf_init_path.empty(), "reference_load",
            "unset unless the policy has starting weights of its own (load or hf_init_path)");
}

// Packed documents (reset_position_ids, reset_attention_mask) do not reach multi-latent
// attention's own rope yet.
void check_packed_documents(const Checker& c, const Experiment& e) {
  c.require(e.data.packing_strategy == PackingStrategy::Wrapped || !e.data.mock_data,
            "packing_strategy", "wrapped with mock_data: bfd packs the documents of indexed datasets");
  for (const char* key : {"reset_position_ids", "reset_attention_mask"}) {
    const bool on = std::string(key) == "reset_position_ids" ? e.data.reset_position_ids
                                                               : e.data.reset_attention_mask;
    if (!on) continue;
    c.require(!e.model_config.multi_latent_attention, key,
              "false with multi_latent_attention: its rope does not take per-document positions "
              "yet");
  }
}

void validate_experiment(const Experiment& e, int job_size) {
  const Checker c(e);
  // GRPO's generation ranks (split placement) take no part in training.
  c.require(e.training.objective != Objective::Grpo || e.training.grpo_generation_gpus < job_size,
            "grpo_generation_gpus",
            fmt::format("0 (colocated) or fewer ranks than the job's {}: the others train", job_size));
  const int world_size = grpo_training_ranks(e.training, job_size);
  check_experiment_names(c, e);
  check_model(c, e.model_config);
  check_mla(c, e.model_config, e.training);
  check_run_length(c, e.training);
  check_model_parallel(c, e, world_size);
  // Expert-parallel ranks are carved out of the data-parallel (x context-parallel) ones.
  check_moe(c, e.model_config, e.training,
            static_cast<int>(data_parallel_size(e.training, world_size) *
                             e.training.context_parallel_size));
  check_batch(c, e.training, e.model_config, data_parallel_size(e.training, world_size));
  check_pipeline_batch(c, e.training, e.model_config.num_layers,
                       data_parallel_size(e.training, world_size));
  check_data_parallel(c, e.training);
  check_optimizer(c, e.training);
  check_optimizer_precision(c, e.training);
  check_step(c, e.training, e.model_config);
  if (e.training.fp8 != Fp8Mode::Off) check_fp8(c, e.training);
  if (e.training.fp8_dot_product_attention) check_fp8_attention(c, e.model_config, e.training);
  check_data(c, e.data);
  check_packed_documents(c, e);
  check_dpo(c, e);
  check_grpo(c, e);
  check_reference_load(c, e);
  check_lora(c, e);
  c.require(e.checkpoint.pretrained_checkpoint.empty() || e.training.lora_rank > 0,
            "pretrained_checkpoint",
            "unset without lora_rank (a full fine-tune takes its weights from load with finetune)");
  c.require(e.data.tokenizer_type != TokenizerType::Null || e.model_config.vocab_size >= 1,
            "vocab_size",
            "a positive size with tokenizer_type NullTokenizer (its ids run from 0 to vocab_size, "
            "the last the end-of-document id, as Megatron's)");
  check_checkpoint(c, e.checkpoint);
  check_logging(c, e.logging, e.training.train_iters, world_size);
  check_skip_train(c, e.data);
  check_tensorboard(c, e);
  check_laid_out(c, e);
}

}  // namespace tessera
