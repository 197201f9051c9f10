// The QK-norm and mixture-of-experts references (backend/cpu/reference.h): routing choices and
// weights worked out by hand for Megatron's rules, the dispatch plan, the losses' values at
// known points, and every gradient against central finite differences (op_test_util.h's
// conventions: L = sum(out * G), accumulating gradients start from random contents).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "op_test_util.h"
#include "tessera/backend/cpu/reference.h"

namespace tessera {
namespace {

using test::all_nonzero;
using test::dot;
using test::expect_gradient;
using test::nan_values;
using test::numerical_gradient;
using test::random_ids;
using test::random_values;

MoeRouting routing(int64_t E, int64_t K, bool sigmoid = false, bool pre_softmax = false,
                   int64_t groups = 0, int64_t group_topk = 0, float scaling = 0.0f,
                   bool force_balance = false) {
  MoeRouting r;
  r.experts = E, r.topk = K, r.sigmoid = sigmoid, r.pre_softmax = pre_softmax;
  r.num_groups = groups, r.group_topk = group_topk, r.scaling = scaling;
  r.force_balance = force_balance;
  return r;
}

struct Routed {
  std::vector<int32_t> indices;
  std::vector<double> weights;
};

Routed route(const std::vector<double>& logits, const MoeRouting& r,
             const std::vector<double>* bias = nullptr) {
  const int64_t N = static_cast<int64_t>(logits.size()) / r.experts;
  Routed out{std::vector<int32_t>(N * r.topk), std::vector<double>(N * r.topk)};
  ref::moe_router_forward(out.indices.data(), out.weights.data(), logits.data(),
                          bias ? bias->data() : nullptr, N, r);
  return out;
}

double softmax_of(const std::vector<double>& v, size_t i) {
  double sum = 0;
  for (double x : v) sum += std::exp(x);
  return std::exp(v[i]) / sum;
}

TEST(ReferenceMoe, RouterChoosesAndWeighsAsMegatron) {
  const std::vector<double> z = {1.0, 3.0, 2.0, 0.5};
  // Top-2 of the logits, softmax over the two (Mixtral, Qwen3-MoE).
  Routed a = route(z, routing(4, 2));
  EXPECT_EQ(a.indices, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(a.weights[0], softmax_of({3.0, 2.0}, 0), 1e-15);
  EXPECT_NEAR(a.weights[1], softmax_of({3.0, 2.0}, 1), 1e-15);
  // Pre-softmax (DeepSeek-V2): the softmax over all four, not renormalised.
  Routed b = route(z, routing(4, 2, false, true));
  EXPECT_EQ(b.indices, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(b.weights[0], softmax_of(z, 1), 1e-15);
  EXPECT_NEAR(b.weights[1], softmax_of(z, 2), 1e-15);
  // Sigmoid: the bias picks expert 0 over 2, the weights are the sigmoids renormalised and
  // scaled (DeepSeek-V3).
  const std::vector<double> bias = {1.0, 0.0, -1.0, 0.0};
  Routed c = route(z, routing(4, 2, true, false, 0, 0, 2.5f), &bias);
  EXPECT_EQ(c.indices, (std::vector<int32_t>{0, 1}));
  const double s0 = 1 / (1 + std::exp(-1.0)), s1 = 1 / (1 + std::exp(-3.0));
  EXPECT_NEAR(c.weights[0], 2.5 * s0 / (s0 + s1), 1e-12);
  EXPECT_NEAR(c.weights[1], 2.5 * s1 / (s0 + s1), 1e-12);
  // Top-1 sigmoid: the raw sigmoid.
  Routed d = route(z, routing(4, 1, true));
  EXPECT_EQ(d.indices, (std::vector<int32_t>{1}));
  EXPECT_NEAR(d.weights[0], s1, 1e-15);
  // Ties go to the lower index.
  Routed e = route({0.5, 2.0, 2.0, 2.0}, routing(4, 2));
  EXPECT_EQ(e.indices, (std::vector<int32_t>{1, 2}));
}

TEST(ReferenceMoe, GroupLimitedRoutingPicksGroupsByTheirTopScores) {
  // Groups {0, 1} and {2, 3}; each scores its top topk / group_topk = 2 experts. Group 0 sums
  // 0.9 + 0.1, group 1 0.6 + 0.5: only group 1 is kept, although expert 0 scores highest.
  const std::vector<double> z = {0.9, 0.1, 0.6, 0.5};
  EXPECT_EQ(route(z, routing(4, 2)).indices, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(route(z, routing(4, 2, false, false, 2, 1)).indices, (std::vector<int32_t>{2, 3}));
  // Two of four groups, top-2 among them: the best per group is what counts (K / 2 = 1).
  const std::vector<double> w = {0.1, 0.9, 0.8, 0.2, 0.3, 0.7, 0.85, 0.0};
  EXPECT_EQ(route(w, routing(8, 2, false, false, 4, 2)).indices, (std::vector<int32_t>{1, 6}));
}

TEST(ReferenceMoe, ForceBalanceRoutesRoundRobin) {
  const MoeRouting r = routing(4, 2, false, false, 0, 0, 0.0f, true);
  std::mt19937_64 rng(20);
  const std::vector<double> z = random_values(6 * 4, rng);
  const Routed out = route(z, r);
  EXPECT_EQ(out.indices, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
  // Weights still the router's softmax over the chosen experts.
  EXPECT_NEAR(out.weights[2], softmax_of({z[4 + 2], z[4 + 3]}, 0), 1e-15);
  std::vector<double> counts(4, 0.0);
  ref::moe_expert_counts(counts.data(), out.indices.data(), 12, 4);
  EXPECT_EQ(counts, (std::vector<double>{3, 3, 3, 3}));
}

TEST(ReferenceMoe, DispatchPlanSortsByExpertPaddedToTheAlignment) {
  // Tokens 0..2 with two experts each; expert 1 has one token, 0 two, 2 three.
  const std::vector<int32_t> indices = {0, 2, 2, 1, 0, 2};
  std::vector<int32_t> rows(6), offsets(4);
  ref::moe_dispatch_plan(rows.data(), offsets.data(), indices.data(), 3, 2, 3, 4);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 4, 8, 12}));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 8, 9, 4, 1, 10}));
  ref::moe_dispatch_plan(rows.data(), offsets.data(), indices.data(), 3, 2, 3, 1);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 2, 3, 6}));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 3, 4, 2, 1, 5}));
  // Every token on one expert: the others are empty groups.
  const std::vector<int32_t> one = {1, 1, 1};
  std::vector<int32_t> rows1(3), offsets1(4);
  ref::moe_dispatch_plan(rows1.data(), offsets1.data(), one.data(), 3, 1, 3, 2);
  EXPECT_EQ(offsets1, (std::vector<int32_t>{0, 0, 4, 4}));
  EXPECT_EQ(rows1, (std::vector<int32_t>{0, 1, 2}));
  // The permuted rows: copies at their rows, zeros in the padding.
  const std::vector<double> x = {1, 2, 3, 4, 5, 6};  // (3, 2)
  std::vector<double> xp(6 * 2, 7.0);
  ref::moe_permute(xp.data(), 6, x.data(), rows1.data(), 3, 1, 2);
  EXPECT_EQ(xp, (std::vector<double>{1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0}));
}

