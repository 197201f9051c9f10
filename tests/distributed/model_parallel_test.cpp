// Model parallelism on thread ranks (LocalCommunicator) against one rank: the same experiment
// trained 10 steps on a mesh of tensor-parallel ranks (with and without sequence parallelism),
// context-parallel ranks (causal and sliding-window attention), pipeline stages (1F1B,
// interleaved 1F1B, uneven stages), data-parallel ranks, and an MoE model over pipeline stages
// with its experts over expert-parallel ranks of each stage gives the
// single-rank run's losses, gradient norms and, once each rank's parts are put back in place in
// the whole parameters, its final gradients and weights. Replicated parameters stay bitwise
// identical on every tensor-parallel rank.
//
// Tensor parallelism is not bitwise: a row-parallel linear (o_proj, down_proj) adds partial
// sums over the ranks' slices of its inputs, the head's logsumexp combines the vocabulary
// shards', and the gradient norm sums the ranks' squares, each in another order than one rank's
// GEMMs and reductions; the differences reach the weights through gradient clipping. Nor is
// context parallelism: its ranks' weight gradients are partial sums over their tokens, added
// up over the ranks. Measured (fp32): tensor parallelism at 2 and 4 ranks, with and without
// sequence and data parallelism, losses within 8e-8 relative, gradient norms 9e-8, final
// weights 7e-7 and last gradients 3e-6 relative L2; context parallelism at 2 and 4 ranks,
// causal and windowed, losses 8e-8, norms 9e-8, weights 8e-7, gradients 1.8e-6; tensor x
// pipeline x data or context parallel on 8 ranks (4 layers, whose gradient norm reaches 1.7)
// losses 1.5e-7, norms 5.2e-6, weights 4.5e-6, gradients 1.3e-5. The tolerances: 1e-6 for
// losses, 5e-5 for the rest. A wrong split misses them by orders of magnitude (a residual
// added on both of 2 ranks moves the first loss by 1e-4 relative and its gradient norm by 40%).
//
// A pipeline computes every layer as one rank does and accumulates each weight's gradient over
// the micro-batches in the same order; only the gradient norm sums the stages' squares in
// another order, which reaches the weights through clipping (measured: losses equal, weights
// within 1e-8). Without clipping a pipeline (without tensor parallelism) is bitwise: those
// cases require equal bits.
//
// Every rank, and the single rank, computes on one OpenMP thread: OpenBLAS's GEMMs round
// differently on several threads, and thread ranks run theirs on one each (cpu_backend.cpp).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/experiment_yaml.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/obs/logger.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {

constexpr int kIterations = 10;
constexpr double kLossTolerance = 1e-6;      // relative
constexpr double kGradNormTolerance = 5e-5;  // relative
constexpr double kStateTolerance = 5e-5;     // relative L2 of weights and gradients

// 8 query heads in 4 groups, so that 4 tensor-parallel ranks hold one group each; a vocabulary
// that Megatron's padding keeps at 512 for 1, 2 and 4 ranks. Four micro-batches per step at
// one data-parallel rank; the gradient norm (~1) is clipped at 0.5.
const std::string kExperiment =
    "model: tiny_llama\nmock_data: true\nvocab_size: 512\nnum_layers: 2\nhidden_size: 64\n"
    "ffn_hidden_size: 128\nnum_attention_heads: 8\nnum_query_groups: 4\nseq_length: 32\n"
    "micro_batch_size: 2\nglobal_batch_size: 8\ntrain_iters: 10\nlr: 3.0e-3\n"
    "lr_warmup_iters: 2\nweight_decay: 0.1\nclip_grad: 0.5\nlog_progress: false\n";

// A Mixtral-shaped model: MoE in layers 0 and 2 of 4, 4 experts top-2, both auxiliary losses.
const std::string kMoe =
    "model_family: mixtral\nnum_layers: 4\nnum_experts: 4\nmoe_router_topk: 2\n"
    "moe_ffn_hidden_size: 64\nmoe_layer_freq: \"[1,0,1,0]\"\nmoe_aux_loss_coeff: 1.0e-2\n"
    "moe_z_loss_coeff: 1.0e-3\n";
// The same with a shared expert, which tensor parallelism splits like a dense MLP.
const std::string kMoeShared = kMoe + "moe_shared_expert_intermediate_size: 32\n";

