// Checkpoints of models split over ranks (tensor, pipeline and expert parallelism, format 3):
// every part's state is written once as runs of the one-device layout, so a run saved under one
// mesh resumes under any other (tensor x pipeline x data/context parallel, expert parallel,
// ZeRO-1, one rank) and the
// checkpoint reads like a one-device one (its master weights, Hugging Face export).
//
// A resumed run continues its straight run: bitwise on the same mesh (every value is restored
// exactly), and on another mesh within the tolerance of the meshes' different summation
// orders (tests/distributed/model_parallel_test.cpp). Measured here: a saving run against one
// rank, losses within 5.5e-7 relative and weights 1e-5; a resumed run against its straight
// one, losses 6e-8 and weights 2e-8; the tolerances are 5e-6 and 5e-5, while the 3 resumed
// iterations move the weights by ~3e-2 relative, so that a resume from wrong or misplaced
// state cannot pass.
#include <omp.h>

#include <cmath>
#include <map>
#include <mutex>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/distributed/local_communicator.h"

namespace tessera::testing {
namespace {

constexpr double kLossTolerance = 5e-6;
constexpr double kWeightTolerance = 5e-5;

struct TrainingRun {
  std::map<int64_t, double> losses;  // by iteration
  std::vector<float> weights;        // the whole model's, one-device layout
};

// 8 heads in 4 groups, 4 layers, 4 micro-batches per step at one data-parallel rank; `extra`
// YAML lines set the mesh, saving and loading.
Experiment experiment(const fs::path& dir, int world, const std::string& extra) {
  // A vocabulary that Megatron's padding keeps at 48 for 1, 2 and 4 tensor-parallel ranks.
  return tiny_experiment(dir,
                         "num_layers: 4\nnum_attention_heads: 8\nnum_query_groups: 4\n"
                         "vocab_size: 48\n"
                         "micro_batch_size: 1\nglobal_batch_size: 4\ntrain_iters: 6\n"
                         "ddp_bucket_size: 2000\n" +
                             extra,
                         kMockData, world);
}

std::string saving(const fs::path& save) {
  return "save: " + save.string() + "\nsave_interval: 3\nckpt_keep_last: 0\n";
}

// train() on `world` thread ranks, one OpenMP thread each (model_parallel_test.cpp says why).
TrainingRun train(const Experiment& e, int world) {
  TrainingRun run;
  std::mutex mutex;
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    omp_set_num_threads(1);
    Logger log("", rank, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr, world > 1 ? &comm : nullptr);
    std::map<int64_t, double> losses;
    for (int64_t it = trainer.completed_iterations() + 1; it <= e.training.train_iters; ++it) {
      losses[it] = trainer.run_iteration(it).loss;
      if (!e.checkpoint.save.empty() && it % e.checkpoint.save_interval == 0)
        trainer.save_checkpoint();
    }
    Model& m = trainer.model();
    const std::vector<float> params = download(m.backend(), m.params());
    std::lock_guard lock(mutex);
    if (rank == 0) run.losses = losses;
    if (run.weights.empty()) run.weights.assign(make_param_layout(m.spec()).total, 0.0f);
    for (const ParamInfo& p : m.layout().params)
      p.for_each_run(0, p.numel(), [&](int64_t begin, int64_t count, int64_t full_begin) {
        std::copy_n(params.begin() + p.offset + begin, count,
                    run.weights.begin() + p.full_offset + full_begin);
      });
  });
  return run;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// Every loss `run` logged and its final weights are `reference`'s (bitwise, or within the
// tolerances).
void expect_same_run(const TrainingRun& run, const TrainingRun& reference, bool bitwise,
                     const std::string& what) {
  const TrainingRun& resumed = run;
  const TrainingRun& straight = reference;
  for (const auto& [it, loss] : resumed.losses) {
    const double want = straight.losses.at(it);
    if (bitwise)
      EXPECT_EQ(loss, want) << what << " iteration " << it;
    else
      EXPECT_LE(std::abs(loss - want), kLossTolerance * want)
          << what << " iteration " << it << ": " << loss << " vs " << want;
  }
  if (bitwise)
    EXPECT_EQ(resumed.weights, straight.weights) << what;
  else
    EXPECT_LE(relative_difference(resumed.weights, straight.weights), kWeightTolerance) << what;
}

// `resumed` ran iterations 4..6 of `straight`.
void expect_continues(const TrainingRun& resumed, const TrainingRun& straight, bool bitwise,
                      const std::string& what) {
  ASSERT_EQ(resumed.losses.size(), 3u) << what;
  expect_same_run(resumed, straight, bitwise, what);
}

struct Mesh {
  int world;
  std::string lines;
};

const Mesh kOne{1, ""};
const Mesh kTp2Sp{2, "tensor_model_parallel_size: 2\nsequence_parallel: true\n"};
const Mesh kTp2Pp2{4, "tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n"};
const Mesh kPp2Interleaved{
    2, "pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n"};
const Mesh kPp2Dp2Zero1{4, "pipeline_model_parallel_size: 2\nuse_distributed_optimizer: true\n"};
const Mesh kTp4{4, "tensor_model_parallel_size: 4\n"};
const Mesh kTp2Cp2Zero1{
    4,
    "tensor_model_parallel_size: 2\ncontext_parallel_size: 2\nuse_distributed_optimizer: true\n"};

TEST(ModelParallelResume, SavedUnderOneMeshResumesUnderAnother) {
  ScratchDir dir;
  const TrainingRun reference = train(experiment(dir.path(), 1, ""), 1);
  ASSERT_EQ(reference.losses.size(), 6u);
  struct Case {
    const char* name;
    Mesh saved, resumed;
  };
  const std::vector<Case> cases = {{"tp2+sp -> one rank", kTp2Sp, kOne},
                                   {"one rank -> tp2 x pp2", kOne, kTp2Pp2},
                                   {"tp2 x pp2 -> pp2 x dp2 ZeRO-1", kTp2Pp2, kPp2Dp2Zero1},
                                   {"pp2 interleaved -> tp4", kPp2Interleaved, kTp4},
                                   {"tp2 x cp2 ZeRO-1 -> tp2 x pp2", kTp2Cp2Zero1, kTp2Pp2}};
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(c.name);
    const fs::path save = dir / ("save" + std::to_string(k));
    fs::remove_all(save);
    const TrainingRun straight =
        train(experiment(dir.path(), c.saved.world, c.saved.lines + saving(save)), c.saved.world);
    ASSERT_EQ(straight.losses.size(), 6u);
    expect_same_run(straight, reference, false, "the saving run against one rank");
    const std::string load = "load: " + (save / "iter_0000003").string() + "\n";
    const TrainingRun resumed =
        train(experiment(dir.path(), c.resumed.world, c.resumed.lines + load), c.resumed.world);
    expect_continues(resumed, straight, false, "resumed");
  }
}

