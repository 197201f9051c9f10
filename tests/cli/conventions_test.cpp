// The command-line conventions of Megatron, Primus and torchtitan users, end to end through the
// tessera binary: the usage lists what main() dispatches, every command takes dashed names and
// --key=value, train --help shows defaults and presets, Primus experiment files train, and launch
// refuses a machine without GPUs before writing anything.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/cli/commands.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::set<fs::path> files_under(const fs::path& dir) {
  std::set<fs::path> out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) out.insert(f.path());
  return out;
}

// The usage is printed from the dispatch table (cli/commands.h), so the two cannot drift: every
// command and benchmark appears once, under its parent, and each name dispatches (--help exits 0).
TEST(CliConventions, UsageListsEveryCommandOfTheDispatchTable) {
  for (const std::string& call : {std::string(""), std::string("--help")}) {
    const RunResult r = run_tessera(call);
    EXPECT_EQ(r.exit_code, call.empty() ? 2 : 0);
    // "  name   summary" lists a command; "                 name   summary" a subcommand.
    std::multiset<std::string> top, bench;
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) {
      const size_t indent = line.find_first_not_of(' ');
      if (indent == std::string::npos || line.starts_with("usage") || line.starts_with("`"))
        continue;
      const std::string word = line.substr(indent, line.find(' ', indent) - indent);
      if (indent == 2) top.insert(word);
      if (indent == 17) bench.insert(word);
    }
    std::multiset<std::string> table, bench_table;
    for (const cli::Command& c : cli::commands()) table.insert(c.name);
    for (const cli::Command& c : cli::bench_commands()) bench_table.insert(c.name);
    EXPECT_EQ(top, table) << r.output;
    EXPECT_EQ(bench, bench_table) << r.output;
    for (const char* name : {"generate", "tokenizer"})
      EXPECT_TRUE(top.contains(name) || bench.contains(name)) << name;
  }
  for (const cli::Command& c : cli::commands()) {
    EXPECT_EQ(run_tessera(std::string(c.name) + " --help").exit_code, 0) << c.name;
    if (c.subcommands)
      for (const cli::Command& s : c.subcommands())
        EXPECT_EQ(run_tessera(std::string(c.name) + " " + s.name + " --help").exit_code, 0)
            << c.name << " " << s.name;
  }
  const RunResult bench = run_tessera("bench --help");
  for (const cli::Command& s : cli::bench_commands()) EXPECT_TRUE(has(bench.output, s.name));
}