struct TrainedRun {
  std::vector<double> losses, grad_norms;
  // The whole model's weights before the first step and after the last, and the last
  // gradients, in the one-device layout's offsets.
  std::vector<float> initial_weights, weights, grads;
  bool replicas_agree = true;  // replicated parameters equal on every tensor-parallel rank
  bool whole_grads = true;     // false under ZeRO-1, where ranks reduce their own slices only
};

// Puts a rank's parts of every parameter (buffer in its layout) in place in `whole`.
void place(const ParamLayout& layout, const std::vector<float>& local, std::vector<float>& whole,
           std::vector<char>& written, bool& agree) {
  for (const ParamInfo& p : layout.params)
    p.for_each_run(0, p.numel(), [&](int64_t begin, int64_t count, int64_t full_begin) {
      for (int64_t i = 0; i < count; ++i) {
        const float v = local[p.offset + begin + i];
        const int64_t at = p.full_offset + full_begin + i;
        if (written[at] && whole[at] != v) agree = false;
        whole[at] = v;
        written[at] = 1;
      }
    });
}

TrainedRun train(int world, const std::string& lines) {
  const Experiment e =
      testing::experiment_from_yaml(kExperiment + testing::overrides_yaml(lines), {}, world);
  TrainedRun run;
  std::mutex mutex;
  std::vector<char> initial_written, weight_written, grad_written;
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    Logger log("", rank, false, false);
    omp_set_num_threads(1);
    Trainer trainer(e, make_cpu_backend(), log, nullptr, world > 1 ? &comm : nullptr);
    Model& m = trainer.model();
    std::vector<float> initial(m.params().numel());
    m.backend().download(initial.data(), m.params());
    std::vector<double> losses, norms;
    for (int it = 1; it <= kIterations; ++it) {
      const IterationStats s = trainer.run_iteration(it);
      losses.push_back(s.loss);
      norms.push_back(s.grad_norm);
    }
    std::vector<float> params(m.params().numel()), grads(m.grads().numel());
    m.backend().download(params.data(), m.params());
    if (m.grads().dtype == DType::BF16) {  // main_grads_dtype bf16: widened here
      std::vector<uint16_t> bits(grads.size());
      m.backend().download(bits.data(), m.grads());
      for (size_t i = 0; i < bits.size(); ++i) grads[i] = bf16_bits_to_float(bits[i]);
    } else {
      m.backend().download(grads.data(), m.grads());
    }
    const int64_t whole = make_param_layout(m.spec()).total;
    std::lock_guard lock(mutex);
    if (rank == 0) run.losses = losses, run.grad_norms = norms;
    if (run.weights.empty()) {
      run.initial_weights.assign(whole, 0.0f), run.weights.assign(whole, 0.0f);
      run.grads.assign(whole, 0.0f);
      initial_written.assign(whole, 0), weight_written.assign(whole, 0);
      grad_written.assign(whole, 0);
    }
    place(m.layout(), initial, run.initial_weights, initial_written, run.replicas_agree);
    place(m.layout(), params, run.weights, weight_written, run.replicas_agree);
    run.whole_grads = !trainer.optimizer().sharded();
    if (run.whole_grads) place(m.layout(), grads, run.grads, grad_written, run.replicas_agree);
  });
  return run;
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tolerance,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), tolerance * std::abs(want[i]))
        << what << " at iteration " << i + 1 << ": " << got[i] << " vs " << want[i];
}

// The single-rank run of the experiment with `model` lines, once per process.
const TrainedRun& single_rank(const std::string& model) {
  static std::map<std::string, TrainedRun> runs;
  if (!runs.count(model)) runs.emplace(model, train(1, model));
  return runs.at(model);
}

struct Mesh {
  const char* name;
  int world;
  std::string lines;       // the mesh and how it runs
  std::string model = "";  // keys of the model both runs train
  bool bitwise = false;    // equal bits required
  // Relative L2 bound of the weights and gradients. Gradients kept in bf16 differ by one bf16
  // step (2^-8 relative) wherever the ranks' other summation order rounds the other way
  // (measured: last gradients 7.3e-4, weights 6.8e-5); a wrong split misses by far more.
  double state_tolerance = kStateTolerance;
};

void PrintTo(const Mesh& m, std::ostream* os) {
  *os << m.name;
}

class ModelParallel : public ::testing::TestWithParam<Mesh> {};

