#pragma once
// Megatron data blends: "prefix" or "w1 prefix1 w2 prefix2 ...", and the dataset that draws
// from several sources in proportion to their weights. Sample i of the blend comes from the
// source whose share so far lags its weight the most (Megatron's error-minimising
// interleave), so every window of the blend follows the weights closely and the assignment
// is a pure function of (weights, i).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/blend.h"
#include "tessera/data/dataset.h"
#include "tessera/data/numpy_compat.h"

namespace tessera {

// Samples each source contributes to a blend of `size` samples, as Megatron sizes them:
// ceil(size * weight), and with `surplus` (0.005 for the sources' own sample counts) a
// margin on top so that no source runs out.
std::vector<uint64_t> blend_source_sizes(const std::vector<double>& weights, uint64_t size,
                                         double surplus);

// Megatron's blending indices: for each of `size` samples, the source it comes from (int16)
// and the index of that sample within its source (int64).
std::vector<NpyArray> build_blending_indices(const std::vector<double>& weights, uint64_t size);

class BlendedSource final : public SampleSource {
 public:
  // `size` samples drawn from `sources` by `weights` (normalised). The indices are cached in
  // cache_dir under a description of the weights, the size and `sources_identity` (a text
  // naming the sources, so each blend has its own entry). Throws DataError if the blend asks
  // a source for more samples than it has.
  BlendedSource(std::vector<std::unique_ptr<SampleSource>> sources, std::vector<double> weights,
                uint64_t size, const std::string& split, const std::string& cache_dir,
                const std::string& sources_identity);
  std::string describe() const override;
  uint64_t samples_per_epoch() const override { return size_; }
  void sample(uint64_t index, int32_t* tokens, int32_t* targets,
              int32_t* positions = nullptr) const override;
  bool masks_targets() const override;
  bool pads() const override;
  std::optional<int64_t> real_tokens(uint64_t index) const override;

 private:
  std::vector<std::unique_ptr<SampleSource>> sources_;
  std::vector<double> weights_;
  uint64_t size_;
  NpyArray dataset_index_, dataset_sample_index_;
  std::string cache_status_;
};

}  // namespace tessera
