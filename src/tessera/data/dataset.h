#pragma once
// Training samples. A sample is seq_length+1 consecutive tokens: inputs are the first
// seq_length, targets the last seq_length. Sources are addressed by a global sample index,
// so a batch is a pure function of (seed, consumed samples, rank): runs are deterministic,
// data-parallel ranks read disjoint samples, and a resumed run continues exactly.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/config/blend.h"
#include "tessera/config/config.h"
#include "tessera/data/tokenizer.h"

namespace tessera {

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual std::string describe() const = 0;
  // Samples before the order repeats (one epoch).
  virtual uint64_t samples_per_epoch() const = 0;
  // tokens and targets: seq_length ids each. A target of -1 has no loss (loss masks).
  // positions (when not null): each token's position in its document within the sample, 0 at
  // the sample's first token and again at each document's first (reset_position_ids).
  virtual void sample(uint64_t index, int32_t* tokens, int32_t* targets,
                      int32_t* positions = nullptr) const = 0;
  // Whether some targets may be -1, so that a batch's loss counts fewer than all positions.
  virtual bool masks_targets() const { return false; }
  // Whether samples end in padding (packing_strategy bfd), and then how many of sample
  // `index`'s tokens are real; nullopt: all of them.
  virtual bool pads() const { return false; }
  virtual std::optional<int64_t> real_tokens(uint64_t index) const {
    (void)index;
    return std::nullopt;
  }
};

// Uniformly random tokens in [0, vocab), as Primus/Megatron mock data.
// A document ends after the end-of-document id `eod` (-1: none); with eod_mask_loss,
// positions whose input is that id have no loss.
class MockSource final : public SampleSource {
 public:
  MockSource(int64_t vocab, int64_t seq_length, uint64_t seed, int32_t eod = -1,
             bool eod_mask_loss = false)
      : vocab_(vocab), seq_(seq_length), seed_(seed), eod_(eod), eod_mask_loss_(eod_mask_loss) {}
  std::string describe() const override;
  uint64_t samples_per_epoch() const override { return UINT64_MAX; }
  void sample(uint64_t index, int32_t* tokens, int32_t* targets,
              int32_t* positions = nullptr) const override;
  bool masks_targets() const override { return eod_mask_loss_ && eod_ >= 0; }

 private:
  int64_t vocab_, seq_;
  uint64_t seed_;
  int32_t eod_;
  bool eod_mask_loss_;
};

// Documents joined by end-of-document tokens into one stream, cut into windows of
// seq_length+1 tokens at stride seq_length (windows cross document boundaries, as in
// Megatron's GPT dataset). With shuffle, every epoch visits the windows in its own seeded
// order. Documents end after `eod` (-1: none); with eod_mask_loss, positions whose input is
// that id have no loss.
// The order in which each epoch visits `n` items: a Fisher-Yates shuffle seeded by (seed,
// epoch) with the counter-based generator, the same on every platform and standard library,
// or 0 .. n-1 without shuffle. The last epoch's order is kept.
class EpochOrder {
 public:
  EpochOrder() = default;
  EpochOrder(uint64_t n, uint64_t seed, bool shuffle) : n_(n), seed_(seed), shuffle_(shuffle) {}
  // Item i of epoch `epoch` (i < n).
  uint32_t at(uint64_t epoch, uint64_t i) const { return of(epoch)[i]; }

 private:
  const std::vector<uint32_t>& of(uint64_t epoch) const;
  uint64_t n_ = 0, seed_ = 0;
  bool shuffle_ = false;
  mutable uint64_t cached_epoch_ = UINT64_MAX;
  mutable std::vector<uint32_t> cached_;
};

// Positions that restart after each `eod` token (-1: never), 0 at the first token.
void positions_after_eod(const int32_t* tokens, int64_t n, int32_t eod, int32_t* positions);

class TokenStreamSource final : public SampleSource {
 public:
  TokenStreamSource(std::string name, std::vector<int32_t> stream, int64_t seq_length,
                    uint64_t seed, bool shuffle, int32_t eod = -1, bool eod_mask_loss = false);
  std::string describe() const override;
  uint64_t samples_per_epoch() const override { return windows_; }
  void sample(uint64_t index, int32_t* tokens, int32_t* targets,
              int32_t* positions = nullptr) const override;
  bool masks_targets() const override { return eod_mask_loss_ && eod_ >= 0; }
  size_t tokens() const { return stream_.size(); }

 private:
  std::string name_;
  std::vector<int32_t> stream_;
  int64_t seq_;
  uint64_t seed_;
  bool shuffle_;
  int32_t eod_;
  bool eod_mask_loss_;
  uint64_t windows_;
  EpochOrder order_;
};

struct DataSources {
  std::unique_ptr<SampleSource> train;
  std::unique_ptr<SampleSource> valid;  // null when there is no validation data
  std::string description;
};

// Builds the training and validation sources of an experiment:
//   mock_data          random tokens;
//   train_data_path    naming an existing file or directory: plain or Brown-corpus text,
//                      tokenized in memory and split into train/valid by `split`;
//   data_path          a Megatron blend of indexed datasets, each split by `split`;
//   train_data_path    otherwise, a Megatron blend used whole for training;
//   valid_data_path    a blend used whole for validation (instead of the split's part).
// Indexed data gives train_iters x global_batch_size training samples and, when evaluation
// is on, eval_iters x global_batch_size validation samples, in Megatron's GPT-dataset order.
// Throws DataError naming the file when data cannot be read, does not fit the tokenizer
// (vocab, its name) or is too small for one sample.
DataSources make_data_sources(const Experiment& e, const Tokenizer& tokenizer, int64_t vocab);

}  // namespace tessera