// Each command and benchmark with its options spelled with dashes and as --key=value, doing its
// work (or, where this machine cannot, failing for that reason and not over an option). A new
// command without a case here fails the test.
TEST(CliConventions, DashedNamesAndEqualsWorkInEverySubcommand) {
  ScratchDir dir;
  const fs::path d = dir.path();
  const std::string text = (d / "corpus.txt").string();
  std::ofstream(text) << "The quick brown fox jumps over the lazy dog.\nA second line.\n";
  const fs::path run = d / "run";  // a run as tessera train writes one, for plot
  fs::create_directories(run);
  std::ofstream(run / "metrics.jsonl")
      << "{\"iteration\":1,\"lm_loss\":5.0,\"elapsed_ms\":10,\"tokens_per_s_per_gpu\":100,"
         "\"tflops_per_gpu\":1,\"mem_peak_gib\":1,\"mem_allocated_gib\":1}\n";
  const std::string traces = std::string(TESSERA_TEST_DATA_DIR) + "/traces";
  const std::string ws = (d / "ws").string(), ckpt = (d / "ckpt").string();
  const bool gpu = gpu_device_count() > 0;

  struct Case {
    std::string args;
    std::function<void(const RunResult&)> check;
  };
  const auto succeeds = [](std::function<void(const RunResult&)> more = {}) {
    return [more](const RunResult& r) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
      if (more) more(r);
    };
  };
  // The ordered cases: convert and generate read train's checkpoint.
  const std::vector<std::pair<std::string, Case>> cases = {
      {"train",
       {"train --nproc-per-node=2 --device=cpu --model=tiny_llama --mock-data "
        "--tokenizer-type=ByteLevel --num-layers=1 --hidden-size=32 --ffn-hidden-size=48 "
        "--seq-length=16 --micro-batch-size=1 --global-batch-size=2 --lr-warmup-iters=1 "
        "--train-iters=1 --eval-interval=0 --workspace=" +
            ws + " --work-group=g --user-name=u --exp-name=dashed --save=" + ckpt,
        succeeds([&](const RunResult&) {
          const std::string config = slurp(fs::path(ws) / "g" / "u" / "dashed" / "config.yaml");
          EXPECT_TRUE(has(config, "hidden_size: 32")) << config;
          EXPECT_TRUE(has(config, "global_batch_size: 2")) << config;
          EXPECT_TRUE(has(slurp(fs::path(ws) / "g" / "u" / "dashed" / "logs" / "pre_trainer" /
                                "rank-0" / "info.log"),
                          "data parallel 2"));
        })}},
      {"convert",
       {"convert --from=" + ckpt + " --to-hf=" + (d / "hf").string() + " --dtype=fp32",
        succeeds([&](const RunResult&) { EXPECT_TRUE(fs::exists(d / "hf" / "config.json")); })}},
      {"generate",
       {"generate --from=" + ckpt +
            " --prompt-ids='1 2' --max-new-tokens=2 --device=cpu --ignore-eos",
        succeeds(
            [](const RunResult& r) { EXPECT_TRUE(has(r.output, "2 new tokens")) << r.output; })}},
      {"launch",
       {"launch --nproc-per-node=2 --master-port=29731 -- /bin/sh -c 'echo ws=$WORLD_SIZE "
        "port=$MASTER_PORT'",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "[rank 1] ws=2 port=29731")) << r.output;
        })}},
      {"preprocess",
       {"preprocess --input=" + text + " --output_prefix=" + (d / "tok").string() +
            " --tokenizer_type=ByteLevel --workers=1 --no_append_eod",
        succeeds([&](const RunResult&) {
          EXPECT_TRUE(fs::exists(d / "tok_text_document.bin"));
          EXPECT_TRUE(fs::exists(d / "tok_text_document.idx"));
        })}},
      {"bench model",
       // A proxy of an 8B model is minutes on a CPU: the unknown experiment shows that the
       // options before it were read, and --no-breakdown was not taken for a training key.
       {"bench model --models=no_such_model --iters=1 --warmup=0 --no-breakdown",
        [](const RunResult& r) {
          EXPECT_EQ(r.exit_code, 2) << r.output;
          EXPECT_TRUE(has(r.output, "no_such_model-pretrain")) << r.output;
          EXPECT_FALSE(has(r.output, "breakdown")) << r.output;
        }}},
      {"bench generate",
       {"bench generate --model=tiny_llama --num-layers=2 --batch=1,3 --prompt=5 --new=4 "
        "--device=cpu "
        "--warmup=0 --iters=1",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "| 3 | op by op |")) << r.output;
        })}},
      // An MoE preset cut to fewer layers than its moe_layer_freq lists names its own.
      {"bench generate",
       {"bench generate --model=tiny_moe --num-layers=2 --moe-layer-freq=1 --batch=2 --prompt=4 "
        "--new=3 --device=cpu --warmup=0 --iters=1",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "| 2 | op by op |")) << r.output;
        })}},
      {"bench gemm",
       {"bench gemm --device=cpu --sizes=64 --layouts=NN --epilogues=none --warmup=1 --iters=1 "
        "--gemm-autotune=false",
        succeeds(
            [](const RunResult& r) { EXPECT_TRUE(has(r.output, "| 64^3 | NN |")) << r.output; })}},
      {"bench attention",
       {"bench attention --device=cpu --seqs=64 --head-dims=64 --heads=2 --kv-heads=1 "
        "--masks=causal --tokens=64 --passes=forward --warmup=1 --iters=1",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "| forward | causal |")) << r.output;
        })}},
      {"bench membw",
       {"bench membw --device=cpu --sizes-mib=1 --warmup=1 --iters=1",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "| 1 | 1048576 |")) << r.output;
        })}},
      {"bench comm",
       {"bench comm --min-bytes=1024 --max-bytes=1024 --ops=all_reduce --warmup=1 --iters=1",
        [gpu](const RunResult& r) {
          if (gpu) {
            EXPECT_EQ(r.exit_code, 0) << r.output;
          } else {  // NCCL needs a GPU; the options were read before that was found out
            EXPECT_EQ(r.exit_code, 2) << r.output;
            EXPECT_TRUE(has(r.output, "key 'device'")) << r.output;
          }
        }}},
      {"bench tokenizer",
       {"bench tokenizer --tokenizer-model=llama3 --data=" + text +
            " --threads=1 --repeat=1 --no-reference",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "| llama3 | tessera |")) << r.output;
        })}},
      {"memory",
       {"memory --device=cpu --num-gpus=2 --model=tiny_llama --mock-data --global-batch-size=8",
        succeeds([](const RunResult& r) {
          EXPECT_TRUE(has(r.output, "2 ranks as threads of one process")) << r.output;
        })}},
      {"preflight",
       {"preflight --gemm-size=64 --copy-mib=1 -o " + (d / "preflight").string(),
        succeeds(
            [&](const RunResult&) { EXPECT_TRUE(fs::exists(d / "preflight" / "preflight.md")); })}},
      {"plot",
       {"plot " + run.string() + " --format=svg,png --output=" + (d / "plots").string(),
        succeeds([&](const RunResult&) { EXPECT_TRUE(fs::exists(d / "plots" / "loss.png")); })}},
      {"report",
       {"report " + traces + "/torch_gpu_step.pt.trace.json.gz --top=3 --format=md --output=" +
            (d / "report").string(),
        succeeds([&](const RunResult&) { EXPECT_FALSE(fs::is_empty(d / "report")); })}},
      {"trace",
       {"trace merge " + traces + "/ddp --output=" + (d / "merged.json").string(),
        succeeds([&](const RunResult&) { EXPECT_TRUE(fs::exists(d / "merged.json")); })}},
  };

  std::set<std::string> covered;
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(c.args);
    covered.insert(name);
    const RunResult r = run_tessera(c.args);
    // No parser refused an option: their messages for an unknown one.
    for (const char* refusal : {"one of the options", "an option of", "one of --", "a known key"})
      EXPECT_FALSE(has(r.output, refusal)) << r.output;
    c.check(r);
  }
  for (const cli::Command& c : cli::commands()) {
    if (!c.subcommands) EXPECT_TRUE(covered.contains(c.name)) << c.name << " has no case here";
    if (c.subcommands)
      for (const cli::Command& s : c.subcommands())
        EXPECT_TRUE(covered.contains(std::string(c.name) + " " + s.name))
            << c.name << " " << s.name << " has no case here";
  }
}

