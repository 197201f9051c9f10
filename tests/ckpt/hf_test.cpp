// Hugging Face interop: config.json mapping, export and import through `tessera convert`,
// and logits that match an independent float64 PyTorch Llama reading the Hugging Face
// files (tests/ckpt/hf_reference.py) for Llama 3.1 (GQA, RoPE scaling, untied), Qwen 2.5
// (QKV bias, tied, MQA), Mistral (sliding window), Mixtral, Qwen3-MoE and DeepSeek-V3
// (multi-latent attention, YaRN, sigmoid group-limited routing) shapes.
//
// Tolerance: Tessera's CPU backend computes in fp32, the reference in fp64; as in
// tests/model/torch_parity_test.cpp logits agree to ~1e-6 relative and 1e-5 is the bound.
#include <cmath>
#include <functional>
#include <random>
#include <set>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/hf_model.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/ckpt/safetensors.h"
#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera::testing {
namespace {

struct HfCase {
  const char* name;
  const char* model_type;  // what the export must choose, and hf_reference.py's CONFIGS key
  const char* yaml;        // the same model as hf_reference.py's CONFIGS[model_type]
};

const HfCase kHfCases[] = {
    {"llama31", "llama",
     "num_layers: 2\nhidden_size: 32\nffn_hidden_size: 48\nnum_attention_heads: "
     "4\nnum_query_groups: 2\n"
     "use_rope_scaling: true\nrope_scaling_factor: 8\nrope_low_freq_factor: "
     "1\nrope_high_freq_factor: 4\n"
     "rope_original_max_position_embeddings: 64\nrotary_base: 10000\nnorm_epsilon: 1.0e-5\n"},
    {"qwen25", "qwen2",
     "num_layers: 2\nhidden_size: 32\nffn_hidden_size: 40\nnum_attention_heads: "
     "4\nnum_query_groups: 1\n"
     "add_qkv_bias: true\nuntie_embeddings_and_output_weights: false\nrotary_base: 1000000\n"
     "norm_epsilon: 1.0e-6\n"},
    {"mistral", "mistral",
     "num_layers: 3\nhidden_size: 32\nffn_hidden_size: 64\nnum_attention_heads: "
     "2\nnum_query_groups: 2\n"
     "sliding_window: 5\nrotary_base: 10000\nnorm_epsilon: 1.0e-5\n"},
    // Qwen3ForCausalLM: RMSNorm on each query and key head, head_dim 16 wider than hidden /
    // heads, tied head.
    {"qwen3", "qwen3",
     "model_family: qwen3\nqk_layernorm: true\nnum_layers: 2\nhidden_size: 32\n"
     "ffn_hidden_size: 48\nnum_attention_heads: 4\nnum_query_groups: 2\nkv_channels: 16\n"
     "untie_embeddings_and_output_weights: false\nrotary_base: 1000000\nnorm_epsilon: 1.0e-6\n"},
    // Olmo2ForCausalLM: post-norms, RMSNorm over all of q and all of k.
    {"olmo2", "olmo2",
     "model_family: olmo2\nqk_layernorm: true\nnum_layers: 2\nhidden_size: 32\n"
     "ffn_hidden_size: 48\nnum_attention_heads: 4\nnum_query_groups: 2\n"
     "rotary_base: 500000\nnorm_epsilon: 1.0e-6\n"},
    // MixtralForCausalLM: 4 experts top-2 in every layer.
    {"mixtral", "mixtral",
     "model_family: mixtral\nnum_layers: 2\nhidden_size: 32\nffn_hidden_size: 24\n"
     "moe_ffn_hidden_size: 24\nnum_attention_heads: 4\nnum_query_groups: 2\nnum_experts: 4\n"
     "moe_router_topk: 2\nrotary_base: 1000000\nnorm_epsilon: 1.0e-5\n"},
    // Qwen3MoeForCausalLM: QK norm, head_dim 16, 8 experts top-4, layer 1 dense
    // (mlp_only_layers), tied head.
    {"qwen3_moe", "qwen3_moe",
     "model_family: qwen3_moe\nqk_layernorm: true\nnum_layers: 3\nhidden_size: 32\n"
     "ffn_hidden_size: 40\nkv_channels: 16\nnum_attention_heads: 4\nnum_query_groups: 2\n"
     "num_experts: 8\nmoe_router_topk: 4\nmoe_ffn_hidden_size: 16\nmoe_layer_freq: 2\n"
     "untie_embeddings_and_output_weights: false\nrotary_base: 1000000\n"
     "norm_epsilon: 1.0e-6\n"},
    // DeepseekV3ForCausalLM: multi-latent attention with a query latent and YaRN, a dense
    // first layer, then 8 experts top-4 by sigmoid scores plus the expert bias (which training
    // moves, and the export carries) in 2 of 4 groups, scaled by 2.5, and a shared expert.
    {"deepseek_v3", "deepseek_v3",
     "model_family: deepseek\nmulti_latent_attention: true\nnum_layers: 3\nhidden_size: 32\n"
     "ffn_hidden_size: 40\nnum_attention_heads: 4\nnum_query_groups: 0\nq_lora_rank: 24\n"
     "kv_lora_rank: 20\n"
     "qk_head_dim: 6\nqk_pos_emb_head_dim: 8\nv_head_dim: 10\nrope_type: yarn\n"
     "rotary_scaling_factor: 4\noriginal_max_position_embeddings: 64\nmscale: 0.8\n"
     "mscale_all_dim: 0.9\nnum_experts: 8\nmoe_router_topk: 4\nmoe_ffn_hidden_size: 16\n"
     "moe_shared_expert_intermediate_size: 16\nmoe_layer_freq: \"[0,1,1]\"\n"
     "moe_router_score_function: sigmoid\nmoe_router_num_groups: 4\n"
     "moe_router_group_topk: 2\nmoe_router_topk_scaling_factor: 2.5\nrotary_base: 10000\n"
     "norm_epsilon: 1.0e-6\nmoe_router_enable_expert_bias: true\n"
     "moe_router_bias_update_rate: 0.01\n"},
    // DeepseekV2ForCausalLM (DeepSeek-V2-Lite's shape): queries projected directly, YaRN with
    // equal mscales, a dense first layer, then 8 experts top-2 by a softmax over all of them,
    // not renormalised, scaled by 1.5, and two shared experts.
    {"deepseek_v2", "deepseek_v2",
     "model_family: deepseek\nmulti_latent_attention: true\nnum_layers: 3\nhidden_size: 32\n"
     "ffn_hidden_size: 40\nnum_attention_heads: 4\nnum_query_groups: 0\nq_lora_rank: null\n"
     "kv_lora_rank: 20\nqk_head_dim: 6\nqk_pos_emb_head_dim: 8\nv_head_dim: 10\n"
     "rope_type: yarn\nrotary_scaling_factor: 4\noriginal_max_position_embeddings: 64\n"
     "mscale: 0.707\nmscale_all_dim: 0.707\nnum_experts: 8\nmoe_router_topk: 2\n"
     "moe_ffn_hidden_size: 16\nmoe_shared_expert_intermediate_size: 32\n"
     "moe_layer_freq: \"[0,1,1]\"\nmoe_router_score_function: softmax\n"
     "moe_router_pre_softmax: true\nmoe_router_topk_scaling_factor: 1.5\nrotary_base: 10000\n"
     "norm_epsilon: 1.0e-6\n"},
};

Experiment case_experiment(const fs::path& dir, const HfCase& c, const std::string& extra = "") {
  const fs::path p = dir / "experiment.yaml";
  std::ofstream(p)
      << "model: tiny_llama\nmock_data: true\nvocab_size: 96\nmake_vocab_size_divisible_by: 1\n"
         "max_position_embeddings: 128\nseq_length: 16\nmicro_batch_size: 2\n"
         "global_batch_size: 4\ntrain_iters: 2\nlr: 0.01\nlog_progress: false\n"
      << c.yaml << overrides_yaml(extra);
  LoadOptions o;
  o.config_path = p.string();
  return load_experiment(o);
}

// Two sequences of 12 ids below 96 (the cases' vocabulary), one per line.
fs::path write_tokens(const fs::path& dir) {
  std::mt19937 rng(5);
  std::string text;
  for (int row = 0; row < 2; ++row) {
    for (int t = 0; t < 12; ++t) text += std::to_string(rng() % 96) + (t < 11 ? " " : "\n");
  }
  write_file(dir / "tokens.txt", text);
  return dir / "tokens.txt";
}

RunResult python(const std::string& args) {
  return run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                     "/ckpt/hf_reference.py " + args);
}