// Token dropping (Megatron's capacity): six tokens on expert 0 and one on expert 1, capacity 3.
// By weight expert 0 keeps its three largest (0.9, then the tie at 0.5 in token order); by
// position its first three; expert 1 keeps its one; dropped pairs get row -1 and no place.
TEST(ReferenceMoe, CapacityKeepsTheLargestWeightsOrTheEarliestPairs) {
  const std::vector<int32_t> indices = {0, 0, 0, 1, 0, 0, 0};
  const std::vector<double> weights = {0.1, 0.5, 0.5, 0.2, 0.3, 0.9, 0.2};
  const auto by_weight = ref::moe_capacity_keep(indices.data(), weights.data(), 7, 1, 2, 3, false);
  EXPECT_EQ(by_weight, (std::vector<char>{0, 1, 1, 1, 0, 1, 0}));
  const auto by_position = ref::moe_capacity_keep(indices.data(), nullptr, 7, 1, 2, 3, true);
  EXPECT_EQ(by_position, (std::vector<char>{1, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(ref::moe_capacity_keep(indices.data(), weights.data(), 7, 1, 2, 6, false),
            std::vector<char>(7, 1));
  std::vector<int32_t> rows(7), offsets(3);
  ref::moe_dispatch_plan(rows.data(), offsets.data(), indices.data(), 7, 1, 2, 4, by_weight.data());
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 4, 8}));
  EXPECT_EQ(rows, (std::vector<int32_t>{-1, 0, 1, 4, -1, 2, -1}));
  // The combine and its gradients leave the dropped pairs out.
  const std::vector<double> yp = {1, 2, 3, 0, 5, 0, 0, 0};  // (8, 1)
  std::vector<double> out(7, 0.0), w(7, 1.0);
  ref::moe_unpermute(out.data(), yp.data(), rows.data(), w.data(), 7, 1, 1);
  EXPECT_EQ(out, (std::vector<double>{0, 1, 2, 5, 0, 3, 0}));
  std::vector<double> dyp(8, 9.0), dw(7, 9.0);
  const std::vector<double> dout = {1, 1, 1, 1, 1, 1, 1};
  ref::moe_unpermute_backward(dyp.data(), 8, dw.data(), dout.data(), yp.data(), rows.data(),
                              w.data(), 7, 1, 1);
  EXPECT_EQ(dw, (std::vector<double>{0, 1, 2, 5, 0, 3, 0}));
  EXPECT_EQ(dyp, (std::vector<double>{1, 1, 1, 0, 1, 0, 0, 0}));
}