TEST(CliConventions, TrainHelpShowsEveryDefaultAndTheModelPresets) {
  const RunResult r = run_tessera("train --help");
  ASSERT_EQ(r.exit_code, 0);
  static const Experiment defaults;
  for (const KeySpec& k : config_keys()) {
    const size_t at = r.output.find("  --" + std::string(k.name) + " ");
    ASSERT_NE(at, std::string::npos) << k.name;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_TRUE(line.ends_with("default: " + k.get(defaults) + ")")) << line;
  }
  EXPECT_TRUE(has(r.output, "default: 100)")) << "train_iters' built-in default";
  // Every preset file of configs/models, and the shipped experiments, by the names they take.
  const std::string models = r.output.substr(r.output.find("model presets (--model):"));
  size_t presets = 0;
  for (const auto& f :
       fs::directory_iterator(std::string(TESSERA_TESTS_DIR) + "/../configs/models")) {
    ++presets;
    EXPECT_TRUE(has(models, " " + f.path().stem().string() + ",") ||
                has(models, " " + f.path().stem().string() + "\n"))
        << f.path();
  }
  EXPECT_GE(presets, 12u);
  EXPECT_TRUE(has(r.output, "primus/llama3.1_8B-pretrain"));
  for (const char* megatron : {"--bf16", "--fp16", "wandb_project", "eod_mask_loss"})
    EXPECT_TRUE(has(r.output, megatron)) << megatron;
}

TEST(CliConventions, AnUnknownModelExitsTwoSuggestingTheNearestPresets) {
  ScratchDir dir;
  for (const auto& [model, suggestion] : std::vector<std::pair<std::string, std::string>>{
           {"lama3_8B", "did you mean llama3_8B?"},
           {"llama3.1_8b", "did you mean llama3.1_8B?"},
           {"qwen2_7B", "did you mean qwen2.5_7B"}}) {
    const RunResult r = run_tessera("train --model " + model + " --mock_data true --workspace " +
                                    (dir.path() / "ws").string());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(has(r.output, "key 'model' has value '" + model + "'")) << r.output;
    EXPECT_TRUE(has(r.output, suggestion)) << r.output;
    EXPECT_TRUE(fs::is_empty(dir.path())) << model;
  }
}

