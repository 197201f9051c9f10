// packing_strategy bfd: whole documents packed best-fit decreasing into padded sequences, every
// document once per epoch, targets that never cross a document, positions per document, roles
// and eod_mask_loss as in the GPT dataset, the packing efficiency reported.
#include <map>
#include <set>

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
         const std::vector<std::vector<int32_t>>* roles = nullptr, LossMask mask = LossMask::Assistant) {
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
        .pad_id = 0});
  }
};

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
  std::map<int32_t, std::pair<size_t, size_t>> where;  // id -> (document, index)
  for (size_t d = 0; d < p.docs.size(); ++d)
    for (size_t k = 0; k < p.docs[d].size(); ++k) where[p.docs[d][k]] = {d, k};
  std::vector<int32_t> tokens(8), targets(8), positions(8);
  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    std::multiset<size_t> seen;
    for (uint64_t i = epoch * 3; i < epoch * 3 + 3; ++i) {
      p.source->sample(i, tokens.data(), targets.data(), positions.data());
      for (size_t t = 0; t < 8; ++t) {
        if (tokens[t] == 0) {  // padding: no loss, positions of its own
          EXPECT_EQ(targets[t], -1);
          EXPECT_EQ(positions[t], t > 0 && tokens[t - 1] == 0 ? positions[t - 1] + 1 : 0);
          continue;
        }
        const auto [d, k] = where.at(tokens[t]);
        EXPECT_EQ(positions[t], static_cast<int32_t>(k));
        if (k == 0) seen.insert(d);
        // The next token of the document, or nothing after its last.
        EXPECT_EQ(targets[t], k + 1 < p.docs[d].size() ? p.docs[d][k + 1] : -1);
        if (k + 1 < p.docs[d].size()) EXPECT_EQ(tokens[t + 1], p.docs[d][k + 1]);  // whole
      }
    }
    EXPECT_EQ(seen, (std::multiset<size_t>{0, 1, 2, 3})) << "epoch " << epoch;
  }
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