TEST(ReferenceMoe, ExpertBiasMovesTowardsBalance) {
  std::vector<double> bias = {0.5, 0.5, 0.5, 0.5};
  const std::vector<double> counts = {10, 2, 4, 8};  // mean 6
  ref::moe_expert_bias_update(bias.data(), counts.data(), 4, 0.25);
  EXPECT_EQ(bias, (std::vector<double>{0.25, 0.75, 0.75, 0.25}));
  const std::vector<double> balanced = {3, 3, 3, 3};
  ref::moe_expert_bias_update(bias.data(), balanced.data(), 4, 0.25);
  EXPECT_EQ(bias, (std::vector<double>{0.25, 0.75, 0.75, 0.25})) << "no step at the mean";
}

TEST(ReferenceMoe, LossValuesAtKnownPoints) {
  // Uniform scores: Switch's aux loss is 1 whatever the counts (it weighs counts by scores).
  const std::vector<double> uniform(4 * 4, 0.0);
  const std::vector<int32_t> one_each = {0, 1, 2, 3}, all_zero = {0, 0, 0, 0};
  for (const auto* indices : {&one_each, &all_zero}) {
    double loss = 0;
    ref::moe_aux_loss(&loss, static_cast<double*>(nullptr), uniform.data(), indices->data(), 4,
                      routing(4, 1), 0, 1.0);
    EXPECT_NEAR(loss, 1.0, 1e-15);
  }
  // Scores and tokens all on expert 0: E, the worst imbalance.
  std::vector<double> peaked(4 * 4, 0.0);
  for (int n = 0; n < 4; ++n) peaked[n * 4] = 50.0;
  double loss = 0;
  ref::moe_aux_loss(&loss, static_cast<double*>(nullptr), peaked.data(), all_zero.data(), 4,
                    routing(4, 1), 0, 1.0);
  EXPECT_NEAR(loss, 4.0, 1e-12);
  // Per sequence (two tokens each): each sequence all on its own expert is the worst case of
  // seq_aux_loss, although the batch as a whole is balanced between experts 0 and 1.
  std::vector<double> split(4 * 4, 0.0);
  split[0 * 4 + 0] = split[1 * 4 + 0] = split[2 * 4 + 1] = split[3 * 4 + 1] = 50.0;
  const std::vector<int32_t> per_seq = {0, 0, 1, 1};
  double seq_loss = 0;
  ref::moe_aux_loss(&seq_loss, static_cast<double*>(nullptr), split.data(), per_seq.data(), 4,
                    routing(4, 1), 2, 1.0);
  EXPECT_NEAR(seq_loss, 4.0, 1e-12);
  double batch_loss = 0;
  ref::moe_aux_loss(&batch_loss, static_cast<double*>(nullptr), split.data(), per_seq.data(), 4,
                    routing(4, 1), 0, 1.0);
  EXPECT_NEAR(batch_loss, 2.0, 1e-12);
  // z-loss of zero logits: logsumexp = log(E).
  double z = 0;
  ref::moe_z_loss(&z, static_cast<double*>(nullptr), uniform.data(), 4, 4, 1.0);
  EXPECT_NEAR(z, std::log(4.0) * std::log(4.0), 1e-15);
}