TEST(CliConventions, MegatronPrecisionFlagsOnTheCommandLine) {
  ScratchDir dir;
  const std::string tiny =
      "train --model tiny_llama --mock_data true --num_layers 1 --hidden_size 32 "
      "--ffn_hidden_size 48 --vocab_size 64 --seq_length 16 "
      "--micro_batch_size 1 --global_batch_size 1 --lr_warmup_iters 1 "
      "--train_iters 1 --eval_interval 0 --device cpu --workspace " +
      (dir.path() / "ws").string() + " --work_group g --user_name u";
  RunResult r = run_tessera(tiny + " --fp16");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "key 'fp16' has value 'true'")) << r.output;
  EXPECT_TRUE(has(r.output, "not implemented")) << r.output;
  r = run_tessera(tiny + " --bf16");  // bf16 is precision: bf16, which the CPU backend has not
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "key 'precision' has value 'bf16'")) << r.output;
  EXPECT_FALSE(fs::exists(dir.path() / "ws"));
  r = run_tessera(tiny + " --bf16 false --exp_name fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(
      has(slurp(dir.path() / "ws" / "g" / "u" / "fp32" / "config.yaml"), "precision: fp32"));
}

// Primus's own example file (configs/experiments/primus/), as written, with a tiny model on the
// command line: it trains, lands where Primus would put it, and the log names what it ignored.
TEST(CliConventions, PrimusExperimentTrainsTwoIterationsOnTheCpu) {
  ScratchDir dir;
  const RunResult r = run_command(
      "cd " + dir.path().string() +
      " && env -u PRIMUS_TEAM -u PRIMUS_USER -u PRIMUS_EXP_NAME -u PRIMUS_WORKSPACE " +
      TESSERA_BINARY +
      " train --config primus/llama3.1_8B-pretrain --device cpu --num_layers 2 --hidden_size 32 "
      "--ffn_hidden_size 48 --num_attention_heads 4 --num_query_groups 2 --vocab_size 64 "
      "--seq_length 16 --micro_batch_size 2 --global_batch_size 4 --train_iters 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path root = dir.path() / "output" / "amd" / "root" / "llama3.1_8B-pretrain";
  std::ifstream metrics(root / "metrics.jsonl");
  std::vector<int> iterations;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) iterations.push_back(j["iteration"].get<int>());
  }
  EXPECT_EQ(iterations, (std::vector<int>{1, 2}));
  const fs::path logs = root / "logs" / "pre_trainer" / "rank-0";
  const std::string info = slurp(logs / "info.log"), warnings = slurp(logs / "warning.log");
  EXPECT_TRUE(has(info, "Megatron/Primus keys accepted without effect")) << info;
  for (const char* key : {"wandb_project", "stderr_sink_level", "log_avg_skip_iterations",
                          "log_avg_reset_interval", "ckpt_format"})
    EXPECT_TRUE(has(info, key)) << key;
  // Primus's eod_mask_loss: true is carried out: the loss counts fewer positions than all.
  EXPECT_FALSE(has(warnings, "eod_mask_loss")) << warnings;
  EXPECT_TRUE(has(info, "| loss tokens: ")) << info;
  const std::string config = slurp(root / "config.yaml");
  EXPECT_TRUE(has(config, "eod_mask_loss: true")) << config;
  EXPECT_TRUE(has(config, "use_distributed_optimizer: true")) << config;  // pre_trainer.yaml
  EXPECT_TRUE(has(config, "norm_epsilon: 1e-06")) << config;
}

// Tessera's commands under launch need a GPU per rank: on a machine without one, launch refuses
// before starting any rank, so no rank makes the run's directories or logs.
TEST(CliConventions, LaunchWithoutAGpuRefusesAndWritesNothing) {
  if (gpu_device_count() > 0) GTEST_SKIP() << "skipped: this machine has a GPU";
  ScratchDir dir;
  const std::set<fs::path> before = files_under(dir.path());
  for (const std::string& command :
       {std::string("train --model tiny_llama --mock_data true --train_iters 2 --workspace ws"),
        std::string("bench comm -o comm")}) {
    const RunResult r = run_command("cd " + dir.path().string() + " && " + TESSERA_BINARY +
                                    " launch --nproc_per_node 2 " + command);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(has(r.output, "no GPU is visible")) << r.output;
    EXPECT_TRUE(has(r.output, "--device cpu --nproc_per_node N")) << r.output;
    EXPECT_FALSE(has(r.output, "[rank ")) << "a rank started:\n" << r.output;
    EXPECT_EQ(files_under(dir.path()), before) << command;
  }
}

