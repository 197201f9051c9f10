#pragma once
// Megatron's GPT dataset: the documents [first, end) of an indexed dataset seen as one
// stream, cut into samples of seq_length+1 tokens that cross document boundaries (sample k
// starts at token k * seq_length, so consecutive samples share one token). Three indices,
// built exactly as Megatron builds them and cached as the same .npy files:
//   document index  the documents, repeated for as many epochs as num_samples needs and
//                   shuffled by numpy RandomState(seed); when the last epoch would be used
//                   less than 80%, it is shuffled on its own so that its documents are not
//                   mixed into the earlier epochs
//   sample index    (position in the document index, token offset) where each sample starts
//   shuffle index   a permutation of the samples (the separate last epoch permuted apart)
// Sample i is then a pure function of (data, documents, seq_length, seed, num_samples, i),
// so a resumed run reads exactly the samples an uninterrupted one would.
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/data/dataset.h"
#include "tessera/data/indexed_dataset.h"
#include "tessera/data/numpy_compat.h"

namespace tessera {

struct GptDatasetOptions {
  std::shared_ptr<const IndexedDataset> data;
  // Chat data: each token's role (data/chat.h), aligned with `data`; targets outside
  // `loss_mask` get no loss.
  std::shared_ptr<const IndexedDataset> roles;
  LossMask loss_mask = LossMask::Assistant;
  int32_t eod_mask = -1;  // eod_mask_loss: no loss where the input is this id
  uint64_t first_document = 0, end_document = 0;  // the split's documents: [first, end)
  std::string split = "train";                    // names the cache entry
  int64_t seq_length = 0;
  uint32_t seed = 0;         // numpy's seeds are 32-bit
  uint64_t num_samples = 1;  // samples wanted (at least 1); more epochs are built if needed
  std::string cache_dir;
};

class GptSource final : public SampleSource {
 public:
  // Throws DataError when the documents hold fewer than 2 tokens.
  explicit GptSource(GptDatasetOptions options);
  std::string describe() const override;
  // All samples built: num_samples or a few more (whole epochs' worth of tokens).
  uint64_t samples_per_epoch() const override { return samples_; }
  // Positions restart where the dataset's documents meet.
  void sample(uint64_t index, int32_t* tokens, int32_t* targets,
              int32_t* positions = nullptr) const override;
  bool masks_targets() const override {
    return o_.eod_mask >= 0 || (o_.roles && o_.loss_mask != LossMask::All);
  }
  // The seq_length+1 tokens of sample `index` (taken modulo samples_per_epoch()); with
  // `roles`, the same window of the roles dataset. positions (when not null): each token's
  // position in its document, 0 at the window's first token.
  void read_sample(uint64_t index, int32_t* out, bool roles = false,
                   int32_t* positions = nullptr) const;
  uint64_t epochs() const { return epochs_; }

 private:
  std::vector<NpyArray> build_indices() const;
  bool indices_fit(const std::vector<NpyArray>& a) const;

  GptDatasetOptions o_;
  uint64_t documents_ = 0, tokens_per_epoch_ = 0, epochs_ = 0, samples_ = 0;
  bool separate_final_epoch_ = false;
  uint64_t samples_before_final_epoch_ = 0;  // with a separate final epoch
  NpyArray document_index_, sample_index_, shuffle_index_;
  std::string cache_status_;
};

}  // namespace tessera