TEST(ReferenceMoeGrad, Router) {
  std::mt19937_64 rng(21);
  for (const MoeRouting& r :
       {routing(6, 2), routing(6, 3, false, true), routing(6, 1, true), routing(6, 3, true),
        routing(8, 4, true, false, 4, 2, 2.5f), routing(8, 4, false, true, 4, 2),
        routing(5, 2, false, false, 0, 0, 0.0f, true), routing(5, 1, false, false, 0, 0, 1.5f)}) {
    SCOPED_TRACE(fmt::format("E={} K={} sigmoid={} pre={} groups={} scaling={} force={}", r.experts,
                             r.topk, r.sigmoid, r.pre_softmax, r.num_groups, r.scaling,
                             r.force_balance));
    const int64_t N = 5, E = r.experts, K = r.topk;
    std::vector<double> z = random_values(N * E, rng, 2.0);
    const std::vector<double> bias = random_values(E, rng, 0.3);
    const std::vector<double> G = random_values(N * K, rng);
    ASSERT_TRUE(all_nonzero(z));
    const std::vector<double>* b = r.sigmoid ? &bias : nullptr;
    const Routed at = route(z, r, b);
    auto loss = [&] {
      const Routed now = route(z, r, b);
      EXPECT_EQ(now.indices, at.indices) << "a difference step changed the routing";
      return dot(now.weights, G);
    };
    std::vector<double> dz = nan_values(z.size());
    ref::moe_router_backward(dz.data(), G.data(), z.data(), at.indices.data(), N, r);
    expect_gradient(dz, numerical_gradient(z, loss), "dlogits");
  }
}

TEST(ReferenceMoeGrad, LoadBalancingAndZLosses) {
  std::mt19937_64 rng(22);
  const double grad_scale = 0.7;
  for (const auto& [r, seq] :
       std::vector<std::pair<MoeRouting, int64_t>>{{routing(6, 2), 0},
                                                   {routing(6, 2), 3},
                                                   {routing(6, 3, true), 0},
                                                   {routing(6, 1, true), 3},
                                                   {routing(6, 3, true), 2}}) {
    SCOPED_TRACE(fmt::format("E={} K={} sigmoid={} seq={}", r.experts, r.topk, r.sigmoid, seq));
    const int64_t N = 6, E = r.experts;
    std::vector<double> z = random_values(N * E, rng, 2.0);
    const std::vector<int32_t> indices = random_ids(N * r.topk, static_cast<int32_t>(E), rng);
    auto loss = [&] {
      double l = 0;
      ref::moe_aux_loss(&l, static_cast<double*>(nullptr), z.data(), indices.data(), N, r, seq,
                        1.0);
      return grad_scale * l;
    };
    const std::vector<double> dz0 = random_values(z.size(), rng);
    std::vector<double> dz = dz0;
    double l = 0.25;
    ref::moe_aux_loss(&l, dz.data(), z.data(), indices.data(), N, r, seq, grad_scale);
    EXPECT_NEAR(l - 0.25, loss() / grad_scale, 1e-14) << "loss accumulates";
    expect_gradient(dz, dz0, numerical_gradient(z, loss), "dlogits");
  }
  const int64_t N = 5, E = 7;
  std::vector<double> z = random_values(N * E, rng, 3.0);
  auto loss = [&] {
    double l = 0;
    ref::moe_z_loss(&l, static_cast<double*>(nullptr), z.data(), N, E, 1.0);
    return grad_scale * l;
  };
  const std::vector<double> dz0 = random_values(z.size(), rng);
  std::vector<double> dz = dz0;
  ref::moe_z_loss(static_cast<double*>(nullptr), dz.data(), z.data(), N, E, grad_scale);
  expect_gradient(dz, dz0, numerical_gradient(z, loss), "z-loss dlogits");
}

