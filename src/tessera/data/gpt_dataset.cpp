#include "tessera/data/gpt_dataset.h"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/data/index_cache.h"

namespace tessera {
namespace {

template <class T>
void fill_and_shuffle(T* out, uint64_t count, T first, NumpyRandomState& rng) {
  std::iota(out, out + count, first);
  rng.shuffle(out, count);
}

}  // namespace

GptSource::GptSource(GptDatasetOptions options) : o_(std::move(options)) {
  const IndexedDataset& data = *o_.data;
  TS_CHECK(o_.first_document < o_.end_document && o_.end_document <= data.sequences() &&
               o_.seq_length >= 1 && o_.num_samples >= 1,
           "bad GPT dataset range [{}, {}) of {}", o_.first_document, o_.end_document,
           data.sequences());
  documents_ = o_.end_document - o_.first_document;
  // The indices depend on the documents' lengths only; their digest keys the cache, so
  // data rewritten under the same name gets new indices.
  uint64_t lengths_digest = 0xcbf29ce484222325ull;
  for (uint64_t d = o_.first_document; d < o_.end_document; ++d) {
    const auto length = static_cast<uint64_t>(data.sequence_length(d));
    tokens_per_epoch_ += length;
    lengths_digest = (lengths_digest ^ length) * 0x100000001b3ull;
  }
  if (tokens_per_epoch_ < 2)
    throw DataError(fmt::format(
        "{}: the {} documents [{}, {}) hold {} tokens, too few for a sample", data.prefix(),
        o_.split, o_.first_document, o_.end_document, tokens_per_epoch_));
  const uint64_t seq = static_cast<uint64_t>(o_.seq_length);
  // As many epochs as it takes for num_samples samples of seq_length+1 tokens.
  const uint64_t wanted_tokens = o_.num_samples * seq + 1;
  epochs_ = std::max<uint64_t>(1, (wanted_tokens + tokens_per_epoch_ - 1) / tokens_per_epoch_);
  samples_ = (epochs_ * tokens_per_epoch_ - 1) / seq;
  if (epochs_ > 1) {
    samples_before_final_epoch_ = ((epochs_ - 1) * tokens_per_epoch_ - 1) / seq;
    const uint64_t from_final_epoch = o_.num_samples - samples_before_final_epoch_;
    const uint64_t per_epoch = (tokens_per_epoch_ - 1) / seq;
    separate_final_epoch_ = from_final_epoch < static_cast<uint64_t>(0.8 * per_epoch);
  }

  const std::string description = fmt::format(
      "{{\"class\": \"GPTDataset\", \"path_prefix\": \"{}\", \"sequences\": {}, \"tokens\": {}, "
      "\"lengths_digest\": \"{:016x}\", \"split\": \"{}\", \"documents\": [{}, {}], "
      "\"num_samples\": {}, \"sequence_length\": {}, \"random_seed\": {}, "
      "\"add_extra_token_to_sequence\": true}}\n",
      std::filesystem::absolute(data.prefix()).string(), data.sequences(), data.tokens(),
      lengths_digest, o_.split, o_.first_document, o_.end_document, o_.num_samples, o_.seq_length,
      o_.seed);
  CachedIndices cached = load_or_build_indices(
      o_.cache_dir, "GPTDataset-" + o_.split, description,
      {"document_index", "sample_index", "shuffle_index"}, [this] { return build_indices(); },
      [this](const std::vector<NpyArray>& a) { return indices_fit(a); });
  document_index_ = std::move(cached.arrays[0]);
  sample_index_ = std::move(cached.arrays[1]);
  shuffle_index_ = std::move(cached.arrays[2]);
  cache_status_ = std::move(cached.status);
}

bool GptSource::indices_fit(const std::vector<NpyArray>& a) const {
  return a[0].rows() == epochs_ * documents_ && a[0].cols() == 0 && a[1].rows() == samples_ + 1 &&
         a[1].cols() == 2 && a[2].rows() == samples_ && a[2].cols() == 0;
}

std::vector<NpyArray> GptSource::build_indices() const {
  const IndexedDataset& data = *o_.data;
  NumpyRandomState rng(o_.seed);

  // Document index: epoch after epoch of the split's documents, shuffled.
  const uint64_t positions = epochs_ * documents_;
  if (o_.end_document > static_cast<uint64_t>(INT32_MAX))
    throw DataError(
        fmt::format("{}: more than 2^31 documents; Megatron's int32 document index "
                    "cannot address them",
                    data.prefix()));
  NpyArray document_index(NpyType::Int32, positions);
  int32_t* docs = document_index.data<int32_t>();
  for (uint64_t e = 0; e < epochs_; ++e)
    std::iota(docs + e * documents_, docs + (e + 1) * documents_,
              static_cast<int32_t>(o_.first_document));
  const uint64_t mixed = separate_final_epoch_ ? positions - documents_ : positions;
  rng.shuffle(docs, mixed);
  rng.shuffle(docs + mixed, positions - mixed);

  // Sample index: walk the shuffled stream seq_length tokens at a time. Megatron stores it
  // as int32 when every position and offset fits.
  int32_t longest = 0;
  for (uint64_t s = 0; s < data.sequences(); ++s)
    longest = std::max(longest, data.sequence_length(s));
  const bool narrow = std::max<uint64_t>(positions, static_cast<uint64_t>(longest)) <= INT32_MAX;
  NpyArray sample_index(narrow ? NpyType::Int32 : NpyType::Int64, samples_ + 1, 2);
  auto record = [&](uint64_t k, uint64_t position, int64_t offset) {
    if (narrow) {
      sample_index.data<int32_t>()[2 * k] = static_cast<int32_t>(position);
      sample_index.data<int32_t>()[2 * k + 1] = static_cast<int32_t>(offset);
    } else {
      sample_index.data<int64_t>()[2 * k] = static_cast<int64_t>(position);
      sample_index.data<int64_t>()[2 * k + 1] = offset;
    }
  };
  uint64_t position = 0;
  int64_t offset = 0;
  record(0, 0, 0);
  for (uint64_t k = 1; k <= samples_; ++k) {
    // The next sample starts at the last token of this one: seq_length+1 tokens ahead,
    // minus the one they share.
    int64_t remaining = o_.seq_length + 1;
    while (remaining > 0) {
      const int64_t available =
          data.sequence_length(static_cast<uint64_t>(docs[position])) - offset;
      if (available >= remaining) {
        offset += remaining - 1;
        remaining = 0;
      } else if (position + 1 == positions) {
        // Only the very last sample can end exactly on the last token of the stream.
        offset += available - 1;
        remaining = 0;
      } else {
        remaining -= available;
        ++position;
        offset = 0;
      }
    }
    record(k, position, offset);
  }

  // Shuffle index: a permutation of the samples; those of a separate final epoch apart.
  const bool wide = samples_ >= UINT32_MAX - 1ull;
  NpyArray shuffle_index(wide ? NpyType::Int64 : NpyType::UInt32, samples_);
  const uint64_t first_part = separate_final_epoch_ ? samples_before_final_epoch_ : samples_;
  if (wide) {
    fill_and_shuffle<int64_t>(shuffle_index.data<int64_t>(), first_part, 0, rng);
    fill_and_shuffle<int64_t>(shuffle_index.data<int64_t>() + first_part, samples_ - first_part,
                              static_cast<int64_t>(first_part), rng);
  } else {
    fill_and_shuffle<uint32_t>(shuffle_index.data<uint32_t>(), first_part, 0, rng);
    fill_and_shuffle<uint32_t>(shuffle_index.data<uint32_t>() + first_part, samples_ - first_part,
                               static_cast<uint32_t>(first_part), rng);
  }
  std::vector<NpyArray> out;
  out.push_back(std::move(document_index));
  out.push_back(std::move(sample_index));
  out.push_back(std::move(shuffle_index));
  return out;
}

void GptSource::read_sample(uint64_t index, int32_t* out, bool roles, int32_t* positions) const {
  const IndexedDataset& data = roles ? *o_.roles : *o_.data;
  const uint64_t s = static_cast<uint64_t>(shuffle_index_.at(index % samples_));
  TS_CHECK(s < samples_, "shuffle index entry {} is {} of {} samples", index % samples_, s,
           samples_);
  const uint64_t first = static_cast<uint64_t>(sample_index_.at(s, 0));
  const uint64_t last = static_cast<uint64_t>(sample_index_.at(s + 1, 0));
  TS_CHECK(first <= last && last < document_index_.rows(), "sample {} spans positions {}-{} of {}",
           s, first, last, document_index_.rows());
  const uint64_t last_offset = static_cast<uint64_t>(sample_index_.at(s + 1, 1));
  uint64_t offset = static_cast<uint64_t>(sample_index_.at(s, 1));
  uint64_t written = 0;
  for (uint64_t position = first; position <= last; ++position) {
    const auto doc = static_cast<uint64_t>(document_index_.at(position));
    // Up to the sample's last token (included) in the last document, else to the end.
    const uint64_t end =
        position == last ? last_offset + 1 : static_cast<uint64_t>(data.sequence_length(doc));
    TS_CHECK(written + (end - offset) <= static_cast<uint64_t>(o_.seq_length) + 1,
             "sample {} overflows seq_length+1", index);
    data.read(doc, offset, end - offset, out + written);
    if (positions)
      for (uint64_t k = 0; k < end - offset; ++k) positions[written + k] = static_cast<int32_t>(k);
    written += end - offset;
    offset = 0;
  }
  TS_CHECK(written == static_cast<uint64_t>(o_.seq_length) + 1, "sample {} has {} tokens", index,
           written);
}

void GptSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                       int32_t* positions) const {
  const auto n = static_cast<size_t>(o_.seq_length);
  std::vector<int32_t> buf(n + 1), window_positions(positions ? n + 1 : 0);
  read_sample(index, buf.data(), false, positions ? window_positions.data() : nullptr);
  if (positions) std::copy(window_positions.begin(), window_positions.begin() + n, positions);
  for (size_t t = 0; t < n; ++t) {
    tokens[t] = buf[t];
    targets[t] = tokens[t] == o_.eod_mask ? -1 : buf[t + 1];
  }
  if (!o_.roles || o_.loss_mask == LossMask::All) return;
  read_sample(index, buf.data(), /*roles=*/true);
  for (size_t t = 0; t < n; ++t)
    if (!counts_for_loss(static_cast<uint8_t>(buf[t + 1]), o_.loss_mask)) targets[t] = -1;
}

std::string GptSource::describe() const {
  return fmt::format(
      "{} documents [{}, {}) of {} ({} tokens): {} samples of {}+1 tokens, {} "
      "epoch{}; indices {}",
      o_.split, o_.first_document, o_.end_document, o_.data->prefix(), tokens_per_epoch_, samples_,
      o_.seq_length, epochs_, epochs_ == 1 ? "" : "s", cache_status_);
}

}  // namespace tessera