// --model without --config is the preset as defined: the default experiment's shrinking of
// its own tiny_llama (hidden 128, 2 heads, 1 group) does not apply to it.
TEST(CliConventions, AModelPresetWithoutAConfigIsThePresetAsDefined) {
  for (const auto& [preset, model_line] : std::vector<std::pair<std::string, std::string>>{
           {"tiny_llama", "model: 4 layers, hidden 256, ffn 688, heads 4 (kv 2)"},
           {"tiny_mla", "model: 3 layers, hidden 64, ffn 128, heads 4 (kv 4)"}}) {
    const RunResult r = run_tessera("memory --device cpu --mock_data true --model " + preset);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.rfind(model_line, 0), 0u) << r.output;
  }
}

// OpenMP's threads wait passively (they no longer spin, taking the cores the working threads
// need on a shared machine), unless the user chose a policy; launch's children inherit it.
TEST(CliConventions, OpenMpThreadsWaitPassivelyUnlessTheUserChose) {
  const std::string print_policy =
      std::string(TESSERA_BINARY) +
      " launch --nproc_per_node 1 -- sh -c 'echo policy=$OMP_WAIT_POLICY'";
  RunResult r = run_command("env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT " + print_policy);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "policy=PASSIVE")) << r.output;
  r = run_command("env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=ACTIVE " + print_policy);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "policy=ACTIVE")) << r.output;
}

// Primus's launch scripts as Primus users type them: EXP names the experiment (a shipped name, or
// a Primus path taken by its name), the arguments pass on unchanged; NNODES for Slurm. A stand-in
// tessera and srun record what they are given.
TEST(CliConventions, ExampleLaunchScriptsTakeExpAndPassTheArguments) {
  ScratchDir dir;
  const std::string record = (dir / "args").string();
  std::ofstream(dir / "tessera") << "#!/bin/sh\necho \"$@\" > " << record << "\n";
  std::ofstream(dir / "srun") << "#!/bin/sh\necho \"$@\" > " << record << "\n";
  run_command("chmod +x " + (dir / "tessera").string() + " " + (dir / "srun").string());
  const std::string root = std::string(TESSERA_TESTS_DIR) + "/../examples/";
  const std::string env =
      "TESSERA=" + (dir / "tessera").string() + " PATH=" + dir.path().string() + ":$PATH ";

  RunResult r = run_command(env + "EXP=llama3.1_8B-pretrain bash " + root +
                            "run_pretrain.sh --train_iters 50 --fp8 hybrid");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(slurp(record),
            "launch --nproc_per_node 8 --nnodes 1 --node_rank 0 --master_addr localhost "
            "--master_port 1234 train --config llama3.1_8B-pretrain --train_iters 50 --fp8 "
            "hybrid\n");

  r = run_command(env +
                  "EXP=examples/megatron/configs/MI300X/mixtral_8x7B_v0.1-FP8-pretrain.yaml "
                  "GPUS_PER_NODE=4 bash " +
                  root + "run_pretrain.sh --train_iters 5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(
      has(slurp(record), "train --config mixtral_8x7B-pretrain --fp8 hybrid --train_iters 5"))
      << slurp(record);
  EXPECT_TRUE(has(slurp(record), "--nproc_per_node 4")) << slurp(record);

  r = run_command(env + "EXP=llama3.3_70B-pretrain NNODES=8 bash " + root +
                  "run_slurm_pretrain.sh --micro_batch_size 4 --recompute_num_layers 80");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string srun = slurp(record);
  EXPECT_TRUE(has(srun, "--nodes 8 --ntasks-per-node 8")) << srun;
  EXPECT_TRUE(has(srun,
                  "train --config llama3.3_70B-pretrain --micro_batch_size 4 "
                  "--recompute_num_layers 80"))
      << srun;

  EXPECT_EQ(run_command(env + "bash " + root + "run_pretrain.sh").exit_code, 2);  // no EXP
}

}  // namespace
}  // namespace tessera::testing
