// FP8 experts of MoE models on the CPU emulation: the experts' grouped GEMMs run in FP8 (one
// input scale per expert GEMM, a weight scale per expert) and the model's loss and gradients
// stay near fp32; the per-expert scaling state is delayed, checkpointed and restored exactly;
// expert parallelism over 2 thread ranks computes what one rank does; the planner counts the
// FP8 buffers the model allocates.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <vector>

#include "common/moe_host_copies.h"
#include "common/placed_layout.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/distributed/expert_exchange.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kExperts = 4;

// Two MoE layers of 4 experts top-2 (widths multiples of 16, as FP8 GEMMs need), with a
// shared expert in the qwen3_moe variant. Routing is force-balanced so that FP8's rounding
// cannot flip a near-tied token to another expert between the runs compared.
ModelSpec moe_spec(bool shared = false) {
  ModelSpec s;
  s.family = shared ? "qwen3_moe" : "mixtral";
  s.vocab_size = s.tokenizer_vocab = 128;
  s.max_position_embeddings = 64;
  s.hidden = 64, s.ffn = 128, s.num_layers = 2, s.heads = 4, s.kv_heads = 2, s.head_dim = 16;
  s.moe.experts = kExperts, s.moe.topk = 2, s.moe.ffn = 32, s.moe.layers = {true, true};
  s.moe.shared_ffn = shared ? 32 : 0;
  s.moe.aux_loss_coeff = 0.01;
  return s;
}

ModelRuntime moe_runtime(const Fp8Options& fp8) {
  ModelRuntime rt;
  rt.micro_batch = 2, rt.seq_length = 16;
  rt.moe_force_balance = true;
  rt.fp8 = fp8;
  return rt;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch batch(int64_t n, int salt = 0) {
  Batch b;
  for (int64_t i = 0; i < n; ++i)
    b.tokens.push_back(static_cast<int32_t>((i * 37 + salt) % 128)),
        b.targets.push_back(static_cast<int32_t>((i * 53 + 1 + salt) % 128));
  return b;
}

struct MoeRun {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<DecoderModel> model;
  std::vector<float> grads;
  float loss = 0;
};

// One forward and backward of `b`, then (FP8) the step's end: amaxes into the scales.
void step(MoeRun& r, const Batch& b) {
  r.model->set_batch(b.tokens.data(), b.targets.data());
  r.model->zero_grads();
  r.model->zero_loss_sum();
  r.model->forward_backward(1.0f / static_cast<float>(b.tokens.size()));
  if (r.model->fp8()) {
    DeviceBuffer norm(*r.backend, 4, "norm");
    r.backend->fill(norm.tensor(DType::F32, {1}), 0.0f);
    r.model->fp8()->end_step(norm.tensor(DType::F32, {1}));
  }
  r.backend->download(&r.loss, r.model->loss_sum());
  r.grads.resize(r.model->layout().total);
  r.backend->download(r.grads.data(), r.model->grads());
}

MoeRun run_moe(const Fp8Options& fp8, int steps, bool shared = false,
               RecomputeGranularity recompute = RecomputeGranularity::None) {
  MoeRun r;
  const ModelSpec spec = moe_spec(shared);
  ModelRuntime rt = moe_runtime(fp8);
  rt.recompute = recompute;
  r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
  init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 5);
  for (int i = 0; i < steps; ++i) step(r, batch(rt.tokens()));
  return r;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref, int64_t off, int64_t n) {
  double d = 0, s = 0;
  for (int64_t i = off; i < off + n; ++i)
    d += double(a[i] - ref[i]) * (a[i] - ref[i]), s += double(ref[i]) * ref[i];
  return std::sqrt(d / std::max(s, 1e-30));
}

Fp8Options hybrid(Fp8Recipe recipe = Fp8Recipe::Delayed, bool cache = true) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.recipe = recipe;
  o.weight_cache = cache;
  o.amax_history_len = 4;
  return o;
}

struct Variant {
  Fp8Mode mode;
  Fp8Recipe recipe;
  bool cache, shared;
  RecomputeGranularity recompute;
};

class Fp8Moe : public ::testing::TestWithParam<Variant> {};

