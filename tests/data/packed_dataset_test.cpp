// packing_strategy bfd: whole documents packed best-fit decreasing into padded sequences, every
// document once per epoch, targets that never cross a document, positions per document, roles
// and eod_mask_loss as in the GPT dataset, the packing efficiency reported.
#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include "data_fixtures.h"
#include "tessera/data/chat.h"
#include "tessera/data/packed_dataset.h"

namespace tessera {
namespace {

using testing::ScratchDir;

struct Packed {
  ScratchDir dir;
  std::vector<std::vector<int32_t>> docs;
  std::unique_ptr<PackedSource> source;

  Packed(const std::vector<int>& lengths, int64_t seq, uint64_t samples = 1,
         const std::vector<std::vector<int32_t>>* roles = nullptr, LossMask mask = LossMask::Assistant,
         int64_t context_parallel_size = 1) {
    docs = testing::distinct_documents(lengths);
    for (auto& d : docs)
      for (auto& t : d) t += 1;  // ids from 1: 0 is the padding
    const std::string p = (dir / "d").string();
    testing::write_dataset(p, docs);
    std::shared_ptr<const IndexedDataset> role_data;
    if (roles) {
      testing::write_dataset(p + "_roles", *roles, TokenDType::UInt8);
      role_data = std::make_shared<const IndexedDataset>(p + "_roles");
    }
    source = std::make_unique<PackedSource>(PackedDatasetOptions{
        .data = std::make_shared<const IndexedDataset>(p),
        .roles = role_data,
        .first_document = 0,
        .end_document = docs.size(),
        .seq_length = seq,
        .seed = 3,
        .num_samples = samples,
        .loss_mask = mask,
        .pad_id = 0,
        .context_parallel_size = context_parallel_size});
  }

