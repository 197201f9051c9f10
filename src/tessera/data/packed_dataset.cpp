#include "tessera/data/packed_dataset.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/data/chat.h"

namespace tessera {
namespace {

constexpr uint64_t kPackedOrderSalt = 0x7061636b65640001ull;  // "packed" order of sequences

}  // namespace

PackedSource::PackedSource(PackedDatasetOptions options) : o_(std::move(options)) {
  const int64_t T = o_.seq_length;
  std::vector<std::pair<int64_t, uint64_t>> docs;  // (tokens kept, document), longest first
  for (uint64_t d = o_.first_document; d < o_.end_document; ++d) {
    const int64_t n = o_.data->sequence_length(d);
    if (n < 2) {  // one token predicts nothing
      ++skipped_;
      continue;
    }
    truncated_ += n > T;
    docs.emplace_back(std::min(n, T), d);
  }
  if (docs.empty())
    throw DataError(fmt::format("{}: the {} split's documents [{}, {}) hold no document of two "
                                "tokens or more to pack",
                                o_.data->prefix(), o_.split, o_.first_document, o_.end_document));
  std::stable_sort(docs.begin(), docs.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  // Best fit: the sequence whose room is the smallest that still holds the document.
  std::multimap<int64_t, size_t> room;  // free tokens -> sequence
  for (const auto& [n, d] : docs) {
    auto fit = room.lower_bound(n);
    size_t bin;
    int64_t left;
    if (fit == room.end()) {
      bin = bins_.size();
      bins_.emplace_back();
      left = T;
    } else {
      bin = fit->second;
      left = fit->first;
      room.erase(fit);
    }
    bins_[bin].push_back({d, n});
    real_tokens_ += static_cast<uint64_t>(n);
    if (left - n > 0) room.emplace(left - n, bin);
  }
  const uint64_t per_epoch = bins_.size();
  samples_ = (std::max<uint64_t>(o_.num_samples, 1) + per_epoch - 1) / per_epoch * per_epoch;
  order_ = EpochOrder(per_epoch, o_.seed ^ kPackedOrderSalt, true);
}

double PackedSource::efficiency() const {
  return static_cast<double>(real_tokens_) /
         static_cast<double>(bins_.size() * static_cast<uint64_t>(o_.seq_length));
}

std::string PackedSource::describe() const {
  return fmt::format(
      "{} documents [{}, {}) of {}: packed best-fit decreasing into {} sequences of {} tokens "
      "per epoch, {:.1f}% of them real tokens (packing efficiency); {} documents cut to {} "
      "tokens, {} of one token skipped; {} samples",
      o_.split, o_.first_document, o_.end_document, o_.data->prefix(), bins_.size(),
      o_.seq_length, 100 * efficiency(), truncated_, o_.seq_length, skipped_, samples_);
}

std::optional<int64_t> PackedSource::real_tokens(uint64_t index) const {
  const uint64_t epoch = (index % samples_) / bins_.size();
  int64_t n = 0;
  for (const Piece& p : bins_[order_.at(epoch, index % bins_.size())]) n += p.length;
  return n;
}

void PackedSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                          int32_t* positions) const {
  const int64_t T = o_.seq_length;
  const uint64_t epoch = (index % samples_) / bins_.size();
  const std::vector<Piece>& bin = bins_[order_.at(epoch, index % bins_.size())];
  std::vector<int32_t> doc, roles;
  int64_t at = 0;
  for (const Piece& p : bin) {
    // A cut document's last kept token still predicts its next one.
    const int64_t full = o_.data->sequence_length(p.document);
    const int64_t read = std::min(full, p.length + 1);
    doc.resize(static_cast<size_t>(read));
    o_.data->read(p.document, 0, static_cast<uint64_t>(read), doc.data());
    if (o_.roles) {
      roles.resize(doc.size());
      o_.roles->read(p.document, 0, static_cast<uint64_t>(read), roles.data());
    }
    for (int64_t k = 0; k < p.length; ++k) {
      tokens[at + k] = doc[k];
      if (positions) positions[at + k] = static_cast<int32_t>(k);
      const bool has_next = k + 1 < read;
      const bool counts = has_next && doc[k] != o_.eod_mask &&
                          (!o_.roles || counts_for_loss(static_cast<uint8_t>(roles[k + 1]), o_.loss_mask));
      targets[at + k] = counts ? doc[k + 1] : -1;
    }
    at += p.length;
  }
  // Padding: one more "document" whose tokens predict nothing.
  for (int64_t k = 0; at + k < T; ++k) {
    tokens[at + k] = o_.pad_id;
    targets[at + k] = -1;
    if (positions) positions[at + k] = static_cast<int32_t>(k);
  }
}

}  // namespace tessera