// The tolerances of the dense FP8 model test (Fp8Model.LossAndGradientsStayNearFp32).
TEST_P(Fp8Moe, LossAndGradientsStayNearFp32) {
  const Variant v = GetParam();
  Fp8Options o = hybrid(v.recipe, v.cache);
  o.mode = v.mode;
  const MoeRun ref = run_moe(Fp8Options{}, 1, v.shared, v.recompute);
  // Three steps on one batch without updates: the first scales just in time, the later ones
  // from the history (delayed).
  const MoeRun fp8 = run_moe(o, 3, v.shared, v.recompute);
  EXPECT_NEAR(fp8.loss / ref.loss, 1.0, 0.02);
  int expert_stacks = 0;
  for (const ParamInfo& p : ref.model->layout().params) {
    const double e = rel_err(fp8.grads, ref.grads, p.offset, p.numel());
    EXPECT_LT(e, v.mode == Fp8Mode::Hybrid ? 0.25 : 0.15) << p.name;
    if (p.name.find("mlp.experts.") == std::string::npos) continue;
    ++expert_stacks;
    EXPECT_GT(e, 0.0) << p.name << ": identical to fp32, so the experts did not run in FP8";
  }
  EXPECT_EQ(expert_stacks, 4);
  float status = 0;
  fp8.backend->download(&status, fp8.model->fp8()->status());
  EXPECT_EQ(status, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, Fp8Moe,
    ::testing::Values(
        Variant{Fp8Mode::Hybrid, Fp8Recipe::Delayed, true, false, RecomputeGranularity::None},
        Variant{Fp8Mode::Hybrid, Fp8Recipe::Delayed, false, true, RecomputeGranularity::None},
        Variant{Fp8Mode::Hybrid, Fp8Recipe::Tensorwise, true, true, RecomputeGranularity::None},
        Variant{Fp8Mode::E4M3, Fp8Recipe::Delayed, true, false, RecomputeGranularity::None},
        Variant{Fp8Mode::Hybrid, Fp8Recipe::Delayed, true, true, RecomputeGranularity::Selective},
        Variant{Fp8Mode::Hybrid, Fp8Recipe::Tensorwise, false, false, RecomputeGranularity::Full}));

// Recomputing a layer recasts the same values with the same scales: the same numbers.
// The row groups' offsets stay on the device where the experts' grouped GEMMs read them there
// (bf16, fp32 or FP8 experts: Backend::grouped_matmul_reads_device_offsets), so no MoE layer
// waits for its routing.
TEST(Fp8MoeRouting, ExpertsNeverCopyTheirRowGroupsToTheHost) {
  for (const bool fp8 : {false, true}) {
    MoeRun r;
    const ModelSpec spec = moe_spec();
    const ModelRuntime rt = moe_runtime(fp8 ? hybrid() : Fp8Options{});
    r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
    init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 5);
    testing::MoeHostCopies copies;
    r.backend->set_op_observer(&copies);
    step(r, batch(rt.tokens()));
    r.backend->set_op_observer(nullptr);
    EXPECT_EQ(copies.grouped, 2 * 6) << "grouped GEMMs of two MoE layers' forward and backward";
    EXPECT_EQ(copies.downloads, 0) << (fp8 ? "fp8" : "fp32") << " experts";
  }
}

TEST(Fp8MoeState, RecomputeChangesNothing) {
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise}) {
    const MoeRun plain = run_moe(hybrid(recipe), 2, true);
    for (RecomputeGranularity g : {RecomputeGranularity::Selective, RecomputeGranularity::Full}) {
      const MoeRun again = run_moe(hybrid(recipe), 2, true, g);
      EXPECT_EQ(again.loss, plain.loss);
      EXPECT_TRUE(again.grads == plain.grads) << "recompute " << static_cast<int>(g);
    }
  }
}

// Forward columns per layer: (input, weight) for qkv and o_proj, then (input, 4 experts'
// weights) for each expert stack; backward columns one per GEMM.
TEST(Fp8MoeState, EveryExpertHasItsOwnDelayedWeightScale) {
  MoeRun r = run_moe(hybrid(), 2);
  const auto state = r.model->fp8()->state_tensors();
  ASSERT_EQ(state.size(), 6u);
  const Tensor& hist = state[0].second;
  const int64_t per_layer = 2 * 2 + 2 * (1 + kExperts);
  ASSERT_EQ(hist.dim(1), 2 * per_layer);
  EXPECT_EQ(state[3].second.dim(1), 2 * 4);
  std::vector<float> h(hist.numel()), scale(hist.dim(1));
  r.backend->download(h.data(), hist);
  r.backend->download(scale.data(), state[1].second);
  const int64_t S = hist.dim(1), H = hist.dim(0);
  std::vector<float> amaxes(S, 0.0f);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t row = 0; row < H; ++row) amaxes[s] = std::max(amaxes[s], h[row * S + s]);
    ASSERT_GT(amaxes[s], 0.0f) << "slot " << s << " recorded no amax";
    EXPECT_EQ(scale[s], 448.0f / amaxes[s]) << "slot " << s;
  }
  // Each expert's weight slot holds that expert's amax, the max |w| of its own matrix.
  const ParamInfo* up = r.model->layout().find("model.layers.1.mlp.experts.gate_up_proj.weight");
  ASSERT_NE(up, nullptr);
  std::vector<float> w(up->numel());
  r.backend->download(w.data(),
                      r.model->param(static_cast<int>(up - r.model->layout().params.data())));
  const int64_t per_expert = up->numel() / kExperts;
  for (int64_t e = 0; e < kExperts; ++e) {
    float m = 0;
    for (int64_t i = 0; i < per_expert; ++i) m = std::max(m, std::fabs(w[e * per_expert + i]));
    EXPECT_EQ(amaxes[per_layer + 4 + 1 + e], m) << "expert " << e;
  }
}