  // Samples [first, first + count) hold whole documents at their positions, their targets the
  // documents' next tokens, and padding (id 0) that predicts nothing with positions of its own;
  // the documents that start in them.
  std::multiset<size_t> documents_in(uint64_t first, uint64_t count, int64_t seq) const {
    std::map<int32_t, std::pair<size_t, size_t>> where;  // id -> (document, index)
    for (size_t d = 0; d < docs.size(); ++d)
      for (size_t k = 0; k < docs[d].size(); ++k) where[docs[d][k]] = {d, k};
    std::vector<int32_t> tokens(seq), targets(seq), positions(seq);
    std::multiset<size_t> seen;
    for (uint64_t i = first; i < first + count; ++i) {
      source->sample(i, tokens.data(), targets.data(), positions.data());
      for (size_t t = 0; t < static_cast<size_t>(seq); ++t) {
        if (tokens[t] == 0) {
          EXPECT_EQ(targets[t], -1);
          EXPECT_EQ(positions[t], t > 0 && tokens[t - 1] == 0 ? positions[t - 1] + 1 : 0);
          continue;
        }
        const auto [d, k] = where.at(tokens[t]);
        EXPECT_EQ(positions[t], static_cast<int32_t>(k));
        if (k == 0) seen.insert(d);
        // The next token of the document, or nothing after its last.
        EXPECT_EQ(targets[t], k + 1 < docs[d].size() ? docs[d][k + 1] : -1);
        if (k + 1 < docs[d].size()) EXPECT_EQ(tokens[t + 1], docs[d][k + 1]);  // whole
      }
    }
    return seen;
  }
};

// Lengths drawn uniformly in [lo, hi] until `total` tokens are filled (the last one cut).
std::vector<int64_t> random_lengths(std::mt19937_64& rng, int64_t total, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> length(lo, hi);
  std::vector<int64_t> lengths;
  for (int64_t used = 0; used < total;) lengths.push_back(std::min(length(rng), total - used)), used += lengths.back();
  return lengths;
}

double busiest_over_mean(const std::vector<double>& work) {
  return *std::max_element(work.begin(), work.end()) * static_cast<double>(work.size()) /
         std::accumulate(work.begin(), work.end(), 0.0);
}

TEST(PackedSource, BestFitDecreasingKeepsEveryDocumentWholeOncePerEpoch) {
  // T 8: 7 -> a new sequence, 5 -> a new one, 4 -> a new one (no room of 4 or more), 3 -> the
  // one holding 5 (room 3, the smallest that fits).
  Packed p({3, 7, 4, 5}, 8, 6);
  ASSERT_EQ(p.source->sequences(), 3u);
  EXPECT_EQ(p.source->samples_per_epoch(), 6u);  // whole epochs
  EXPECT_NEAR(p.source->efficiency(), 19.0 / 24.0, 1e-12);
  EXPECT_NE(p.source->describe().find("79.2% of them real tokens"), std::string::npos) << p.source->describe();
  EXPECT_TRUE(p.source->pads());
  int64_t real = 0;
  for (uint64_t i = 0; i < 3; ++i) real += p.source->real_tokens(i).value();
  EXPECT_EQ(real, 19);  // every document once per epoch
  for (uint64_t epoch = 0; epoch < 2; ++epoch)
    EXPECT_EQ(p.documents_in(epoch * 3, 3, 8), (std::multiset<size_t>{0, 1, 2, 3})) << "epoch " << epoch;
  EXPECT_EQ(p.source->describe().find("context-parallel"), std::string::npos);
}

// Each rank's work is the causal pairs of the queries in its two chunks, per position.
TEST(PackedSource, ContextParallelWorkCountsEachRanksChunks) {
  std::mt19937_64 rng(5);
  for (int64_t cp : {1, 2, 3, 4, 8}) {
    const int64_t T = 2 * cp * 37;
    const std::vector<int64_t> lengths = random_lengths(rng, T, 1, 90);
    std::vector<double> want(static_cast<size_t>(cp), 0.0);
    int64_t at = 0;
    for (int64_t n : lengths)
      for (int64_t k = 0; k < n; ++k, ++at) {
        const int64_t chunk = at / 37;
        want[static_cast<size_t>(chunk < cp ? chunk : 2 * cp - 1 - chunk)] += static_cast<double>(k + 1);
      }
    EXPECT_EQ(context_parallel_work(lengths, cp), want) << "cp " << cp;
    // One document over the whole sequence: Megatron's chunks give every rank the same work.
    const std::vector<double> one = context_parallel_work({T}, cp);
    EXPECT_EQ(busiest_over_mean(one), 1.0) << "cp " << cp;
  }
}

// Sequences of 128k tokens filled with documents of 8k to 128k, or 1k to 16k (random lengths:
// every order tried, or swaps): ordering each sequence's documents takes the busiest rank from
// above the mean to near it, never higher.
TEST(PackedSource, BalancedOrderEvensOutTheContextParallelRanks) {
  for (auto [cp, shortest, longest] : {std::tuple<int64_t, int64_t, int64_t>{2, 8192, 131072},
                                       {4, 8192, 131072}, {8, 8192, 131072}, {2, 1024, 16384},
                                       {4, 1024, 16384}, {8, 1024, 16384}}) {
    std::mt19937_64 rng(11 + cp + shortest);
    double packed = 0, balanced = 0, worst = 0;
    constexpr int kSequences = 30;
    for (int s = 0; s < kSequences; ++s) {
      std::vector<int64_t> lengths = random_lengths(rng, 131072, shortest, longest);
      std::sort(lengths.rbegin(), lengths.rend());  // best-fit decreasing places longest first
      const std::vector<size_t> order = balanced_order(lengths, cp);
      std::vector<int64_t> ordered;
      for (size_t i : order) ordered.push_back(lengths[i]);
      ASSERT_TRUE(std::is_permutation(ordered.begin(), ordered.end(), lengths.begin()));
      const double before = busiest_over_mean(context_parallel_work(lengths, cp));
      const double after = busiest_over_mean(context_parallel_work(ordered, cp));
      EXPECT_LE(after, before);
      packed += before / kSequences, balanced += after / kSequences, worst = std::max(worst, after);
    }
    std::printf("cp %lld, documents of %lld to %lld: busiest rank over the mean %.3f in packing "
                "order, %.3f balanced (worst %.3f)\n",
                static_cast<long long>(cp), static_cast<long long>(shortest),
                static_cast<long long>(longest), packed, balanced, worst);
    EXPECT_LT(balanced, 1 + (packed - 1) / 2) << "cp " << cp;
  }
}

// Under context parallelism a sequence's documents and padding come in the balanced order:
// still whole, with their positions, every document once per epoch, padding predicting nothing.
TEST(PackedSource, ContextParallelOrderKeepsEveryDocumentWhole) {
  Packed p({30, 3, 17, 9, 25, 2, 14, 6, 11, 20, 5}, 48, 4, nullptr, LossMask::Assistant, 2);
  const uint64_t n = p.source->sequences();
  EXPECT_EQ(p.documents_in(0, n, 48), (std::multiset<size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  int64_t real = 0;
  for (uint64_t i = 0; i < n; ++i) real += p.source->real_tokens(i).value();
  EXPECT_EQ(real, 142);
  const auto [packed, balanced] = p.source->context_parallel_imbalance();
  EXPECT_LE(balanced, packed);
  EXPECT_GE(balanced, 1.0);
  EXPECT_NE(p.source->describe().find("ordered for 2 context-parallel ranks"), std::string::npos)
      << p.source->describe();
}

TEST(PackedSource, LongDocumentsAreCutAndRolesMaskTheirTargets) {
  // A document of 12 tokens in sequences of 8: its first 8, the last predicting the 9th.
  Packed cut({12, 3}, 8);
  EXPECT_EQ(cut.source->truncated(), 1u);
  std::vector<int32_t> tokens(8), targets(8);
  for (uint64_t i = 0; i < cut.source->sequences(); ++i) {
    cut.source->sample(i, tokens.data(), targets.data());
    if (tokens[0] == cut.docs[0][0]) EXPECT_EQ(targets[7], cut.docs[0][8]);
  }
  // Roles: only the assistant's targets count.
  std::vector<std::vector<int32_t>> roles = {{2, 2, 2, 3, 3, 3}, {2, 2, 3, 3}};
  Packed chat({6, 4}, 16, 1, &roles);
  std::vector<int32_t> t16(16), g16(16);
  chat.source->sample(0, t16.data(), g16.data());
  int counted = 0;
  for (size_t t = 0; t < 16; ++t) {
    if (g16[t] < 0) continue;
    ++counted;
    // The target's own role is the assistant's.
    for (size_t d = 0; d < chat.docs.size(); ++d)
      for (size_t k = 0; k < chat.docs[d].size(); ++k)
        if (chat.docs[d][k] == g16[t]) EXPECT_EQ(roles[d][k], static_cast<int32_t>(TokenRole::Assistant));
  }
  EXPECT_EQ(counted, 3 + 2);  // the assistant tokens that have a token before them
}

}  // namespace
}  // namespace tessera