TEST(ReferenceMoeGrad, PermuteAndUnpermute) {
  std::mt19937_64 rng(23);
  const int64_t N = 5, K = 2, E = 4, C = 3, align = 4, R = N * K + E * (align - 1);
  const std::vector<int32_t> indices = random_ids(N * K, 3, rng);  // expert 3 stays empty
  std::vector<int32_t> rows(N * K), offsets(E + 1);
  ref::moe_dispatch_plan(rows.data(), offsets.data(), indices.data(), N, K, E, align);
  EXPECT_EQ(offsets[4], offsets[3]) << "expert 3 has no rows";

  std::vector<double> x = random_values(N * C, rng);
  const std::vector<double> Gp = random_values(R * C, rng);
  auto permute_loss = [&] {
    std::vector<double> xp(R * C);
    ref::moe_permute(xp.data(), R, x.data(), rows.data(), N, K, C);
    return dot(xp, Gp);
  };
  const std::vector<double> dx0 = random_values(x.size(), rng);
  std::vector<double> dx = dx0;
  ref::moe_permute_backward(dx.data(), Gp.data(), rows.data(), N, K, C);
  expect_gradient(dx, dx0, numerical_gradient(x, permute_loss), "dx");

  std::vector<double> yp = random_values(R * C, rng), w = random_values(N * K, rng);
  const std::vector<double> out0 = random_values(N * C, rng), G = random_values(N * C, rng);
  auto combine_loss = [&] {
    std::vector<double> out = out0;
    ref::moe_unpermute(out.data(), yp.data(), rows.data(), w.data(), N, K, C);
    return dot(out, G);
  };
  std::vector<double> dyp = nan_values(yp.size()), dw = nan_values(w.size());
  ref::moe_unpermute_backward(dyp.data(), R, dw.data(), G.data(), yp.data(), rows.data(), w.data(),
                              N, K, C);
  expect_gradient(dyp, numerical_gradient(yp, combine_loss), "dyp");
  expect_gradient(dw, numerical_gradient(w, combine_loss), "dweights");
}

TEST(ReferenceMoeGrad, GroupedMatmul) {
  std::mt19937_64 rng(24);
  const std::vector<int32_t> offsets = {0, 3, 3, 7, 8};  // group 1 empty; row 8 outside all
  const int64_t G = 4, R = 9, N = 3, K = 5;
  for (bool trans_b : {true, false}) {
    SCOPED_TRACE(trans_b ? "NT" : "NN");
    std::vector<double> a = random_values(R * K, rng), b = random_values(G * N * K, rng);
    const std::vector<double> Gout = random_values(R * N, rng);
    auto loss = [&] {
      std::vector<double> out(R * N);
      ref::grouped_matmul(out.data(), a.data(), b.data(), offsets.data(), G, R, N, K, trans_b);
      return dot(out, Gout);
    };
    // da = dout @ op(b)^T: the grouped GEMM with b's other orientation; rows outside every
    // group get zero.
    std::vector<double> da = nan_values(a.size());
    ref::grouped_matmul(da.data(), Gout.data(), b.data(), offsets.data(), G, R, K, N, !trans_b);
    expect_gradient(da, numerical_gradient(a, loss), "da");
    // db[g] = dout_g^T a_g (N, K) for trans_b, a_g^T dout_g (K, N) otherwise, accumulated.
    const std::vector<double> db0 = random_values(b.size(), rng);
    std::vector<double> db = db0;
    if (trans_b)
      ref::grouped_matmul_wgrad(db.data(), Gout.data(), a.data(), offsets.data(), G, N, K, 1.0);
    else
      ref::grouped_matmul_wgrad(db.data(), a.data(), Gout.data(), offsets.data(), G, K, N, 1.0);
    expect_gradient(db, db0, numerical_gradient(b, loss), "db");
  }
}