// A NaN in one expert's weight is caught by its amax: the status reports it and poisons the
// norm, so the trainer skips the step.
TEST(Fp8MoeState, NaNInAnExpertWeightIsReported) {
  MoeRun r = run_moe(hybrid(), 1);
  const ParamInfo* down = r.model->layout().find("model.layers.0.mlp.experts.down_proj.weight");
  ASSERT_NE(down, nullptr);
  const float nan = NAN;
  r.backend->upload(r.model->param(static_cast<int>(down - r.model->layout().params.data()))
                        .flat_range(down->numel() - 3, 1),
                    &nan);
  r.model->params_updated();
  r.model->fp8()->clear_status();
  step(r, batch(32));
  float status = 0;
  r.backend->download(&status, r.model->fp8()->status());
  EXPECT_TRUE(std::isnan(status));
}

// Save after two steps, load into a fresh model: its next step equals the original's bit for
// bit (the scales, histories and weights are all restored).
TEST(Fp8MoeState, CheckpointResumesBitwise) {
  const Fp8Options o = hybrid();
  MoeRun r = run_moe(o, 2, true);
  const ModelSpec spec = moe_spec(true);
  Backend& b = *r.backend;
  const int64_t P = r.model->layout().total;
  DeviceBuffer opt(b, 3 * P * 4, "optimizer");
  TrainingTensors t;
  t.backend = &b;
  t.spec = &spec;
  t.layout = &r.model->layout();
  t.param = [m = r.model.get()](int index) { return m->param(index); };
  t.master = opt.tensor(DType::F32, {P});
  t.exp_avg = opt.tensor(DType::F32, {P}, P * 4);
  t.exp_avg_sq = opt.tensor(DType::F32, {P}, 2 * P * 4);
  t.extra_state = r.model->fp8()->state_tensors();
  b.copy(t.master, r.model->params());
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_fp8_moe_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  TrainerState st;
  st.iteration = 2;
  const std::string saved = save_checkpoint(dir.string(), t, st, 0);

  MoeRun fresh;
  fresh.model = std::make_unique<DecoderModel>(*fresh.backend, spec, moe_runtime(o));
  TrainingTensors t2 = t;
  DeviceBuffer opt2(*fresh.backend, 3 * P * 4, "optimizer");
  t2.backend = fresh.backend.get();
  t2.layout = &fresh.model->layout();
  t2.master = opt2.tensor(DType::F32, {P});
  t2.exp_avg = opt2.tensor(DType::F32, {P}, P * 4);
  t2.exp_avg_sq = opt2.tensor(DType::F32, {P}, 2 * P * 4);
  t2.extra_state = fresh.model->fp8()->state_tensors();
  t2.param = [m = fresh.model.get()](int index) { return m->param(index); };
  std::vector<std::string> warnings;
  const TrainerState loaded = load_checkpoint(saved, t2, &warnings);
  EXPECT_TRUE(loaded.extra_state_restored);
  EXPECT_TRUE(warnings.empty());
  fresh.model->fp8()->state_restored();
  fresh.backend->copy(fresh.model->params(), t2.master);  // as the trainer does after loading
  fresh.model->params_updated();
  const Batch next = batch(32, 7);
  r.model->params_updated();  // as after an optimizer step: both cast their weights afresh
  step(r, next);
  step(fresh, next);
  EXPECT_EQ(fresh.loss, r.loss);
  EXPECT_TRUE(fresh.grads == r.grads) << "gradients of the resumed step differ";
  for (size_t i = 0; i < t.extra_state.size(); ++i) {
    std::vector<float> a(t.extra_state[i].second.numel()), c(a.size());
    b.download(a.data(), t.extra_state[i].second);
    fresh.backend->download(c.data(), t2.extra_state[i].second);
    EXPECT_TRUE(a == c) << t.extra_state[i].first << " after the resumed step";
  }
  fs::remove_all(dir);
}

