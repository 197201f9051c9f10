#pragma once
// Whole documents packed into sequences (packing_strategy bfd), for fine-tuning: where
// Megatron's GPT dataset (gpt_dataset.h) cuts the concatenated documents into windows, so that
// a conversation may start in one sample and end in the next, this source keeps every
// document whole in one sample. Documents are placed best-fit decreasing (the longest first,
// each into the sequence with the least room that still holds it), the rest of a sequence is
// padding that no loss counts, and each document's last token predicts nothing (no target
// crosses into the next document). A document longer than seq_length keeps its first
// seq_length tokens. Every epoch visits the same sequences in its own seeded order.
// With reset_position_ids and reset_attention_mask the documents of a sequence do not see
// each other, which is TRL's padding-free "bfd" packing.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/data/dataset.h"
#include "tessera/data/indexed_dataset.h"

namespace tessera {

struct PackedDatasetOptions {
  std::shared_ptr<const IndexedDataset> data;
  std::shared_ptr<const IndexedDataset> roles;  // chat data (data/chat.h); may be null
  uint64_t first_document = 0, end_document = 0;  // the split's documents: [first, end)
  std::string split = "train";
  int64_t seq_length = 0;
  uint32_t seed = 0;
  uint64_t num_samples = 1;  // samples wanted; whole epochs of sequences are made
  LossMask loss_mask = LossMask::Assistant;
  int32_t eod_mask = -1;  // eod_mask_loss: no loss where the input is this id
  int32_t pad_id = 0;     // the token padding is written with (its targets count nothing)
};

class PackedSource final : public SampleSource {
 public:
  // Throws DataError when the documents hold no document of two tokens or more.
  explicit PackedSource(PackedDatasetOptions options);
  std::string describe() const override;
  uint64_t samples_per_epoch() const override { return samples_; }
  void sample(uint64_t index, int32_t* tokens, int32_t* targets,
              int32_t* positions = nullptr) const override;
  bool masks_targets() const override { return true; }  // padding, documents' last tokens
  bool pads() const override { return true; }
  std::optional<int64_t> real_tokens(uint64_t index) const override;
  // Real tokens over the sequences' slots.
  double efficiency() const;
  uint64_t sequences() const { return bins_.size(); }
  uint64_t truncated() const { return truncated_; }

 private:
  struct Piece {
    uint64_t document;
    int64_t length;  // its first `length` tokens
  };
  PackedDatasetOptions o_;
  std::vector<std::vector<Piece>> bins_;
  uint64_t samples_ = 0, truncated_ = 0, skipped_ = 0, real_tokens_ = 0;
  EpochOrder order_;
};

}  // namespace tessera
