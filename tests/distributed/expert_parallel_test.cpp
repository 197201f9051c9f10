// Expert parallelism on thread ranks (LocalCommunicator): the variable-size all-to-all, and
// training a tiny MoE (GQA, or DeepSeek's multi-latent attention) with its experts spread over 2
// and 4 ranks, alone and with ZeRO-1 and more data-parallel ranks than expert-parallel ones,
// like one rank at the same global batch:
// the same losses, gradient norms, balance statistics and weights after a few steps (each
// rank reads other samples and gradients are summed in another order: equal to fp32
// rounding). Each rank holds only its experts' weights; what several ranks hold stays
// identical on them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include "common/experiment_yaml.h"
#include "common/moe_balance_of.h"
#include "common/placed_layout.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/distributed/expert_exchange.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {

using dist::Communicator;
using dist::Lane;
using dist::run_local_ranks;

Tensor host(std::vector<float>& v) {
  return Tensor{v.data(), DType::F32, {static_cast<int64_t>(v.size())}, Device{}};
}

// Rank r sends (r + 1) * (j + 1) values to rank j (none to itself when r is 2): block sizes
// that differ by peer, with an empty one.
TEST(AllToAllV, VariableBlocksReachTheirPeersInOneGroupOfTransfers) {
  constexpr int kWorld = 4;
  run_local_ranks(kWorld, [&](int rank, Communicator& comm) {
    auto count = [](int from, int to) { return from == 2 && to == 2 ? 0 : (from + 1) * (to + 1); };
    std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
    int64_t sent = 0, received = 0;
    for (int j = 0; j < kWorld; ++j) {
      send_offsets.push_back(sent), send_counts.push_back(count(rank, j));
      recv_offsets.push_back(received), recv_counts.push_back(count(j, rank));
      sent += count(rank, j), received += count(j, rank);
    }
    std::vector<float> in(sent), out(received, -1.0f);
    for (int j = 0; j < kWorld; ++j)
      for (int64_t k = 0; k < send_counts[j]; ++k)
        in[send_offsets[j] + k] = static_cast<float>(1000 * rank + 100 * j + k);
    comm.all_to_allv(host(out), recv_counts, recv_offsets, host(in), send_counts, send_offsets,
                     Lane::Compute);
    for (int i = 0; i < kWorld; ++i)
      for (int64_t k = 0; k < recv_counts[i]; ++k)
        EXPECT_EQ(out[recv_offsets[i] + k], 1000 * i + 100 * rank + k)
            << "rank " << rank << " from " << i;
  });
}

// Two ranks with the same tokens, experts split between them: each holds and runs its two
// experts on both ranks' rows, so its experts' gradients are twice one model's, and
// everything outside the experts is one model's.
TEST(ExpertParallel, EachRankRunsItsExpertsOnEveryRanksRows) {
  ModelSpec s;
  s.family = "mixtral";
  s.vocab_size = s.tokenizer_vocab = 64;
  s.num_layers = 2, s.hidden = 32, s.ffn = 40, s.heads = 4, s.kv_heads = 2, s.head_dim = 8;
  s.max_position_embeddings = 64, s.init_std = 0.1f;
  s.moe.experts = 4, s.moe.topk = 2, s.moe.ffn = 24, s.moe.layers = {true, true};
  s.moe.aux_loss_coeff = 0.01;
  ModelRuntime rt;
  rt.micro_batch = 2, rt.seq_length = 12;
  const ParamLayout layout = make_param_layout(s);
  auto reference_backend = make_cpu_backend();
  DeviceBuffer init(*reference_backend, layout.total * 4, "weights");
  init_parameters(*reference_backend, s, layout, init.tensor(DType::F32, {layout.total}), 3);
  std::vector<float> weights(layout.total);
  reference_backend->download(weights.data(), init.tensor(DType::F32, {layout.total}));
  const int64_t N = rt.tokens();
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i) tokens[i] = (i * 37) % 64, targets[i] = (i * 11 + 5) % 64;
  auto run = [&](Backend& b, DecoderModel& model) {
    b.upload(model.params(), testing::placed_part(model.layout(), weights).data());
    model.set_batch(tokens.data(), targets.data());
    model.zero_grads();
    model.zero_loss_sum();
    model.forward_backward(1.0f / N);
    std::vector<float> g(model.layout().total);
    b.download(g.data(), model.grads());
    return g;
  };
  DecoderModel one(*reference_backend, s, rt);
  const std::vector<float> single = run(*reference_backend, one);
  std::vector<std::vector<float>> grads(2);
  std::vector<ParamLayout> layouts(2);
  run_local_ranks(2, [&](int rank, Communicator& comm) {
    ModelRuntime ep_rt = rt;
    ep_rt.expert_parallel_size = 2;
    ep_rt.expert_parallel_rank = rank;
    auto b = make_cpu_backend();
    DecoderModel model(*b, s, ep_rt);
    dist::CommExpertExchange exchange(*b, comm);
    model.set_expert_exchange(&exchange);
    grads[rank] = run(*b, model);
    layouts[rank] = model.layout();
  });
  for (int rank = 0; rank < 2; ++rank) {
    // Half of each expert stack, everything else whole.
    EXPECT_LT(layouts[rank].total, layout.total);
    for (const ParamInfo& p : layouts[rank].params)
      EXPECT_EQ(p.numel() * (p.tp == TensorParallelStyle::Expert ? 2 : 1),
                layout.find(p.name)->numel())
          << p.name;
    std::map<std::string, std::pair<double, double>> diff_norm;
    testing::for_each_placed_element(
        layouts[rank], [&](int64_t local, int64_t whole, const ParamInfo& p) {
          const bool experts = p.tp == TensorParallelStyle::Expert;
          const double want = experts ? 2.0 * single[whole] : single[whole];
          auto& [diff, norm] = diff_norm[p.name];
          diff += std::pow(grads[rank][local] - want, 2), norm += want * want;
        });
    ASSERT_EQ(diff_norm.size(), layout.params.size());
    for (const auto& [name, dn] : diff_norm)
      EXPECT_LT(std::sqrt(dn.first / dn.second), 1e-5) << name << " on rank " << rank;
  }
}