// Two ranks with the same tokens, experts split between them, from the scaling state of one
// rank's step (so no scale is taken just in time from a rank's own rows): each rank holds its
// experts, whose gradients are twice one model's, everything else one model's; and after the step
// the amaxes, max-reduced over the ranks, give one model's scales exactly.
TEST(Fp8MoeExpertParallel, TwoRanksComputeWhatOneDoes) {
  const Fp8Options o = hybrid();
  const ModelSpec spec = moe_spec(true);
  MoeRun one = run_moe(o, 1, true);
  std::vector<std::vector<float>> state_values;
  for (const auto& [name, t] : one.model->fp8()->state_tensors()) {
    state_values.emplace_back(t.numel());
    one.backend->download(state_values.back().data(), t);
  }
  std::vector<float> weights(one.model->layout().total);
  one.backend->download(weights.data(), one.model->params());
  const Batch b = batch(32, 3);
  one.model->params_updated();  // the weights' codes cast again, with the state's scales
  step(one, b);
  std::vector<std::vector<float>> one_state;
  for (const auto& [name, t] : one.model->fp8()->state_tensors()) {
    one_state.emplace_back(t.numel());
    one.backend->download(one_state.back().data(), t);
  }

  std::vector<std::vector<float>> grads(2), states(2);
  std::vector<ParamLayout> layouts(2);
  dist::run_local_ranks(2, [&](int rank, dist::Communicator& comm) {
    ModelRuntime rt = moe_runtime(o);
    rt.expert_parallel_size = 2;
    rt.expert_parallel_rank = rank;
    MoeRun r;
    r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
    layouts[rank] = r.model->layout();
    dist::CommExpertExchange exchange(*r.backend, comm);
    r.model->set_expert_exchange(&exchange);
    r.backend->upload(r.model->params(), testing::placed_part(layouts[rank], weights).data());
    r.model->params_updated();
    const auto state = r.model->fp8()->state_tensors();
    for (size_t i = 0; i < state.size(); ++i)
      r.backend->upload(state[i].second, state_values[i].data());
    r.model->fp8()->state_restored();
    r.model->fp8()->set_amax_reducer([&comm](const Tensor& amaxes) {
      comm.all_reduce(amaxes, dist::ReduceOp::Max, dist::Lane::Compute);
    });
    step(r, b);
    grads[rank] = r.grads;
    for (const auto& [name, t] : state) {
      std::vector<float> v(t.numel());
      r.backend->download(v.data(), t);
      states[rank].insert(states[rank].end(), v.begin(), v.end());
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    std::map<std::string, std::pair<double, double>> diff_norm;
    testing::for_each_placed_element(
        layouts[rank], [&](int64_t local, int64_t whole, const ParamInfo& p) {
          const bool experts = p.tp == TensorParallelStyle::Expert;
          const double want = experts ? 2.0 * one.grads[whole] : one.grads[whole];
          auto& [diff, norm] = diff_norm[p.name];
          diff += std::pow(grads[rank][local] - want, 2), norm += want * want;
        });
    ASSERT_EQ(diff_norm.size(), one.model->layout().params.size());
    for (const auto& [name, dn] : diff_norm)
      EXPECT_LT(std::sqrt(dn.first / dn.second), 1e-5) << name << " on rank " << rank;
  }
  std::vector<float> one_flat;
  for (const auto& v : one_state) one_flat.insert(one_flat.end(), v.begin(), v.end());
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_TRUE(states[rank] == one_flat) << "rank " << rank << "'s scaling state";
}

// The planner's FP8 bytes are the bytes the model's FP8 state allocates, with and without
// the transpose cache, and with expert parallelism (each rank caches its experts' codes).
TEST(Fp8MoePlan, PlannedBytesAreAllocated) {
  for (int ep : {1, 2})
    for (bool cache : {true, false}) {
      SCOPED_TRACE("ep " + std::to_string(ep) + (cache ? " cache" : " no cache"));
      ModelRuntime rt = moe_runtime(hybrid(Fp8Recipe::Delayed, cache));
      rt.expert_parallel_size = ep;
      ModelRuntime plain = rt;
      plain.fp8 = Fp8Options{};
      const ModelSpec spec = moe_spec(true);
      auto b = make_cpu_backend();
      size_t with = 0, without = 0;
      {
        DecoderModel m(*b, spec, rt);
        with = b->memory_stats().allocated_bytes;
      }
      {
        DecoderModel m(*b, spec, plain);
        without = b->memory_stats().allocated_bytes;
      }
      const ModelMemory planned = DecoderModel::plan_memory(spec, rt);
      EXPECT_EQ(with - without, planned.fp8);
      EXPECT_GT(planned.fp8, DecoderModel::plan_memory(spec, plain).fp8);
    }
}

}  // namespace
}  // namespace tessera