// The precision-aware optimizer's bf16 moments, saved in bf16 by the ranks that hold them.
const Mesh kTp2Pp2Bf16Moments{4,
                              "tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n"
                              "use_distributed_optimizer: true\n"
                              "use_precision_aware_optimizer: true\n"
                              "exp_avg_dtype: bf16\nexp_avg_sq_dtype: bf16\n"};

// On the mesh that saved it, every value comes back exactly: the resumed run is the straight
// run, bit for bit; and the checkpoint, read as a one-device one, holds the whole model.
TEST(ModelParallelResume, SameMeshResumesBitwiseAndTheCheckpointReadsWhole) {
  ScratchDir dir;
  const Mesh* meshes[] = {&kTp2Pp2, &kPp2Dp2Zero1, &kTp2Pp2Bf16Moments};
  for (size_t k = 0; k < std::size(meshes); ++k) {
    const Mesh& mesh = *meshes[k];
    SCOPED_TRACE(mesh.lines);
    const fs::path save = dir / ("save" + std::to_string(k));
    const TrainingRun straight =
        train(experiment(dir.path(), mesh.world, mesh.lines + saving(save)), mesh.world);
    const fs::path last = save / "iter_0000006";
    EXPECT_FALSE(fs::exists(last / "model.safetensors")) << "a split model writes no whole file";
    const Checkpoint c(last.string());
    EXPECT_TRUE(c.sharded());
    const DType moments = &mesh == &kTp2Pp2Bf16Moments ? DType::BF16 : DType::F32;
    EXPECT_EQ(c.state_dtype(FlatState::ExpAvg), moments);
    EXPECT_EQ(c.state_dtype(FlatState::ExpAvgSq), moments);
    for (const ParamInfo& p : c.layout().params) {
      const std::vector<float> master = c.master(p);
      EXPECT_TRUE(std::equal(master.begin(), master.end(), straight.weights.begin() + p.offset))
          << p.name << " in the checkpoint differs from the final weights";
    }
    const std::string load = "load: " + (save / "iter_0000003").string() + "\n";
    expect_continues(train(experiment(dir.path(), mesh.world, mesh.lines + load), mesh.world),
                     straight, true, "resumed on the same mesh");
  }
}