// 4 experts top-2 in both layers, a shared expert, both losses.
const char* kTinyMoe =
    "model: tiny_moe\nmock_data: true\nnum_layers: 2\nhidden_size: 32\nffn_hidden_size: 48\n"
    "moe_ffn_hidden_size: 24\nmoe_shared_expert_intermediate_size: 16\nnum_attention_heads: 4\n"
    "num_query_groups: 2\nmoe_layer_freq: 1\nvocab_size: 64\nseq_length: 16\n"
    "micro_batch_size: 1\nglobal_batch_size: 8\ntrain_iters: 4\nlr: 0.01\nlr_warmup_iters: 1\n"
    "ddp_bucket_size: 3000\n";

struct TrainingRun {
  std::vector<double> losses, norms, aux;
  std::vector<std::vector<float>> params;  // per rank, after the last step
  std::vector<ParamLayout> layouts;        // per rank
  int64_t whole_params = 0;                // elements of the one-device layout

  // The one-device model from every rank's part; every element that several ranks hold
  // (all but the experts) must be the same on each.
  std::vector<float> whole_model() const {
    std::vector<float> whole(static_cast<size_t>(whole_params), 0.0f);
    std::vector<int> holder(whole.size(), -1);
    for (size_t r = 0; r < params.size(); ++r)
      testing::for_each_placed_element(
          layouts[r], [&](int64_t local, int64_t w, const ParamInfo& p) {
            if (holder[w] >= 0) {
              EXPECT_EQ(params[r][local], whole[w])
                  << p.name << ": rank " << r << " differs from rank " << holder[w];
              return;
            }
            whole[w] = params[r][local], holder[w] = static_cast<int>(r);
          });
    return whole;
  }
};

TrainingRun train(int ranks, std::vector<std::string> flags) {
  const Experiment e = testing::experiment_from_yaml(kTinyMoe, flags, ranks);
  TrainingRun run;
  run.params.resize(ranks);
  run.layouts.resize(ranks);
  std::mutex mutex;
  auto body = [&](int rank, Communicator* comm) {
    Logger log("", 0, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr, comm);
    std::vector<double> losses, norms, aux;
    for (int it = 1; it <= 4; ++it) {
      const IterationStats s = trainer.run_iteration(it);
      losses.push_back(s.loss);
      norms.push_back(s.grad_norm);
      for (const MoeLayerBalance& b : testing::moe_balance_of(trainer.model())) aux.push_back(b.aux_loss);
    }
    std::vector<float> params(static_cast<size_t>(trainer.model().layout().total));
    trainer.backend().download(params.data(), trainer.model().params());
    std::lock_guard lock(mutex);
    run.params[rank] = std::move(params);
    run.layouts[rank] = trainer.model().layout();
    run.whole_params = make_param_layout(trainer.spec()).total;
    if (rank == 0) run.losses = losses, run.norms = norms, run.aux = aux;
  };
  if (ranks == 1) {
    body(0, nullptr);
  } else {
    run_local_ranks(ranks, [&](int rank, Communicator& comm) { body(rank, &comm); });
  }
  return run;
}

double relative(double a, double b) {
  return std::abs(a - b) / std::abs(b);
}

