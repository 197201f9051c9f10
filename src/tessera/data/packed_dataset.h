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
//
// Under context parallelism Megatron's load balancing gives rank r chunks r and 2 cp - 1 - r of
// every sequence, which evens out causal attention over one document but not over several:
// a rank's share depends on where the documents fall. When documents do not see each other
// (context_parallel_size > 1 here), each sequence's documents and its padding (a document of
// its own to the attention) are ordered so that the busiest rank's attention work is least:
// every order for up to 6 pieces, else rounds of swaps of two pieces while one helps (stopping
// once the busiest rank is within 0.5% of the mean, or after 4,096 orders weighed). Ordering
// cannot cut a document, so one long document with little else stays as Megatron's chunks
// leave it.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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
  // Ranks whose attention work each sequence's order balances: context parallelism's, when
  // documents do not see each other (reset_attention_mask); 1: the packing order.
  int64_t context_parallel_size = 1;
};

// The attention work (query-key pairs, causal within each piece) of each of `cp` ranks when
// pieces of these lengths fill a sequence of their total length (a multiple of 2 cp) in this
// order, rank r holding chunks r and 2 cp - 1 - r (model/parallel_layers.h).
std::vector<double> context_parallel_work(const std::vector<int64_t>& lengths, int64_t cp);

// The order of the pieces (indices into lengths) that makes the busiest rank's work least,
// preferring the given order among equals (see the header comment).
std::vector<size_t> balanced_order(const std::vector<int64_t>& lengths, int64_t cp);

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
  // Under context parallelism: the mean over sequences of the busiest rank's attention work
  // over the ranks' mean, in the packing order and in the balanced one (1, 1 otherwise).
  std::pair<double, double> context_parallel_imbalance() const { return {imbalance_packed_, imbalance_}; }

 private:
  static constexpr uint64_t kPadding = ~uint64_t{0};  // a piece of padding, not a document
  struct Piece {
    uint64_t document;
    int64_t length;  // its first `length` tokens
  };
  // Orders each sequence's pieces, its padding made one, to balance the ranks' attention.
  void balance_for_context_parallelism();

  PackedDatasetOptions o_;
  std::vector<std::vector<Piece>> bins_;
  uint64_t samples_ = 0, truncated_ = 0, skipped_ = 0, real_tokens_ = 0;
  double imbalance_packed_ = 1, imbalance_ = 1;
  EpochOrder order_;
};

}  // namespace tessera