// Groups sharing weights (expert parallelism's received rows): each weight's gradient sums
// its groups', a weight without rows gets beta times its old value.
TEST(ReferenceMoeGrad, GroupedMatmulWithSharedWeights) {
  std::mt19937_64 rng(26);
  const std::vector<int32_t> offsets = {0, 2, 5, 5, 9}, weights = {1, 0, 2, 1};  // weight 2 empty
  const int64_t G = 4, W = 4, R = 10, N = 3, K = 4;  // weight 3 has no group
  std::vector<double> a = random_values(R * K, rng), b = random_values(W * N * K, rng);
  const std::vector<double> Gout = random_values(R * N, rng);
  auto loss = [&] {
    std::vector<double> out(R * N);
    ref::grouped_matmul(out.data(), a.data(), b.data(), offsets.data(), G, R, N, K, true,
                        weights.data());
    return dot(out, Gout);
  };
  std::vector<double> da = nan_values(a.size());
  ref::grouped_matmul(da.data(), Gout.data(), b.data(), offsets.data(), G, R, K, N, false,
                      weights.data());
  expect_gradient(da, numerical_gradient(a, loss), "da");
  const std::vector<double> db0 = random_values(b.size(), rng);
  std::vector<double> db = db0;
  ref::grouped_matmul_wgrad(db.data(), Gout.data(), a.data(), offsets.data(), G, N, K, 1.0, W,
                            weights.data());
  expect_gradient(db, db0, numerical_gradient(b, loss), "db");
  std::vector<double> fresh = nan_values(b.size());
  ref::grouped_matmul_wgrad(fresh.data(), Gout.data(), a.data(), offsets.data(), G, N, K, 0.0, W,
                            weights.data());
  // Overwriting (beta 0): the same gradient, and zeros (not the NaN that was there) for the
  // weights without rows.
  for (size_t i = 0; i < fresh.size(); ++i) EXPECT_NEAR(fresh[i], db[i] - db0[i], 1e-12) << i;
  for (size_t i = 2 * N * K; i < fresh.size(); ++i) EXPECT_EQ(fresh[i], 0.0) << i;
}

TEST(ReferenceMoeGrad, QkNorm) {
  std::mt19937_64 rng(25);
  AttentionShape s;
  s.batch = 2, s.seq = 3, s.heads = 4, s.kv_heads = 2, s.head_dim = 6;
  const int64_t N = s.tokens(), W = s.qkv_width(), D = s.head_dim;
  std::vector<double> qkv = random_values(N * W, rng), qw = random_values(D, rng),
                      kw = random_values(D, rng);
  const std::vector<double> G = random_values(N * W, rng);
  std::vector<double> out(N * W), rstd(N * (s.heads + s.kv_heads));
  auto loss = [&] {
    ref::qk_norm_forward(out.data(), rstd.data(), qkv.data(), qw.data(), kw.data(), s, 1e-6);
    return dot(out, G);
  };
  loss();
  const std::vector<double> rstd_at = rstd;
  const std::vector<double> dq0 = random_values(D, rng), dk0 = random_values(D, rng);
  std::vector<double> dqkv = nan_values(qkv.size()), dq = dq0, dk = dk0;
  ref::qk_norm_backward(dqkv.data(), dq.data(), dk.data(), G.data(), qkv.data(), qw.data(),
                        kw.data(), rstd_at.data(), s);
  expect_gradient(dqkv, numerical_gradient(qkv, loss), "dqkv");
  expect_gradient(dq, dq0, numerical_gradient(qw, loss), "dq_weight");
  expect_gradient(dk, dk0, numerical_gradient(kw, loss), "dk_weight");
  // In place over dout gives the same.
  std::vector<double> in_place = G, dq2 = dq0, dk2 = dk0;
  ref::qk_norm_backward(in_place.data(), dq2.data(), dk2.data(), in_place.data(), qkv.data(),
                        qw.data(), kw.data(), rstd_at.data(), s);
  EXPECT_EQ(in_place, dqkv);
}

}  // namespace
}  // namespace tessera