// Norm-wise relative difference of `name` in two safetensors files.
double relative_error(const fs::path& a, const fs::path& ref, const std::string& name) {
  const std::vector<float> x = SafetensorsFile(a.string()).to_float(name),
                           y = SafetensorsFile(ref.string()).to_float(name);
  EXPECT_EQ(x.size(), y.size()) << name;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
    norm += static_cast<double>(y[i]) * y[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

void expect_same_logits(const fs::path& tessera, const fs::path& reference,
                        const std::string& what) {
  const double logits = relative_error(tessera, reference, "logits"),
               loss = relative_error(tessera, reference, "loss");
  EXPECT_LT(logits, 1e-5) << what;
  EXPECT_LT(loss, 1e-5) << what;
  std::printf("[ hf       ] %s: logits %.2e, loss %.2e (relative errors)\n", what.c_str(), logits,
              loss);
}

class HfInterop : public ::testing::TestWithParam<HfCase> {
 protected:
  void SetUp() override {
    ASSERT_EQ(run_command(std::string(TESSERA_PYTHON) + " -c 'import torch'").exit_code, 0)
        << TESSERA_PYTHON << " cannot import torch: install python3-torch (scripts/setup.sh does)";
  }
};

TEST_P(HfInterop, ExportedDirectoryGivesTheSameLogitsInAnIndependentReference) {
  const HfCase& c = GetParam();
  ScratchDir dir;
  Logger log("", 0, false, false);
  const std::string save = (dir / "ckpt").string();
  {
    auto trainer = make_trainer(case_experiment(dir.path(), c, "save: " + save + "\n"), log);
    trainer->train();  // two steps, so the weights are no longer their initial values
  }
  const fs::path tokens = write_tokens(dir.path());
  const fs::path fp32 = dir / "hf_fp32", bf16 = dir / "hf_bf16";
  RunResult r =
      run_tessera("convert --from " + save + " --to-hf " + fp32.string() + " --dtype fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto config = nlohmann::json::parse(read_file(fp32 / "config.json"));
  EXPECT_EQ(config["model_type"], c.model_type);
  EXPECT_EQ(config["torch_dtype"], "float32");
  EXPECT_TRUE(fs::exists(fp32 / "model.safetensors"));
  EXPECT_EQ(SafetensorsFile((fp32 / "model.safetensors").string()).metadata().at("format"), "pt");

  r = run_tessera("convert --from " + save + " --check-logits " + tokens.string() + " --out " +
                  (dir / "tessera.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = python("logits " + fp32.string() + " " + tokens.string() + " " +
             (dir / "ref.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_logits(dir / "tessera.safetensors", dir / "ref.safetensors",
                     std::string(c.name) + " fp32 export");

  // bf16, sharded: the reference reads the rounded weights, Tessera re-imports them.
  r = run_tessera("convert --from " + save + " --to-hf " + bf16.string() + " --shard-size 20KB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(bf16 / "model.safetensors.index.json"));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(bf16))
    shards += e.path().filename().string().starts_with("model-");
  EXPECT_GE(shards, 2);
  r = run_tessera("convert --from-hf " + bf16.string() + " --check-logits " + tokens.string() +
                  " --out " + (dir / "tessera_bf16.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = python("logits " + bf16.string() + " " + tokens.string() + " " +
             (dir / "ref_bf16.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_logits(dir / "tessera_bf16.safetensors", dir / "ref_bf16.safetensors",
                     std::string(c.name) + " bf16 sharded export");
}

TEST_P(HfInterop, ImportedDirectoryGivesTheSameLogitsAndInitialisesTraining) {
  const HfCase& c = GetParam();
  ScratchDir dir;
  const fs::path hf = dir / "hf", tokens = write_tokens(dir.path());
  // Hugging Face names (separate q/k/v, gate/up), bf16, in two shards with an index.
  RunResult r = python(std::string("make ") + c.model_type + " " + hf.string() + " BF16 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = python("logits " + hf.string() + " " + tokens.string() + " " +
             (dir / "ref.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("convert --from-hf " + hf.string() + " --check-logits " + tokens.string() +
                  " --out " + (dir / "tessera.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_logits(dir / "tessera.safetensors", dir / "ref.safetensors",
                     std::string(c.name) + " import");

  // Through a weights-only checkpoint: the same weights, so bitwise the same logits.
  const fs::path ckpt = dir / "ckpt";
  r = run_tessera("convert --from-hf " + hf.string() + " --to " + ckpt.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("convert --from " + ckpt.string() + " --check-logits " + tokens.string() +
                  " --out " + (dir / "via_ckpt.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(relative_error(dir / "via_ckpt.safetensors", dir / "tessera.safetensors", "logits"),
            0.0);

  // hf_init_path puts exactly those weights into the trainer's master weights.
  Logger log("", 0, false, false);
  auto trainer =
      make_trainer(case_experiment(dir.path(), c, "hf_init_path: " + hf.string() + "\n"), log);
  const HfModelReader reader(hf.string());
  const std::vector<float> master = download(trainer->backend(), trainer->optimizer().master());
  for (const ParamInfo& p : trainer->model().layout().params) {
    const std::vector<float> w = reader.weights(p);
    EXPECT_TRUE(std::equal(w.begin(), w.end(), master.begin() + p.offset)) << p.name;
  }
  // A weights-only checkpoint starts training from the same weights.
  auto from_ckpt =
      make_trainer(case_experiment(dir.path(), c, "load: " + ckpt.string() + "\n"), log);
  EXPECT_EQ(from_ckpt->completed_iterations(), 0);
  EXPECT_EQ(download(from_ckpt->backend(), from_ckpt->optimizer().master()), master);
  EXPECT_EQ(trainer->run_iteration(1).loss, from_ckpt->run_iteration(1).loss);
  try {
    // (moe_layer_freq 1: a list of the case's layers would not fit 5.)
    make_trainer(
        case_experiment(dir.path(), c,
                        "num_layers: 5\nmoe_layer_freq: 1\nhf_init_path: " + hf.string() + "\n"),
        log);
    ADD_FAILURE() << "expected a shape mismatch";
  } catch (const DataError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(contains(m, (hf / "config.json").string() +
                                ": the Hugging Face model differs from the configured model"))
        << m;
    EXPECT_TRUE(contains(m, "num_layers: " + std::to_string(reader.spec().num_layers) + " in " +
                                (hf / "config.json").string() + ", 5 configured"))
        << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfInterop, ::testing::ValuesIn(kHfCases),
                         [](const auto& info) { return std::string(info.param.name); });

// config.json written by hand: every field the mapping reads, and the refusals.
TEST(HfConfig, MapsFieldsWithTransformersDefaultsAndRefusesUnsupportedFeatures) {
  ScratchDir dir;
  auto read = [&](const nlohmann::json& j, std::string* model_type = nullptr) {
    write_file(dir / "config.json", j.dump());
    return read_hf_config(dir.path().string(), model_type);
  };
  const nlohmann::json llama = {{"model_type", "llama"},
                                {"hidden_size", 64},
                                {"intermediate_size", 128},
                                {"num_hidden_layers", 3},
                                {"num_attention_heads", 8},
                                {"num_key_value_heads", 2},
                                {"vocab_size", 1000},
                                {"rope_theta", 500000.0},
                                {"rms_norm_eps", 1e-5},
                                {"max_position_embeddings", 4096},
                                {"tie_word_embeddings", true},
                                {"rope_scaling",
                                 {{"rope_type", "llama3"},
                                  {"factor", 8.0},
                                  {"low_freq_factor", 1.0},
                                  {"high_freq_factor", 4.0},
                                  {"original_max_position_embeddings", 8192}}}};
  std::string arch;
  ModelSpec s = read(llama, &arch);
  EXPECT_EQ(arch, "llama");
  EXPECT_EQ(s.hidden, 64);
  EXPECT_EQ(s.ffn, 128);
  EXPECT_EQ(s.num_layers, 3);
  EXPECT_EQ(s.heads, 8);
  EXPECT_EQ(s.kv_heads, 2);
  EXPECT_EQ(s.head_dim, 8);  // hidden_size / heads when head_dim is absent
  EXPECT_EQ(s.vocab_size, 1000);
  EXPECT_EQ(s.rotary_base, 500000.0);
  EXPECT_EQ(s.norm_eps, 1e-5f);
  EXPECT_TRUE(s.tied_embeddings);
  EXPECT_TRUE(s.rope_scaling.enabled);
  EXPECT_EQ(s.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(s.qkv_bias);

  nlohmann::json qwen = llama;
  qwen["model_type"] = "qwen2";
  qwen["use_sliding_window"] = false;
  qwen["sliding_window"] = 4096;  // ignored without use_sliding_window
  qwen.erase("rope_scaling");
  s = read(qwen, &arch);
  EXPECT_EQ(arch, "qwen2");
  EXPECT_TRUE(s.qkv_bias);
  EXPECT_EQ(s.sliding_window, 0);

  nlohmann::json mistral = llama;
  mistral["model_type"] = "mistral";
  mistral["head_dim"] = 16;
  mistral.erase("rope_scaling");
  EXPECT_EQ(read(mistral).sliding_window, 4096);  // MistralConfig's default
  EXPECT_EQ(read(mistral).head_dim, 16);
  mistral["sliding_window"] = nullptr;  // Mistral v0.2+: full attention
  EXPECT_EQ(read(mistral).sliding_window, 0);
  mistral["sliding_window"] = 7;
  EXPECT_EQ(read(mistral).sliding_window, 7);

  // transformers 5 writes rope_parameters (with rope_theta inside) instead.
  nlohmann::json v5 = llama;
  v5["rope_parameters"] = v5["rope_scaling"];
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  const SpecDifferences same = compare_specs(read(v5), read(llama), "config.json");
  EXPECT_TRUE(same.shape.empty() && same.behaviour.empty()) << join_lines(same.behaviour);

  // The written config reads back as the same model, by either spelling of RoPE.
  for (const ModelSpec& spec : {read(llama), read(qwen), read(mistral)}) {
    const nlohmann::ordered_json written = hf_config_json(spec, DType::BF16);
    for (const std::string drop : {"rope_parameters", "rope_scaling"}) {
      nlohmann::ordered_json j = written;
      j.erase(drop);
      if (drop == "rope_scaling") j.erase("rope_theta");
      write_file(dir / "config.json", j.dump());
      const SpecDifferences d =
          compare_specs(read_hf_config(dir.path().string()), spec, "config.json");
      EXPECT_TRUE(d.shape.empty() && d.behaviour.empty())
          << "without " << drop << ": " << join_lines(d.shape) << join_lines(d.behaviour);
    }
  }

  const std::string file = (dir / "config.json").string();
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> refusals = {
      {[](auto& j) { j["model_type"] = "gpt2"; },
       ": model_type 'gpt2' is not supported; expected " + hf_model_type_names()},
      {[](auto& j) { j["attention_bias"] = true; },
       ": attention_bias: true (Llama's bias includes o_proj) is not supported"},
      {[](auto& j) { j["hidden_act"] = "gelu"; },
       ": hidden_act 'gelu' (expected silu) is not supported"},
      {[](auto& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       },
       "RoPE type 'yarn' (expected llama3 or default) is not supported"},
      {[](auto& j) { j.erase("hidden_size"); }, ": field 'hidden_size' is missing"},
      {[](auto& j) { j["num_key_value_heads"] = 3; }, ": inconsistent sizes"},
      {[](auto& j) {
         j["model_type"] = "qwen2";
         j["use_sliding_window"] = true;
       },
       "use_sliding_window: true"},
  };
  for (const auto& [edit, expected] : refusals) {
    nlohmann::json j = llama;
    edit(j);
    try {
      read(j);
      ADD_FAILURE() << "accepted: " << expected;
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), file + expected) || contains(e.what(), expected)) << e.what();
      EXPECT_TRUE(contains(e.what(), file)) << e.what();
    }
  }
}

TEST(HfWeights, RoundTripFusesAndShardsAndRefusesBadTensors) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  auto trainer = make_trainer(case_experiment(dir.path(), kHfCases[1]), log);  // qwen: bias, tied
  const ModelSpec& spec = trainer->spec();
  const std::vector<float> master = download(trainer->backend(), trainer->optimizer().master());
  const auto weights = [&](const ParamInfo& p) {
    return std::vector<float>(master.begin() + p.offset, master.begin() + p.offset + p.numel());
  };
  const fs::path hf = dir / "hf";
  write_hf_model(hf.string(), spec, weights, {DType::F32, 16 * 1024});
  EXPECT_FALSE(fs::exists(dir / "hf.tmp"));
  const auto index = nlohmann::json::parse(read_file(hf / "model.safetensors.index.json"));
  EXPECT_EQ(
      index["weight_map"]["model.layers.1.self_attn.k_proj.bias"].get<std::string>().substr(0, 6),
      "model-");
  EXPECT_FALSE(index["weight_map"].contains("lm_head.weight"));  // tied
  const HfModelReader reader(hf.string());
  for (const ParamInfo& p : reader.layout().params)
    EXPECT_EQ(reader.weights(p), weights(p)) << p.name;

  // One file, bf16: values rounded to nearest-even.
  const fs::path single = dir / "single";
  write_hf_model(single.string(), spec, weights, {DType::BF16, 1ull << 40});
  const SafetensorsFile f((single / "model.safetensors").string());
  const ParamInfo& qkv = *reader.layout().find("model.layers.0.self_attn.qkv_proj.weight");
  const std::vector<float> k = f.to_float("model.layers.0.self_attn.k_proj.weight");
  const int64_t q_rows = spec.heads * spec.head_dim;
  for (size_t i = 0; i < k.size(); ++i)
    ASSERT_EQ(k[i], round_to_bf16(master[qkv.offset + q_rows * spec.hidden + i])) << i;

  // Damaged directories: each refusal names the file and tensor.
  const auto error = [](const fs::path& d) -> std::string {
    try {
      HfModelReader r(d.string());
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no error)";
  };
  std::vector<SafetensorsTensor> tensors = f.tensors();
  std::erase_if(tensors,
                [](const auto& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
  write_safetensors((single / "model.safetensors").string(), tensors);
  EXPECT_TRUE(contains(error(single),
                       "tensor 'model.layers.1.mlp.up_proj.weight' is missing; expected [40, 32]"))
      << error(single);
  const SafetensorsFile again((single / "model.safetensors").string());
  tensors = again.tensors();
  tensors.push_back({"model.layers.0.mlp.gate_proj.bias", DType::F32, {40}, master.data()});
  tensors.push_back({"model.layers.1.mlp.up_proj.weight", DType::F32, {32, 40}, master.data()});
  write_safetensors((single / "model.safetensors").string(), tensors);
  EXPECT_TRUE(contains(error(single),
                       "single/model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has "
                       "shape [32, 40]; expected [40, 32]"))
      << error(single);
  tensors.back().shape = {40, 32};
  write_safetensors((single / "model.safetensors").string(), tensors);
  EXPECT_TRUE(contains(error(single),
                       "tensor 'model.layers.0.mlp.gate_proj.bias' has no place in the model"))
      << error(single);
  fs::remove(hf / index["weight_map"]["model.norm.weight"].get<std::string>());
  EXPECT_TRUE(contains(error(hf), ": missing; ")) << error(hf);
  EXPECT_TRUE(contains(error(dir / "nothing"), "config.json: missing")) << error(dir / "nothing");
}

// The MoE families' config.json: transformers' defaults and Qwen3-MoE's layer rule on reading,
// and on export the features MixtralForCausalLM and Qwen3MoeForCausalLM cannot hold.
TEST(HfMoeConfig, ReadsQwen3SparseLayersAndRefusesWhatTheArchitecturesLack) {
  const nlohmann::json qwen = {
      {"model_type", "qwen3_moe"}, {"hidden_size", 32},        {"num_hidden_layers", 4},
      {"num_attention_heads", 4},  {"num_key_value_heads", 2}, {"head_dim", 16},
      {"vocab_size", 96},          {"intermediate_size", 40},  {"moe_intermediate_size", 16},
      {"num_experts", 8},          {"num_experts_per_tok", 2}, {"decoder_sparse_step", 2}};
  const ModelSpec q = model_family("qwen3_moe").read_hf_config(qwen, "config.json");
  EXPECT_EQ(q.moe.layers, (std::vector<bool>{false, true, false, true}));  // (l + 1) % 2 == 0
  EXPECT_TRUE(q.moe.pre_softmax) << "norm_topk_prob defaults to false: no renormalisation";
  EXPECT_TRUE(q.qk_norm);
  EXPECT_EQ(q.moe.ffn, 16);
  EXPECT_EQ(q.ffn, 40);
  nlohmann::json dense_listed = qwen;
  dense_listed["decoder_sparse_step"] = 1;
  dense_listed["mlp_only_layers"] = {0, 2};
  dense_listed["norm_topk_prob"] = true;
  const ModelSpec d = model_family("qwen3_moe").read_hf_config(dense_listed, "config.json");
  EXPECT_EQ(d.moe.layers, (std::vector<bool>{false, true, false, true}));
  EXPECT_FALSE(d.moe.pre_softmax);
  const nlohmann::json mixtral = {{"model_type", "mixtral"}, {"hidden_size", 32},
                                  {"num_hidden_layers", 2},  {"num_attention_heads", 4},
                                  {"vocab_size", 96},        {"intermediate_size", 24},
                                  {"num_local_experts", 4},  {"num_experts_per_tok", 2}};
  const ModelSpec m = model_family("mixtral").read_hf_config(mixtral, "config.json");
  EXPECT_EQ(m.moe.layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(m.kv_heads, 4);
  EXPECT_DOUBLE_EQ(m.rotary_base, 1e6);  // MixtralConfig's default
  nlohmann::json missing = mixtral;
  missing.erase("num_local_experts");
  try {
    model_family("mixtral").read_hf_config(missing, "config.json");
    ADD_FAILURE() << "accepted";
  } catch (const DataError& e) {
    EXPECT_TRUE(contains(e.what(), "field 'num_local_experts' is missing")) << e.what();
  }
  struct Refusal {
    const char* family;
    std::function<void(ModelSpec&)> change;
    const char* says;
  };
  for (const Refusal& r : std::vector<Refusal>{
           {"mixtral", [](ModelSpec& s) { s.moe.shared_ffn = 8; }, "a shared expert"},
           // Which Hugging Face classes hold dense layers, and so which model to train instead.
           {"mixtral", [](ModelSpec& s) { s.moe.layers[1] = false; }, "dense layers"},
           {"mixtral", [](ModelSpec& s) { s.moe.layers[1] = false; },
            "Qwen3MoeForCausalLM, mlp_only_layers: Tessera's model_family qwen3_moe"},
           {"mixtral", [](ModelSpec& s) { s.moe.layers[1] = false; }, "first_k_dense_replace"},
           {"qwen3_moe", [](ModelSpec& s) { s.moe.sigmoid = true; }, "sigmoid routing"},
           {"qwen3_moe", [](ModelSpec& s) { s.moe.num_groups = 2; }, "group-limited routing"}}) {
    ModelSpec s = std::string(r.family) == "mixtral" ? m : q;
    s.family = r.family;
    r.change(s);
    try {
      model_family(r.family).hf_config(s);
      ADD_FAILURE() << r.says << " exported";
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), r.says)) << e.what();
    }
  }
}

// The exported config.json carries the run's values: Mixtral's and Qwen3-MoE's
// router_aux_loss_coef is moe_aux_loss_coeff, every family's initializer_range is
// init_method_std, also through a checkpoint's description of its model.
TEST(HfConfig, CarriesTheRunsAuxLossWeightAndInitializerRange) {
  for (const char* family : {"mixtral", "qwen3_moe"}) {
    ModelSpec s;
    s.family = family;
    s.vocab_size = s.tokenizer_vocab = 96;
    s.num_layers = 2, s.hidden = 32, s.ffn = 48, s.heads = 4, s.kv_heads = 2, s.head_dim = 8;
    s.qk_norm = std::string(family) == "qwen3_moe";
    s.moe.experts = 4, s.moe.topk = 2, s.moe.ffn = 24, s.moe.layers = {true, true};
    s.moe.aux_loss_coeff = 0.01;
    s.init_std = 0.008f;
    s.max_position_embeddings = 64;
    const ModelSpec from_checkpoint = spec_from_json(spec_to_json(s), "model.json");
    const nlohmann::ordered_json j = model_family(family).hf_config(from_checkpoint);
    EXPECT_DOUBLE_EQ(j["router_aux_loss_coef"].get<double>(), 0.01) << family;
    EXPECT_DOUBLE_EQ(j["initializer_range"].get<double>(), 0.008) << family;
  }
  ModelSpec llama;
  llama.vocab_size = llama.tokenizer_vocab = 96;
  llama.num_layers = 2, llama.hidden = 32, llama.ffn = 48, llama.heads = 4, llama.kv_heads = 2;
  llama.head_dim = 8;
  llama.init_std = 0.008f;
  llama.max_position_embeddings = 64;
  const nlohmann::ordered_json j =
      model_family("llama").hf_config(spec_from_json(spec_to_json(llama), "model.json"));
  EXPECT_DOUBLE_EQ(j["initializer_range"].get<double>(), 0.008);
}

// A checkpoint's model.json whose family cannot build what it describes (a Qwen3 or OLMo 2
// model without QK norms) is refused naming the file and the problem.
TEST(ModelSpecJson, ADescriptionItsFamilyCannotBuildNamesTheFile) {
  for (const char* family : {"qwen3", "olmo2"}) {
    ModelSpec s;
    s.family = family;
    s.vocab_size = s.tokenizer_vocab = 96;
    s.num_layers = 2, s.hidden = 32, s.ffn = 48, s.heads = 4, s.kv_heads = 2, s.head_dim = 8;
    s.max_position_embeddings = 64;
    s.qk_norm = false;
    try {
      spec_from_json(spec_to_json(s), "iter_0000004/model.json");
      ADD_FAILURE() << family << " loaded";
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), "iter_0000004/model.json: the model description is "
                                     "inconsistent: model_family " +
                                         std::string(family) + " without qk_layernorm"))
          << e.what();
    }
  }
}

// DeepseekV3Config: transformers' defaults and YaRN on reading, the features Tessera cannot run
// the way transformers does refused on reading and on export, DeepSeek-V3's expert bias accepted
// only at its initial zeros, and a checkpoint whose trained expert bias cannot be exported.
TEST(HfDeepseekConfig, ReadsDeepseekV3AndRefusesWhatEitherSideLacks) {
  const ModelFamily& family = model_family("deepseek");
  const nlohmann::json v3 = {{"model_type", "deepseek_v3"},
                             {"hidden_size", 64},
                             {"num_hidden_layers", 4},
                             {"num_attention_heads", 4},
                             {"vocab_size", 96},
                             {"q_lora_rank", nullptr},
                             {"n_routed_experts", 8},
                             {"num_experts_per_tok", 4},
                             {"moe_intermediate_size", 16},
                             {"first_k_dense_replace", 2},
                             {"n_group", 4},
                             {"topk_group", 2},
                             {"max_position_embeddings", 256},
                             {"rope_scaling",
                              {{"type", "yarn"},
                               {"factor", 4},
                               {"original_max_position_embeddings", 64},
                               {"mscale", 0.707},
                               {"mscale_all_dim", 0.707}}}};
  const ModelSpec s = family.read_hf_config(v3, "config.json");
  EXPECT_EQ(s.mla.q_lora_rank, 0);  // null: queries projected directly
  EXPECT_EQ(s.mla.kv_lora_rank, 512);
  EXPECT_EQ(s.mla.qk_head_dim, 128);
  EXPECT_EQ(s.head_dim, 64);  // the RoPE part, as DeepseekV3Config sets head_dim
  EXPECT_EQ(s.kv_heads, 4);
  EXPECT_EQ(s.moe.layers, (std::vector<bool>{false, false, true, true}));
  EXPECT_EQ(s.moe.shared_ffn, 16);  // n_shared_experts 1 x moe_intermediate_size
  EXPECT_TRUE(s.moe.sigmoid);
  EXPECT_TRUE(s.moe.expert_bias);
  EXPECT_EQ(s.moe.num_groups, 4);
  EXPECT_EQ(s.moe.group_topk, 2);
  EXPECT_DOUBLE_EQ(s.moe.topk_scaling, 2.5);
  EXPECT_TRUE(s.yarn.enabled);
  EXPECT_DOUBLE_EQ(s.yarn.factor, 4);
  EXPECT_DOUBLE_EQ(s.yarn.mscale_all_dim, 0.707);
  EXPECT_DOUBLE_EQ(s.rotary_base, 10000);
  // The export holds what was read.
  const nlohmann::ordered_json out = family.hf_config(s);
  EXPECT_EQ(out["architectures"][0], "DeepseekV3ForCausalLM");
  EXPECT_TRUE(out["q_lora_rank"].is_null());
  EXPECT_EQ(out["first_k_dense_replace"], 2);
  EXPECT_EQ(out["n_shared_experts"], 1);
  EXPECT_EQ(out["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(out["rope_scaling"]["type"], "yarn");
  EXPECT_EQ(family.read_hf_config(nlohmann::json::parse(out.dump()), "out").moe.layers,
            s.moe.layers);

  struct Bad {
    std::function<void(nlohmann::json&)> change;
    const char* says;
  };
  for (const Bad& b : std::vector<Bad>{
           {[](nlohmann::json& j) { j["rope_interleave"] = false; }, "rope_interleave: false"},
           {[](nlohmann::json& j) { j["num_key_value_heads"] = 2; }, "num_key_value_heads 2"},
           {[](nlohmann::json& j) { j["topk_group"] = 1; }, "top 2"},
           {[](nlohmann::json& j) { j["norm_topk_prob"] = false; }, "norm_topk_prob false"},
           {[](nlohmann::json& j) { j["rope_scaling"]["type"] = "dynamic"; },
            "RoPE type 'dynamic'"},
           {[](nlohmann::json& j) { j["rope_scaling"].erase("mscale"); },
            "mscale_all_dim 0.707 without mscale"},
           {[](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "hidden_act 'gelu'"},
           {[](nlohmann::json& j) { j["qk_rope_head_dim"] = 7; }, "inconsistent sizes"},
           {[](nlohmann::json& j) { j["n_group"] = 8, j["topk_group"] = 2; },
            "inconsistent sizes"}}) {  // 2 groups of one expert cannot supply 4
    nlohmann::json j = v3;
    b.change(j);
    try {
      family.read_hf_config(j, "config.json");
      ADD_FAILURE() << b.says << " accepted";
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), b.says)) << e.what();
    }
  }
  struct Refusal {
    std::function<void(ModelSpec&)> change;
    const char* says;
  };
  for (const Refusal& r : std::vector<Refusal>{
           {[](ModelSpec& m) {
              m.moe.layers = {true, false, true, true};
            },
            "a dense layer after"},
           {[](ModelSpec& m) { m.moe.shared_ffn = 24; }, "a shared expert of width 24"},
           {[](ModelSpec& m) { m.moe.group_topk = 1; }, "group-limited routing with top-4"},
           {[](ModelSpec& m) { m.yarn.mscale = 0.5, m.yarn.mscale_all_dim = 0; }, "YaRN mscale"},
           {[](ModelSpec& m) { m.sliding_window = 8; }, "a sliding window"}}) {
    ModelSpec m = s;
    r.change(m);
    try {
      family.hf_config(m);
      ADD_FAILURE() << r.says << " exported";
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), r.says)) << e.what();
    }
  }
  // A model configured without the expert bias still exports as V3 (its bias is zero).
  ModelSpec no_bias = s;
  no_bias.moe.expert_bias = false;
  EXPECT_EQ(family.hf_model_type(no_bias), "deepseek_v3");
  EXPECT_EQ(family.hf_state(no_bias).size(), 2u);  // layers 2 and 3
}

// DeepseekV2Config: DeepSeek-V2-Lite's config.json as published, transformers' defaults for V2
// (not V3's), softmax routing; the keys whose values Tessera cannot run as transformers does are
// refused by name (exit 2), and what DeepseekV2ForCausalLM cannot hold is refused on export.
TEST(HfDeepseekConfig, ReadsDeepseekV2AndRefusesWhatEitherSideLacks) {
  const ModelFamily& family = model_family("deepseek");
  const nlohmann::json lite = {{"architectures", {"DeepseekV2ForCausalLM"}},
                               {"model_type", "deepseek_v2"},
                               {"hidden_size", 2048},
                               {"intermediate_size", 10944},
                               {"moe_intermediate_size", 1408},
                               {"num_hidden_layers", 27},
                               {"num_attention_heads", 16},
                               {"num_key_value_heads", 16},
                               {"vocab_size", 102400},
                               {"q_lora_rank", nullptr},
                               {"kv_lora_rank", 512},
                               {"qk_nope_head_dim", 128},
                               {"qk_rope_head_dim", 64},
                               {"v_head_dim", 128},
                               {"n_routed_experts", 64},
                               {"n_shared_experts", 2},
                               {"num_experts_per_tok", 6},
                               {"first_k_dense_replace", 1},
                               {"moe_layer_freq", 1},
                               {"n_group", 1},
                               {"topk_group", 1},
                               {"topk_method", "greedy"},
                               {"scoring_func", "softmax"},
                               {"norm_topk_prob", false},
                               {"routed_scaling_factor", 1.0},
                               {"aux_loss_alpha", 0.001},
                               {"seq_aux", true},
                               {"max_position_embeddings", 163840},
                               {"rms_norm_eps", 1e-6},
                               {"rope_theta", 10000},
                               {"rope_scaling",
                                {{"type", "yarn"},
                                 {"factor", 40},
                                 {"original_max_position_embeddings", 4096},
                                 {"beta_fast", 32},
                                 {"beta_slow", 1},
                                 {"mscale", 0.707},
                                 {"mscale_all_dim", 0.707}}},
                               {"tie_word_embeddings", false}};
  ModelSpec s = family.read_hf_config(lite, "config.json");
  s.family = "deepseek";  // as read_hf_config(dir) sets it
  // The same model as the deepseek_v2_lite preset (every key that shapes or routes it).
  LoadOptions o;
  o.config_path = "deepseek_v2_lite-pretrain";
  o.data_parallel_size = 8;  // its experts spread over a node's 8 GPUs
  const ModelSpec preset = make_model_spec(load_experiment(o), 102400);
  const SpecDifferences d = compare_specs(s, preset, "config.json");
  EXPECT_TRUE(d.shape.empty()) << join_lines(d.shape);
  EXPECT_TRUE(d.behaviour.empty()) << join_lines(d.behaviour);
  EXPECT_EQ(s.mla.q_lora_rank, 0);
  EXPECT_EQ(s.moe.layers[0], false);
  EXPECT_EQ(s.moe.layers[1], true);
  EXPECT_EQ(s.moe.shared_ffn, 2816);
  EXPECT_FALSE(s.moe.sigmoid);
  EXPECT_TRUE(s.moe.pre_softmax);
  EXPECT_FALSE(s.moe.expert_bias);
  EXPECT_EQ(s.moe.num_groups, 0);
  EXPECT_EQ(s.moe.topk_scaling, 0.0);  // routed_scaling_factor 1: unscaled
  EXPECT_TRUE(family.hf_state(s).empty()) << "DeepseekV2Moe has no e_score_correction_bias";
  // The preset exports as DeepseekV2ForCausalLM, and reads back as itself.
  EXPECT_EQ(family.hf_model_type(preset), "deepseek_v2");
  const nlohmann::ordered_json out = family.hf_config(preset);
  EXPECT_EQ(out["architectures"][0], "DeepseekV2ForCausalLM");
  EXPECT_EQ(out["topk_method"], "greedy");
  EXPECT_EQ(out["norm_topk_prob"], false);
  EXPECT_EQ(out["routed_scaling_factor"], 1.0);
  EXPECT_EQ(out["n_shared_experts"], 2);
  EXPECT_EQ(out["first_k_dense_replace"], 1);
  EXPECT_TRUE(out["q_lora_rank"].is_null());
  EXPECT_FALSE(out.contains("rope_interleave"));
  ModelSpec back = family.read_hf_config(nlohmann::json::parse(out.dump()), "out");
  back.family = "deepseek";
  EXPECT_TRUE(compare_specs(back, preset, "out").shape.empty());
  EXPECT_TRUE(compare_specs(back, preset, "out").behaviour.empty());

  // DeepseekV2Config's defaults where V3's differ: first_k_dense_replace 0, two shared experts,
  // 64 experts, unscaled greedy routing.
  nlohmann::json minimal = {
      {"model_type", "deepseek_v2"}, {"hidden_size", 64}, {"num_hidden_layers", 2},
      {"num_attention_heads", 4},    {"vocab_size", 96},  {"num_experts_per_tok", 2}};
  const ModelSpec m = family.read_hf_config(minimal, "config.json");
  EXPECT_EQ(m.moe.layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(m.moe.experts, 64);
  EXPECT_EQ(m.moe.ffn, 1407);
  EXPECT_EQ(m.moe.shared_ffn, 2 * 1407);
  EXPECT_EQ(m.mla.q_lora_rank, 1536);
  EXPECT_EQ(m.ffn, 11008);
  EXPECT_TRUE(m.moe.pre_softmax);
  EXPECT_EQ(m.moe.topk_scaling, 0.0);
  // group_limited_greedy: groups scored by their best expert, as Tessera does when each kept
  // group supplies one expert.
  nlohmann::json grouped = lite;
  grouped["topk_method"] = "group_limited_greedy";
  grouped["n_group"] = 8;
  grouped["topk_group"] = 6;
  grouped["routed_scaling_factor"] = 16.0;
  const ModelSpec g = family.read_hf_config(grouped, "config.json");
  EXPECT_EQ(g.moe.num_groups, 8);
  EXPECT_EQ(g.moe.group_topk, 6);
  EXPECT_DOUBLE_EQ(g.moe.topk_scaling, 16.0);
  const nlohmann::ordered_json g_out = family.hf_config(g);
  EXPECT_EQ(g_out["topk_method"], "group_limited_greedy");
  EXPECT_EQ(g_out["n_group"], 8);
  EXPECT_EQ(g_out["topk_group"], 6);
  EXPECT_EQ(g_out["routed_scaling_factor"], 16.0);

  struct Bad {
    std::function<void(nlohmann::json&)> change;
    const char* says;
  };
  for (const Bad& b : std::vector<Bad>{
           {[](nlohmann::json& j) { j["topk_method"] = "noaux_tc"; },
            "key 'topk_method' has value 'noaux_tc': expected \"greedy\" or "
            "\"group_limited_greedy\""},
           {[](nlohmann::json& j) { j["topk_method"] = nullptr; },
            "key 'topk_method' has value 'null'"},
           // DeepSeek-V2's own: 6 experts in 3 of 8 groups, each group scored by its best one.
           {[](nlohmann::json& j) {
              j["topk_method"] = "group_limited_greedy", j["n_group"] = 8, j["topk_group"] = 3;
            },
            "key 'topk_group' has value '3': expected num_experts_per_tok (6)"},
           {[](nlohmann::json& j) {
              j["topk_method"] = "group_limited_greedy", j["n_group"] = nullptr;
            },
            "key 'n_group' has value 'null'"},
           {[](nlohmann::json& j) { j["norm_topk_prob"] = true; },
            "key 'norm_topk_prob' has value 'true': expected false"},
           {[](nlohmann::json& j) { j["scoring_func"] = "sigmoid"; },
            "key 'scoring_func' has value 'sigmoid'"},
           {[](nlohmann::json& j) { j["moe_layer_freq"] = 2; },
            "key 'moe_layer_freq' has value '2': expected 1"},
           {[](nlohmann::json& j) { j["n_shared_experts"] = 0; },
            "key 'n_shared_experts' has value '0': expected at least 1"},
           {[](nlohmann::json& j) { j["mlp_bias"] = true; }, "key 'mlp_bias' has value 'true'"}}) {
    nlohmann::json j = lite;
    b.change(j);
    try {
      family.read_hf_config(j, "config.json");
      ADD_FAILURE() << b.says << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(contains(e.what(), std::string("config.json: ") + b.says)) << e.what();
      EXPECT_TRUE(contains(e.what(), "for Tessera's deepseek_v2 model")) << e.what();
    }
  }
  nlohmann::json missing = minimal;
  missing.erase("num_experts_per_tok");
  EXPECT_THROW(family.read_hf_config(missing, "config.json"), DataError);

  struct Refusal {
    std::function<void(ModelSpec&)> change;
    const char* says;
  };
  for (const Refusal& r : std::vector<Refusal>{
           {[](ModelSpec& x) { x.moe.pre_softmax = false; },
            "DeepseekV2ForCausalLM (deepseek) cannot hold softmax weights renormalised"},
           {[](ModelSpec& x) { x.moe.shared_ffn = 0; }, "without a shared expert"},
           {[](ModelSpec& x) { x.moe.num_groups = 8, x.moe.group_topk = 3; },
            "group-limited routing with top-6 in 3 groups"},
           {[](ModelSpec& x) { x.moe.layers[5] = false; }, "a dense layer after"}}) {
    ModelSpec x = preset;
    r.change(x);
    try {
      family.hf_config(x);
      ADD_FAILURE() << r.says << " exported";
    } catch (const DataError& e) {
      EXPECT_TRUE(contains(e.what(), r.says)) << e.what();
    }
  }
}

// Through the command line: a refused key exits 2, naming config.json, the key and its value.
TEST(HfDeepseekConfig, RefusedDeepseekV2KeyExitsTwoNamingIt) {
  ScratchDir dir;
  const fs::path hf = dir / "hf";
  ASSERT_EQ(python("make deepseek_v2 " + hf.string() + " F32 1").exit_code, 0);
  auto config = nlohmann::json::parse(read_file(hf / "config.json"));
  config["topk_method"] = "noaux_tc";
  write_file(hf / "config.json", config.dump(2));
  const RunResult r =
      run_tessera("convert --from-hf " + hf.string() + " --to " + (dir / "ckpt").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output,
                       (hf / "config.json").string() + ": key 'topk_method' has value 'noaux_tc'"))
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "ckpt"));
}

std::vector<float> bias_in(const fs::path& file, int layer) {
  return SafetensorsFile(file.string())
      .to_float(fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", layer));
}

// DeepSeek-V3's e_score_correction_bias is the MoE layers' expert bias: imported into the model
// state (--check-logits, weights-only checkpoints, hf_init_path) and exported from it, in fp32,
// exactly; the routing it changes matches the reference (HfInterop's deepseek_v3 case).
TEST(HfDeepseekConfig, ExpertBiasRoundTripsExactlyAndRoutesTheModel) {
  ScratchDir dir;
  const fs::path hf = dir / "hf";
  ASSERT_EQ(python("make deepseek_v3 " + hf.string() + " F32 1").exit_code, 0);
  const HfModelReader reader(hf.string());
  for (int l : {1, 2}) {
    const std::vector<float> bias = bias_in(hf / "model.safetensors", l);
    ASSERT_TRUE(std::any_of(bias.begin(), bias.end(), [](float v) { return v != 0.0f; }));
    EXPECT_EQ(reader.state(fmt::format("model.layers.{}.mlp.router.expert_bias", l)), bias);
  }
  EXPECT_TRUE(reader.state("model.layers.0.mlp.router.expert_bias").empty());  // a dense layer

  // HF -> HF (bf16 weights) and HF -> weights-only checkpoint -> HF: the bias bit for bit, F32.
  const fs::path again = dir / "again", ckpt = dir / "ckpt", back = dir / "back";
  RunResult r = run_tessera("convert --from-hf " + hf.string() + " --to-hf " + again.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("convert --from-hf " + hf.string() + " --to " + ckpt.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("convert --from " + ckpt.string() + " --to-hf " + back.string() +
                  " --shard-size 20KB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto index = nlohmann::json::parse(read_file(back / "model.safetensors.index.json"));
  for (int l : {1, 2}) {
    const std::string name = fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", l);
    const SafetensorsFile exported((again / "model.safetensors").string());
    ASSERT_NE(exported.find(name), nullptr) << name;
    EXPECT_EQ(exported.find(name)->dtype, DType::F32) << name;
    EXPECT_EQ(bias_in(again / "model.safetensors", l), bias_in(hf / "model.safetensors", l));
    EXPECT_EQ(bias_in(back / index["weight_map"][name].get<std::string>(), l),
              bias_in(hf / "model.safetensors", l));
  }

  // The bias routes the model: zeroing it changes the logits (and the reference agrees with
  // the biased ones: HfInterop.*deepseek_v3).
  const fs::path tokens = write_tokens(dir.path());
  r = run_tessera("convert --from-hf " + hf.string() + " --check-logits " + tokens.string() +
                  " --out " + (dir / "biased.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("convert --from " + ckpt.string() + " --check-logits " + tokens.string() +
                  " --out " + (dir / "via_ckpt.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(relative_error(dir / "via_ckpt.safetensors", dir / "biased.safetensors", "logits"),
            0.0);
  {
    const SafetensorsFile file((hf / "model.safetensors").string());
    std::vector<std::vector<float>> values;
    std::vector<SafetensorsTensor> tensors;
    for (const auto& t : file.tensors()) {
      values.push_back(file.to_float(t.name));
      if (t.name.ends_with("e_score_correction_bias"))
        std::fill(values.back().begin(), values.back().end(), 0.0f);
    }
    size_t i = 0;
    for (const auto& t : file.tensors())
      tensors.push_back({t.name, DType::F32, t.shape, values[i++].data()});
    fs::create_directories(dir / "unbiased");
    fs::copy_file(hf / "config.json", dir / "unbiased" / "config.json");
    write_safetensors((dir / "unbiased" / "model.safetensors").string(), tensors);
  }
  r = run_tessera("convert --from-hf " + (dir / "unbiased").string() + " --check-logits " +
                  tokens.string() + " --out " + (dir / "unbiased.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GT(relative_error(dir / "unbiased.safetensors", dir / "biased.safetensors", "logits"),
            1e-3);

  // hf_init_path puts the bias into the model's state; a model configured without an expert
  // bias refuses it rather than drop it.
  const HfCase& c = kHfCases[std::size(kHfCases) - 2];
  ASSERT_EQ(std::string(c.name), "deepseek_v3");
  Logger log("", 0, false, false);
  {
    auto trainer =
        make_trainer(case_experiment(dir.path(), c, "hf_init_path: " + hf.string() + "\n"), log);
    const auto state = trainer->model().persistent_state();
    ASSERT_EQ(state.size(), 2u);
    for (const auto& [name, tensor] : state)
      EXPECT_EQ(download(trainer->backend(), tensor), reader.state(name)) << name;
  }
  try {
    make_trainer(case_experiment(
                     dir.path(), c,
                     "moe_router_enable_expert_bias: false\nhf_init_path: " + hf.string() + "\n"),
                 log);
    ADD_FAILURE() << "a trained expert bias was dropped";
  } catch (const DataError& e) {
    EXPECT_TRUE(contains(e.what(),
                         "'model.layers.1.mlp.gate.e_score_correction_bias' (a trained "
                         "expert bias) is not zero"))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "moe_router_enable_expert_bias: true")) << e.what();
  }

  // Training moves the bias; the export writes the checkpoint's values exactly.
  const std::string save = (dir / "trained").string();
  // (An odd number of steps: each step moves every expert's bias by +-0.01 or 0, so two
  // steps may return it to zero.)
  make_trainer(case_experiment(dir.path(), c, "train_iters: 3\nsave: " + save + "\n"), log)
      ->train();
  r = run_tessera("convert --from " + save + " --to-hf " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Checkpoint trained(find_latest_checkpoint(save));
  for (int l : {1, 2}) {
    const std::vector<float> moved =
        trained.optimizer_values(fmt::format("model.layers.{}.mlp.router.expert_bias", l));
    EXPECT_TRUE(std::any_of(moved.begin(), moved.end(), [](float v) { return v != 0.0f; }))
        << fmt::format("{}", fmt::join(moved, ", "));
    EXPECT_EQ(bias_in(dir / "out" / "model.safetensors", l), moved);
  }
}

TEST(ConvertCli, RefusesToOverwriteAndNamesMissingInputs) {
  ScratchDir dir;
  fs::create_directories(dir / "busy");
  write_file(dir / "busy" / "keep.txt", "precious");
  write_file(dir / "config.json", "{}");
  RunResult r = run_tessera("convert --from-hf " + dir.path().string() + " --to-hf " +
                            (dir / "busy").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "a new or empty directory")) << r.output;
  EXPECT_EQ(read_file(dir / "busy" / "keep.txt"), "precious");
  r = run_tessera("convert --from " + (dir / "none").string() + " --to-hf " +
                  (dir / "out").string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "no checkpoint here")) << r.output;
  r = run_tessera("convert --from x --from-hf y --to z");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_tessera("convert --from x --to-hf y --shard-size lots");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "a size such as 5GB")) << r.output;
  EXPECT_EQ(run_tessera("convert --help").exit_code, 0);
}

TEST(ConvertCli, UnusableOutputLocationsExitTwoBeforeTheSourceIsRead) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const std::string save = (dir / "ckpt").string();
  make_trainer(tiny_experiment(dir.path(), "save: " + save + "\n"), log)->train();
  write_file(dir / "notes.txt", "precious");
  write_file(dir / "tokens.txt", "1 2 3\n");
  const std::set<std::string> before = listing(dir.path());
  const std::string file = (dir / "notes.txt").string();
  const std::string under_file = " is a regular file, not a directory)";
  struct Case {
    std::string args, says;
  } cases[] = {
      {"--to-hf " + file + "/out", "key 'to-hf' has value '" + file +
                                       "/out': expected a directory that can be created and " +
                                       "written (" + file + under_file},
      {"--to-hf " + file, "key 'to-hf' has value '" + file + "'"},
      {"--to " + file + "/out/ckpt", "key 'to' has value '" + file + "/out/ckpt'"},
      {"--check-logits " + (dir / "tokens.txt").string() + " --out " + file + "/logits.st",
       "key 'out' has value '" + file + "/logits.st': expected a file that can be written (" +
           file + under_file},
  };
  for (const Case& c : cases) {
    const RunResult r = run_tessera("convert --from " + save + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error: command line: " + c.says)) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, under_file)) << c.args << "\n" << r.output;
    EXPECT_EQ(listing(dir.path()), before) << c.args;
  }
  EXPECT_EQ(read_file(dir / "notes.txt"), "precious");
  // Checked before the source is opened: a missing one would give exit code 3.
  RunResult r =
      run_tessera("convert --from " + (dir / "nowhere").string() + " --to-hf " + file + "/out");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  // "out/" names the directory "out": the export lands there, with no OUT.tmp left beside it.
  r = run_tessera("convert --from " + save + " --to-hf " + (dir / "hf").string() + "/");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "hf" / "config.json"));
  EXPECT_FALSE(fs::exists(dir / "hf.tmp"));
  EXPECT_FALSE(fs::exists(dir / "hf" / ".tmp"));
}

}  // namespace
}  // namespace tessera::testing
