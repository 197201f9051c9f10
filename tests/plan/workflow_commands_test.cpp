// The training commands of the Primus workflow, as written (docs/cli.md): each line is
// `tessera train --config <experiment> <arguments>` launched on N GPUs of 192 GB (MI300X, 8 per
// node). Every one parses as `tessera train` parses it on N ranks and plans to fit on MI300X;
// on 8 H200s (141 GB) it fits or the planner names the change that does. The shipped
// experiments carry Primus's layouts for one node, which is what makes them fit.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/config/config.h"
#include "tessera/plan/memory_report.h"

namespace tessera::plan {
namespace {

struct Command {
  int gpus;
  std::string experiment, arguments;
};

// The workflow's table; the shell has taken the quotes off --profile_ranks, and each
// [--fp8 hybrid] is a line with and one without.
const std::vector<Command>& workflow() {
  static const std::vector<Command> kLines = {
      {8, "llama3.1_8B-pretrain",
       "--train_iters 50 --fp8 hybrid --micro_batch_size 1 --global_batch_size 128"},
      {8, "qwen2.5_7B-pretrain",
       "--train_iters 50 --fp8 hybrid --micro_batch_size 4 --global_batch_size 512"},
      {8, "llama3.1_8B-pretrain",
       "--train_iters 50 --fp8 hybrid --micro_batch_size 2 --global_batch_size 256 --profile=True "
       "--use_pytorch_profiler=True --profile_ranks=[0,1,2,3,4,5,6,7]"},
      {8, "qwen2.5_7B-pretrain",
       "--train_iters 50 --fp8 hybrid --micro_batch_size 4 --global_batch_size 512 --profile=True "
       "--use_pytorch_profiler=True --profile_ranks=[0,1,2,3,4,5,6,7]"},
      {8, "llama3.1_8B-pretrain",
       "--tensor_model_parallel_size 8 --micro_batch_size 1 --global_batch_size 8 --train_iters 10 "
       "--fp8 hybrid"},
      {8, "qwen2.5_7B-pretrain",
       "--micro_batch_size 2 --global_batch_size 256 --train_iters 50 --fp8 hybrid"},
      {8, "llama3.3_70B-pretrain", "--micro_batch_size 2 --global_batch_size 16 --train_iters 50"},
      {8, "llama3.1_8B-pretrain", "--train_iters 50"},
      {8, "llama3.1_8B-pretrain", "--train_iters 50 --fp8 hybrid"},
      {8, "llama3.1_70B-pretrain", "--train_iters 50"},
      {8, "llama3.1_70B-pretrain",
       "--train_iters 50 --num_layers 40 --fp8 hybrid --no_fp8_weight_transpose_cache true"},
      {8, "llama2_7B-pretrain", "--train_iters 50"},
      {8, "llama2_7B-pretrain", "--train_iters 50 --fp8 hybrid"},
      {8, "llama2_70B-pretrain", "--train_iters 50"},
      {8, "deepseek_v3-pretrain", "--num_layers 3 --moe_layer_freq 1 --train_iters 50"},
      {8, "deepseek_v2_lite-pretrain", "--global_batch_size 256 --train_iters 50"},
      {8, "mixtral_8x7B-pretrain", "--train_iters 50"},
      {8, "mixtral_8x22B-pretrain",
       "--num_layers 4 --pipeline_model_parallel_size 1 --micro_batch_size 1 --global_batch_size "
       "16 --train_iters 50"},
      {8, "qwen2.5_7B-pretrain", "--train_iters 50"},
      {8, "qwen2.5_7B-pretrain", "--train_iters 50 --fp8 hybrid"},
      {8, "qwen2.5_72B-pretrain", "--train_iters 50"},
      {64, "llama3.3_70B-pretrain",
       "--micro_batch_size 4 --global_batch_size 256 --recompute_num_layers 80 "
       "--no_fp8_weight_transpose_cache true --fp8 hybrid"},
      {64, "llama3.3_70B-pretrain",
       "--micro_batch_size 1 --global_batch_size 256 --recompute_num_layers 12"},
      {64, "llama3.1_8B-pretrain", "--global_batch_size 1024 --fp8 hybrid"},
      {64, "llama3.1_70B-pretrain",
       "--micro_batch_size 4 --global_batch_size 256 --recompute_num_layers 80 "
       "--no_fp8_weight_transpose_cache true --fp8 hybrid"},
      {64, "llama3.1_70B-pretrain",
       "--micro_batch_size 1 --global_batch_size 256 --recompute_num_layers 12"},
      {64, "llama2_7B-pretrain", "--global_batch_size 2048 --fp8 hybrid"},
      {64, "llama2_70B-pretrain",
       "--micro_batch_size 10 --global_batch_size 640 --recompute_num_layers 80 "
       "--no_fp8_weight_transpose_cache true --fp8 hybrid"},
      {64, "llama2_70B-pretrain",
       "--micro_batch_size 2 --global_batch_size 1536 --recompute_num_layers 12"},
      {64, "mixtral_8x7B-pretrain", "--micro_batch_size 2 --global_batch_size 256"},
      {64, "qwen2.5_72B-pretrain",
       "--micro_batch_size 8 --global_batch_size 512 --recompute_num_layers 80 "
       "--no_fp8_weight_transpose_cache true --fp8 hybrid"},
      {8, "llama3.1_70B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 4 --global_batch_size 32"},
      {8, "llama3.1_8B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 3 --global_batch_size 24"},
      {8, "llama3.1_8B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 3 --global_batch_size 24 --fp8 hybrid"},
      {8, "llama3.1_8B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 6 --seq_length 4096 --global_batch_size 48"},
      {8, "mistral_7B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 3 --global_batch_size 24"},
      {8, "mistral_7B-pretrain",
       "--use_torch_fsdp2 true --micro_batch_size 4 --global_batch_size 32 --fp8 hybrid"},
  };
  return kLines;
}

MemoryReport plan(const Command& c, const char* gpu) {
  LoadOptions o;
  o.config_path = c.experiment;
  std::istringstream words(c.arguments);
  for (std::string w; words >> w;) o.cli_overrides.push_back(w);
  o.data_parallel_size = c.gpus;
  MemoryQuery q;
  q.experiment = load_experiment(o);
  q.num_gpus = c.gpus;
  q.gpu = *analysis::find_gpu_spec(gpu);
  return build_memory_report(q);
}

// Every line fits; closest, torchtitan's FSDP benchmark of Llama 3.1 70B at micro batch 4
// (182 GiB, docs/memory.md): 8.8B parameters per GPU with 14 bytes of state each and the 80
// stored layer inputs and one layer's recompute at 32k tokens.
TEST(WorkflowCommands, EveryLineParsesAndFitsOnMi300x) {
  ASSERT_EQ(workflow().size(), 37u);
  ASSERT_EQ(analysis::find_gpu_spec("MI300X")->hbm_gb, 192);
  for (size_t i = 0; i < workflow().size(); ++i) {
    const Command& c = workflow()[i];
    SCOPED_TRACE(std::to_string(c.gpus) + " GPUs: " + c.experiment + " " + c.arguments);
    MemoryReport r;
    ASSERT_NO_THROW(r = plan(c, "MI300X"));
    EXPECT_TRUE(r.fits) << r.verdict;
    EXPECT_TRUE(r.verdict.starts_with("FITS on MI300X")) << r.verdict;
  }
}

TEST(WorkflowCommands, OnEightH200sEveryLineFitsOrThePlannerNamesTheChange) {
  int fitting = 0;
  for (const Command& c : workflow()) {
    SCOPED_TRACE(std::to_string(c.gpus) + " GPUs: " + c.experiment + " " + c.arguments);
    const MemoryReport r = plan(c, "H200");
    if (r.fits) {
      ++fitting;
      continue;
    }
    // The change: a row of keys to paste, or more GPUs.
    EXPECT_TRUE(r.verdict.find("Fits with --") != std::string::npos ||
                r.verdict.find("It fits on ") != std::string::npos)
        << r.verdict;
  }
  std::printf("[ fits     ] %d of %zu lines fit 8 H200s as written\n", fitting, workflow().size());
  EXPECT_GE(fitting, 20);
}

// What makes the lines fit: Primus's layouts, carried by the shipped experiments.
TEST(WorkflowCommands, ExperimentsCarryPrimusLayoutsForOneNode) {
  const auto load = [](const std::string& name) {
    LoadOptions o;
    o.config_path = name;
    o.data_parallel_size = 8;
    return load_experiment(o);
  };
  for (const char* name : {"llama3.1_70B-pretrain", "llama3.3_70B-pretrain", "llama2_70B-pretrain",
                           "qwen2.5_72B-pretrain"}) {
    SCOPED_TRACE(name);
    const TrainingConfig t = load(name).training;
    EXPECT_TRUE(t.use_torch_fsdp2);
    EXPECT_FALSE(t.use_distributed_optimizer);
    EXPECT_EQ(t.recompute_granularity, RecomputeGranularity::Full);
    EXPECT_EQ(t.recompute_method, RecomputeMethod::Block);
    EXPECT_EQ(t.recompute_num_layers, 80);
  }
  for (const char* name :
       {"mixtral_8x7B-pretrain", "mixtral_8x22B-pretrain", "deepseek_v3-pretrain",
        "deepseek_v2_lite-pretrain", "qwen3_30B_A3B-pretrain"}) {
    SCOPED_TRACE(name);
    const TrainingConfig t = load(name).training;
    EXPECT_EQ(t.expert_model_parallel_size, 8);
    EXPECT_TRUE(t.use_distributed_optimizer);
    EXPECT_TRUE(t.moe_force_balance);
  }
  for (const char* name :
       {"llama3.1_8B-pretrain", "llama2_7B-pretrain", "qwen2.5_7B-pretrain", "mistral_7B-pretrain"})
    EXPECT_TRUE(load(name).training.use_distributed_optimizer) << name;
  // On fewer GPUs than the experts are spread over, the error says what to set.
  LoadOptions one;
  one.config_path = "mixtral_8x7B-pretrain";
  try {
    load_experiment(one);
    ADD_FAILURE() << "expected expert_model_parallel_size to be refused on one rank";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "expert_model_parallel_size");
  }
}

}  // namespace
}  // namespace tessera::plan
