#pragma once
// The preference pairs of a `preprocess --preference` dataset (documents 2k and 2k+1: the
// chosen and the rejected answer to one prompt), for DPO (train/dpo.h). Each side is one
// sequence of seq_length tokens padded at the end (a side longer than that keeps its first
// seq_length tokens); its targets count only on the final assistant turn, the answer whose
// log-probability DPO compares. Pairs are split into train and validation by `split` and
// visited in a seeded order per epoch.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/core/shared_prompt_pair.h"
#include "tessera/data/dataset.h"
#include "tessera/data/indexed_dataset.h"

namespace tessera {

class PreferenceSource {
 public:
  // Pairs [first, end) of the dataset. Throws DataError naming the files when they are not
  // pairs with roles.
  PreferenceSource(std::shared_ptr<const IndexedDataset> tokens,
                   std::shared_ptr<const IndexedDataset> roles, uint64_t first, uint64_t end,
                   int64_t seq_length, uint32_t seed, int32_t pad_id, bool shuffle);
  uint64_t pairs() const { return end_ - first_; }
  std::string describe() const;
  // Side 0 (chosen) or 1 (rejected) of pair `index` (taken modulo pairs() in its epoch's
  // order): seq_length tokens, targets (-1 where nothing counts) and positions.
  void sample(uint64_t index, int side, int32_t* tokens, int32_t* targets, int32_t* positions) const;
  // Pair `index` in one row of row_length tokens with its prompt once (dpo_shared_prompt): the
  // rows both sides share (equal tokens whose targets do not count), then the rest of the
  // chosen side, then the rest of the rejected side, then padding (positions from 0). Its
  // layout; InternalError when the pair does not fit (shared_extent() bounds them).
  SharedPromptPair sample_shared(uint64_t index, int64_t row_length, int32_t* tokens,
                                 int32_t* targets, int32_t* positions) const;
  // The most rows a pair of the source takes laid out so, and its longest side: every pair's
  // both sides are read.
  struct SharedExtent {
    int64_t row = 0, side = 0;
  };
  SharedExtent shared_extent() const;
  // The dataset's pair (0 .. dataset_pairs() - 1) that `index` reads.
  uint64_t pair(uint64_t index) const { return first_ + order_.at(index / pairs(), index % pairs()); }
  uint64_t dataset_pairs() const { return tokens_->sequences() / 2; }
  // The tokens of both sides of pair `index` that are not padding.
  int64_t real_tokens(uint64_t index) const;
  const std::string& prefix() const { return tokens_->prefix(); }

 private:
  // Both sides of the dataset's pair: (2, seq_length) tokens, targets and positions.
  struct PairSides {
    std::vector<int32_t> tokens, targets, positions;
    int64_t real[2] = {0, 0};  // each side's tokens that are not padding
    int64_t shared = 0;        // the leading rows both sides share
  };
  PairSides read_sides(uint64_t index) const;

  std::shared_ptr<const IndexedDataset> tokens_, roles_;
  uint64_t first_, end_;
  int64_t seq_;
  int32_t pad_id_;
  EpochOrder order_;
};

struct PreferenceSources {
  std::unique_ptr<PreferenceSource> train, valid;  // valid null without validation pairs
};

// The pairs of data_path (one preference dataset, split by `split`). Throws DataError for
// data that is not a preference dataset.
PreferenceSources make_preference_sources(const Experiment& e, int64_t vocab,
                                          const std::string& tokenizer_name, int32_t pad_id);

}  // namespace tessera