TEST_P(ModelParallel, TrainsLikeOneRank) {
  const TrainedRun& one = single_rank(GetParam().model);
  // The steps move the weights far more than the tolerance.
  ASSERT_GT(relative_l2(one.initial_weights, one.weights), 100 * kStateTolerance);
  const TrainedRun run = train(GetParam().world, GetParam().model + GetParam().lines);
  if (GetParam().bitwise) {
    EXPECT_EQ(run.losses, one.losses);
    EXPECT_EQ(run.weights, one.weights) << "final weights";
    EXPECT_EQ(run.grads, one.grads) << "last gradients";
    expect_close(run.grad_norms, one.grad_norms, kGradNormTolerance, "gradient norm");
    return;
  }
  expect_close(run.losses, one.losses, kLossTolerance, "loss");
  expect_close(run.grad_norms, one.grad_norms, kGradNormTolerance, "gradient norm");
  const double state = GetParam().state_tolerance;
  EXPECT_LE(relative_l2(run.weights, one.weights), state) << "final weights";
  if (run.whole_grads) EXPECT_LE(relative_l2(run.grads, one.grads), state) << "last gradients";
  EXPECT_TRUE(run.replicas_agree) << "replicated parameters differ between tensor-parallel ranks";
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ModelParallel,
    ::testing::Values(
        Mesh{"tp2", 2, "tensor_model_parallel_size: 2\n"},
        Mesh{"tp2_sp", 2, "tensor_model_parallel_size: 2\nsequence_parallel: true\n"},
        Mesh{"tp4", 4, "tensor_model_parallel_size: 4\n"},
        Mesh{"tp4_sp", 4, "tensor_model_parallel_size: 4\nsequence_parallel: true\n"},
        // With data parallelism: each data-parallel rank one micro-batch per step.
        Mesh{"tp2_sp_dp2", 4, "tensor_model_parallel_size: 2\nsequence_parallel: true\n"},
        Mesh{"tp2_dp2_zero1", 4,
             "tensor_model_parallel_size: 2\nuse_distributed_optimizer: true\n"
             "ddp_bucket_size: 5000\n"},
        // Split biases of the fused QKV projection, a head tied to the embedding.
        Mesh{"tp2_sp_qkv_bias_tied", 2, "tensor_model_parallel_size: 2\nsequence_parallel: true\n",
             "add_qkv_bias: true\nuntie_embeddings_and_output_weights: false\n"},
        Mesh{"tp4_qkv_bias_tied", 4, "tensor_model_parallel_size: 4\n",
             "add_qkv_bias: true\nuntie_embeddings_and_output_weights: false\n"},
        // Recompute reruns the gathers; the head in chunks that do not divide
        // the tokens.
        Mesh{"tp2_sp_full_recompute_chunked_head", 2,
             "tensor_model_parallel_size: 2\nsequence_parallel: true\n"
             "recompute_granularity: full\ncross_entropy_chunk_tokens: 24\n"},
        Mesh{"tp4_sp_selective_recompute", 4,
             "tensor_model_parallel_size: 4\nsequence_parallel: true\n"
             "recompute_granularity: selective\n"},
        // Pipelines: 1F1B, interleaved over 2 model chunks per rank, uneven.
        Mesh{"pp2", 2, "pipeline_model_parallel_size: 2\n", "num_layers: 4\n"},
        Mesh{"pp4", 4, "pipeline_model_parallel_size: 4\n", "num_layers: 4\n"},
        Mesh{"pp2_interleaved", 2,
             "pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n",
             "num_layers: 4\n"},
        Mesh{"pp4_interleaved", 4,
             "pipeline_model_parallel_size: 4\nnum_layers_per_virtual_pipeline_stage: 1\n",
             "num_layers: 8\n"},
        Mesh{"pp3_uneven_full_recompute", 3,
             "pipeline_model_parallel_size: 3\ndecoder_first_pipeline_num_layers: 2\n"
             "recompute_granularity: full\n",
             "num_layers: 4\n"},
        Mesh{"pp4_no_clipping", 4, "pipeline_model_parallel_size: 4\n",
             "num_layers: 4\nclip_grad: 0\n", true},
        Mesh{"pp4_interleaved_no_clipping", 4,
             "pipeline_model_parallel_size: 4\nvirtual_pipeline_model_parallel_size: 2\n",
             "num_layers: 8\nclip_grad: 0\n", true},
        // Gradients kept in bf16 (the precision-aware optimizer): the vocabulary-parallel
        // embedding's backward and the sequence-parallel norms' sums write bf16 gradients.
        Mesh{"tp2_sp_bf16_grads", 2, "tensor_model_parallel_size: 2\nsequence_parallel: true\n",
             "use_distributed_optimizer: true\nuse_precision_aware_optimizer: true\n"
             "main_grads_dtype: bf16\n",
             false, 2e-3},
        Mesh{"pp2_bf16_grads_no_clipping", 2, "pipeline_model_parallel_size: 2\n",
             "num_layers: 4\nclip_grad: 0\nuse_distributed_optimizer: true\n"
             "use_precision_aware_optimizer: true\nmain_grads_dtype: bf16\n",
             true},
        // Context parallelism: 2 and 4 ranks, causal and with a sliding window wider than a
        // chunk (8 tokens at 2 ranks), with data, tensor and sequence parallelism.
        Mesh{"cp2", 2, "context_parallel_size: 2\n"},
        Mesh{"cp2_window", 2, "context_parallel_size: 2\n", "sliding_window: 12\n"},
        Mesh{"cp4_window", 4, "context_parallel_size: 4\n", "sliding_window: 6\n"},
        Mesh{"cp2_dp2_zero1", 4,
             "context_parallel_size: 2\nuse_distributed_optimizer: true\nddp_bucket_size: 5000\n"},
        Mesh{"tp2_sp_cp2_window", 4,
             "tensor_model_parallel_size: 2\nsequence_parallel: true\ncontext_parallel_size: 2\n",
             "sliding_window: 12\n"},
        // The three together on 8 ranks.
        Mesh{"tp2_sp_pp2_dp2", 8,
             "tensor_model_parallel_size: 2\nsequence_parallel: true\n"
             "pipeline_model_parallel_size: 2\n",
             "num_layers: 4\n"},
        Mesh{"tp2_cp2_pp2", 8,
             "tensor_model_parallel_size: 2\ncontext_parallel_size: 2\n"
             "pipeline_model_parallel_size: 2\n",
             "num_layers: 4\n"},
        Mesh{"tp2_pp2_interleaved_dp2_zero1", 8,
             "tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n"
             "virtual_pipeline_model_parallel_size: 2\nuse_distributed_optimizer: true\n"
             "ddp_bucket_size: 5000\n",
             "num_layers: 4\n"},
        // MoE layers over pipeline stages (their balance statistics summed over the stages,
        // each backward with its own micro-batch's routing), and with their experts spread
        // over a stage's data-parallel ranks (expert parallelism beside the pipeline): alone,
        // with more data-parallel than expert-parallel ranks, ZeRO-1, interleaved stages.
        Mesh{"moe_pp2", 2, "pipeline_model_parallel_size: 2\n", kMoe},
        Mesh{"moe_pp2_interleaved", 2,
             "pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n", kMoe},
        Mesh{"moe_pp2_ep2", 4, "pipeline_model_parallel_size: 2\nexpert_model_parallel_size: 2\n",
             kMoe},
        Mesh{"moe_pp2_ep2_zero1", 4,
             "pipeline_model_parallel_size: 2\nexpert_model_parallel_size: 2\n"
             "use_distributed_optimizer: true\nddp_bucket_size: 5000\n",
             kMoe},
        Mesh{"moe_pp2_ep2_dp4", 8,
             "pipeline_model_parallel_size: 2\nexpert_model_parallel_size: 2\n", kMoe},
        Mesh{"moe_pp2_ep4_zero1", 8,
             "pipeline_model_parallel_size: 2\nexpert_model_parallel_size: 4\n"
             "use_distributed_optimizer: true\n",
             kMoe},
        // MoE layers under tensor parallelism (attention and the shared expert split, the
        // router and the routed experts whole on each tensor-parallel rank), with expert,
        // data and pipeline parallelism beside.
        Mesh{"moe_tp2", 2, "tensor_model_parallel_size: 2\n", kMoeShared},
        Mesh{"moe_tp2_ep2", 4, "tensor_model_parallel_size: 2\nexpert_model_parallel_size: 2\n",
             kMoeShared},
        Mesh{"moe_tp2_ep2_zero1", 4,
             "tensor_model_parallel_size: 2\nexpert_model_parallel_size: 2\n"
             "use_distributed_optimizer: true\nddp_bucket_size: 5000\n",
             kMoeShared},
        Mesh{"moe_tp2_pp2_ep2", 8,
             "tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n"
             "expert_model_parallel_size: 2\n",
             kMoeShared}),
    [](const ::testing::TestParamInfo<Mesh>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tessera