// Measured: losses agree to ~1e-7, gradient norms and aux losses to ~1e-6 and weights after
// four AdamW steps to ~1e-6 (norm-wise); a rank's tokens missing from an expert, or counted
// twice, moves every one of them by more than 1e-3.
TEST(ExpertParallel, ExpertsOverTwoAndFourRanksTrainLikeOneRank) {
  const TrainingRun one = train(1, {});
  ASSERT_EQ(one.losses.size(), 4u);
  struct Layout {
    int ranks;
    std::vector<std::string> flags;
    std::vector<std::string> model;  // the model's keys, the one-rank reference's too
  };
  for (const Layout& l :
       {Layout{2, {"--expert_model_parallel_size", "2"}, {}},
        Layout{4, {"--expert_model_parallel_size", "4"}, {}},
        Layout{4, {"--expert_model_parallel_size", "2", "--use_distributed_optimizer", "true"}, {}},
        // Experts reduced over 2 expert-data-parallel ranks; ZeRO-1 with one (every rank
        // alone with its experts' state).
        Layout{4, {"--expert_model_parallel_size", "2"}, {}},
        Layout{4, {"--expert_model_parallel_size", "4", "--use_distributed_optimizer", "true"}, {}},
        // Token dropping: each rank drops among its own micro-batch's pairs, as one rank does
        // micro-batch by micro-batch (capacity 8 of 32 pairs per expert).
        Layout{2, {"--expert_model_parallel_size", "2"}, {"--moe_expert_capacity_factor", "1.0"}},
        Layout{4,
               {"--expert_model_parallel_size", "2"},
               {"--moe_expert_capacity_factor", "0.75", "--moe_token_drop_policy", "position"}},
        Layout{
            2,
            {"--expert_model_parallel_size", "2"},
            {"--moe_router_score_function", "sigmoid", "--moe_router_enable_expert_bias", "true"}},
        // DeepSeek: multi-latent attention beside the experts (with YaRN, a query latent and
        // sigmoid group-limited routing), the experts over 2 ranks.
        Layout{2,
               {"--expert_model_parallel_size", "2"},
               {"--model_family",
                "deepseek",
                "--multi_latent_attention",
                "true",
                "--num_query_groups",
                "0",
                "--q_lora_rank",
                "12",
                "--kv_lora_rank",
                "16",
                "--qk_head_dim",
                "8",
                "--qk_pos_emb_head_dim",
                "4",
                "--v_head_dim",
                "6",
                "--rotary_scaling_factor",
                "4",
                "--original_max_position_embeddings",
                "8",
                "--moe_router_score_function",
                "sigmoid",
                "--moe_router_num_groups",
                "2",
                "--moe_router_group_topk",
                "1"}}}) {
    std::string name = std::to_string(l.ranks) + " ranks";
    for (const std::string& f : l.flags) name += " " + f;
    for (const std::string& f : l.model) name += " " + f;
    SCOPED_TRACE(name);
    std::vector<std::string> flags = l.flags;
    flags.insert(flags.end(), l.model.begin(), l.model.end());
    const TrainingRun reference = l.model.empty() ? one : train(1, l.model);
    const TrainingRun ep = train(l.ranks, flags);
    double worst_loss = 0, worst_norm = 0, worst_aux = 0;
    for (size_t i = 0; i < reference.losses.size(); ++i) {
      worst_loss = std::max(worst_loss, relative(ep.losses[i], reference.losses[i]));
      worst_norm = std::max(worst_norm, relative(ep.norms[i], reference.norms[i]));
      EXPECT_LT(relative(ep.losses[i], reference.losses[i]), 1e-6) << "loss, iteration " << i + 1;
      EXPECT_LT(relative(ep.norms[i], reference.norms[i]), 1e-4)
          << "grad norm, iteration " << i + 1;
    }
    ASSERT_EQ(ep.aux.size(), reference.aux.size());
    for (size_t i = 0; i < ep.aux.size(); ++i) {
      worst_aux = std::max(worst_aux, relative(ep.aux[i], reference.aux[i]));
      EXPECT_LT(relative(ep.aux[i], reference.aux[i]), 1e-5) << "aux loss " << i;
    }
    const std::vector<float> got = ep.whole_model(), want = reference.whole_model();
    ASSERT_EQ(got.size(), want.size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      diff += std::pow(double(got[i]) - want[i], 2);
      norm += std::pow(double(want[i]), 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << "weights after 4 steps";
    std::printf(
        "[ ep       ] %s: loss %.1e, grad norm %.1e, aux %.1e, weights %.1e (worst relative "
        "differences from one rank; losses %.4f -> %.4f)\n",
        name.c_str(), worst_loss, worst_norm, worst_aux, std::sqrt(diff / norm), ep.losses.front(),
        ep.losses.back());
  }
}

}  // namespace
}  // namespace tessera
