#include "tessera/data/blended_dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/core/error.h"
#include "tessera/data/index_cache.h"

namespace tessera {

std::vector<uint64_t> blend_source_sizes(const std::vector<double>& weights, uint64_t size,
                                         double surplus) {
  std::vector<uint64_t> sizes;
  for (double w : weights)
    sizes.push_back(static_cast<uint64_t>(
        std::ceil(std::ceil(static_cast<double>(size) * w) * (1.0 + surplus))));
  return sizes;
}

std::vector<NpyArray> build_blending_indices(const std::vector<double>& weights, uint64_t size) {
  TS_CHECK(!weights.empty() && weights.size() < 32767, "{} blend sources", weights.size());
  NpyArray dataset_index(NpyType::Int16, size), dataset_sample_index(NpyType::Int64, size);
  std::vector<int64_t> drawn(weights.size(), 0);
  for (uint64_t i = 0; i < size; ++i) {
    // The source furthest behind its share of the first i samples (ties: the first).
    const double so_far = std::max(static_cast<double>(i), 1.0);
    size_t pick = 0;
    double worst = weights[0] * so_far - static_cast<double>(drawn[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * so_far - static_cast<double>(drawn[d]);
      if (error > worst) worst = error, pick = d;
    }
    dataset_index.data<int16_t>()[i] = static_cast<int16_t>(pick);
    dataset_sample_index.data<int64_t>()[i] = drawn[pick]++;
  }
  std::vector<NpyArray> out;
  out.push_back(std::move(dataset_index));
  out.push_back(std::move(dataset_sample_index));
  return out;
}

BlendedSource::BlendedSource(std::vector<std::unique_ptr<SampleSource>> sources,
                             std::vector<double> weights, uint64_t size, const std::string& split,
                             const std::string& cache_dir, const std::string& sources_identity)
    : sources_(std::move(sources)), weights_(std::move(weights)), size_(size) {
  std::string description = fmt::format(
      "{{\"class\": \"BlendedDataset\", \"split\": \"{}\", \"size\": {}, \"weights\": [{:.17g}], "
      "\"datasets\": {}}}\n",
      split, size_, fmt::join(weights_, ", "), sources_identity);
  CachedIndices cached = load_or_build_indices(
      cache_dir, "BlendedDataset-" + split, description, {"dataset_index", "dataset_sample_index"},
      [this] { return build_blending_indices(weights_, size_); },
      [this](const std::vector<NpyArray>& a) {
        return a[0].rows() == size_ && a[0].cols() == 0 && a[0].type() == NpyType::Int16 &&
               a[1].rows() == size_ && a[1].cols() == 0;
      });
  dataset_index_ = std::move(cached.arrays[0]);
  dataset_sample_index_ = std::move(cached.arrays[1]);
  cache_status_ = std::move(cached.status);
  std::vector<uint64_t> needed(sources_.size(), 0);
  for (uint64_t i = 0; i < size_; ++i) {
    const auto d = static_cast<size_t>(dataset_index_.at(i));
    TS_CHECK(d < sources_.size(), "blend index names source {} of {}", d, sources_.size());
    needed[d] = std::max(needed[d], static_cast<uint64_t>(dataset_sample_index_.at(i)) + 1);
  }
  for (size_t d = 0; d < sources_.size(); ++d)
    if (needed[d] > sources_[d]->samples_per_epoch())
      throw DataError(
          fmt::format("the {} blend needs {} samples from source {} ({}), which has only {}", split,
                      needed[d], d, sources_[d]->describe(), sources_[d]->samples_per_epoch()));
}

std::string BlendedSource::describe() const {
  std::string out = fmt::format("blend of {} samples (indices {}):", size_, cache_status_);
  for (size_t d = 0; d < sources_.size(); ++d)
    out += fmt::format("\n    {:.4f} x {}", weights_[d], sources_[d]->describe());
  return out;
}

void BlendedSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                           int32_t* positions) const {
  const uint64_t i = index % size_;
  sources_[static_cast<size_t>(dataset_index_.at(i))]->sample(
      static_cast<uint64_t>(dataset_sample_index_.at(i)), tokens, targets, positions);
}

bool BlendedSource::pads() const {
  return std::any_of(sources_.begin(), sources_.end(), [](const auto& s) { return s->pads(); });
}

std::optional<int64_t> BlendedSource::real_tokens(uint64_t index) const {
  const uint64_t i = index % size_;
  return sources_[static_cast<size_t>(dataset_index_.at(i))]->real_tokens(
      static_cast<uint64_t>(dataset_sample_index_.at(i)));
}

bool BlendedSource::masks_targets() const {
  return std::any_of(sources_.begin(), sources_.end(),
                     [](const auto& s) { return s->masks_targets(); });
}

}  // namespace tessera