// tessera convert exports a split model's checkpoint to Hugging Face like any other, and a
// split model starts from Hugging Face weights (hf_init_path) as one rank does.
TEST(ModelParallelResume, HuggingFaceExportFromASplitCheckpointAndInitOfASplitModel) {
  ScratchDir dir;
  const fs::path save = dir / "save";
  const TrainingRun straight =
      train(experiment(dir.path(), kTp2Pp2.world, kTp2Pp2.lines + saving(save)), kTp2Pp2.world);
  const RunResult r = run_tessera("convert --from " + (save / "iter_0000006").string() +
                                  " --to-hf " + (dir / "hf").string() + " --dtype fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const SafetensorsFile hf((dir / "hf" / "model.safetensors").string());
  const Checkpoint c((save / "iter_0000006").string());
  const ParamInfo* down = c.layout().find("model.layers.2.mlp.down_proj.weight");
  ASSERT_NE(down, nullptr);
  const std::vector<float> exported = hf.to_float("model.layers.2.mlp.down_proj.weight");
  ASSERT_EQ(static_cast<int64_t>(exported.size()), down->numel());
  EXPECT_TRUE(std::equal(exported.begin(), exported.end(), straight.weights.begin() + down->offset))
      << "a row-parallel weight, put back together from the ranks' columns";

  const std::string init = "hf_init_path: " + (dir / "hf").string() + "\n";
  const TrainingRun one = train(experiment(dir.path(), 1, init), 1);
  const TrainingRun split =
      train(experiment(dir.path(), kTp2Pp2.world, kTp2Pp2.lines + init), kTp2Pp2.world);
  expect_same_run(split, one, false, "tp2 x pp2 from Hugging Face weights");
  // The first step's loss is the exported model's loss: the weights were taken as they are.
  EXPECT_NE(one.losses.at(1), straight.losses.at(1));
}

// Expert parallelism: each rank holds its experts (written by their first
// expert-data-parallel rank, or as ZeRO-1 shards), the rest is whole on every rank.
const std::string kMoe =
    "model_family: mixtral\nnum_experts: 4\nmoe_router_topk: 2\nmoe_ffn_hidden_size: 24\n"
    "moe_shared_expert_intermediate_size: 16\nmoe_layer_freq: 1\nmoe_aux_loss_coeff: 0.01\n";
const Mesh kEp2{2, "expert_model_parallel_size: 2\n"};
const Mesh kEp2Edp2{4, "expert_model_parallel_size: 2\n"};
const Mesh kEp2Edp2Zero1{4, "expert_model_parallel_size: 2\nuse_distributed_optimizer: true\n"};
const Mesh kEp4{4, "expert_model_parallel_size: 4\n"};

TEST(ModelParallelResume, ExpertParallelCheckpointsResumeUnderAnyMeshAndBitwiseOnTheirOwn) {
  ScratchDir dir;
  const TrainingRun reference = train(experiment(dir.path(), 1, kMoe), 1);
  ASSERT_EQ(reference.losses.size(), 6u);
  struct Case {
    const char* name;
    Mesh saved, resumed;
  };
  const std::vector<Case> cases = {{"ep2 -> one rank", kEp2, kOne},
                                   {"one rank -> ep2 x edp2", kOne, kEp2Edp2},
                                   {"ep2 x edp2 ZeRO-1 -> ep4", kEp2Edp2Zero1, kEp4},
                                   {"ep2 x edp2 -> same", kEp2Edp2, kEp2Edp2},
                                   {"ep2 x edp2 ZeRO-1 -> same", kEp2Edp2Zero1, kEp2Edp2Zero1}};
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(c.name);
    const fs::path save = dir / ("save" + std::to_string(k));
    const TrainingRun straight = train(
        experiment(dir.path(), c.saved.world, kMoe + c.saved.lines + saving(save)), c.saved.world);
    ASSERT_EQ(straight.losses.size(), 6u);
    expect_same_run(straight, reference, false, "the saving run against one rank");
    if (c.saved.world > 1) {
      // The checkpoint holds the whole model, each expert once.
      const Checkpoint last((save / "iter_0000006").string());
      for (const ParamInfo& p : last.layout().params) {
        const std::vector<float> master = last.master(p);
        EXPECT_TRUE(std::equal(master.begin(), master.end(), straight.weights.begin() + p.offset))
            << p.name << " in the checkpoint differs from the final weights";
      }
    }
    const std::string load = "load: " + (save / "iter_0000003").string() + "\n";
    const TrainingRun resumed = train(
        experiment(dir.path(), c.resumed.world, kMoe + c.resumed.lines + load), c.resumed.world);
    expect_continues(resumed, straight, c.saved.lines == c.resumed.lines && c.saved.world > 1,
                     "resumed");
  }
}

}  // namespace
}  // namespace tessera::testing
