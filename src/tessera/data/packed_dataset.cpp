#include "tessera/data/packed_dataset.h"

#include <algorithm>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/data/chat.h"

namespace tessera {
namespace {

constexpr uint64_t kPackedOrderSalt = 0x7061636b65640001ull;  // "packed" order of sequences
constexpr size_t kEveryOrderUpTo = 6;  // 6! = 720 orders of a sequence's pieces
// Beyond that, rounds of swaps (each tries every pair once) while a round helps, stopping once
// the busiest rank is within 0.5% of the mean (sequences of many short documents start there)
// or after this many orders were weighed: a dataset of a million sequences is ordered in
// seconds to minutes.
constexpr int kOrdersWeighed = 4096;
constexpr double kBalanced = 1.005;

// Causal pairs of the queries at offsets [from, to) of a piece: sum of (k + 1).
double causal_pairs(int64_t from, int64_t to) {
  const auto f = [](int64_t k) { return static_cast<double>(k) * static_cast<double>(k + 1) / 2; };
  return f(to) - f(from);
}

double busiest_over_mean(const std::vector<double>& work) {
  double busiest = 0, sum = 0;
  for (double w : work) busiest = std::max(busiest, w), sum += w;
  return sum > 0 ? busiest * static_cast<double>(work.size()) / sum : 1.0;
}

// Each rank's work for pieces laid out in `order`, into `work` (cp entries).
void rank_work(const std::vector<int64_t>& lengths, const std::vector<size_t>& order, int64_t cp,
               std::vector<double>& work) {
  int64_t total = 0;
  for (int64_t n : lengths) total += n;
  TS_CHECK(cp >= 1 && total % (2 * cp) == 0, "{} tokens in {} context-parallel chunks", total, 2 * cp);
  const int64_t chunk = total / (2 * cp);
  work.assign(static_cast<size_t>(cp), 0.0);
  int64_t start = 0;
  for (size_t i : order) {
    const int64_t n = lengths[i];
    // The piece's offsets [a, b) that fall in chunk c, chunk by chunk.
    for (int64_t c = start / chunk; c < 2 * cp && c * chunk < start + n; ++c) {
      const int64_t a = std::max(start, c * chunk) - start, b = std::min(start + n, (c + 1) * chunk) - start;
      work[static_cast<size_t>(c < cp ? c : 2 * cp - 1 - c)] += causal_pairs(a, b);
    }
    start += n;
  }
}

std::vector<size_t> identity_order(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  return order;
}

}  // namespace

std::vector<double> context_parallel_work(const std::vector<int64_t>& lengths, int64_t cp) {
  std::vector<double> work;
  rank_work(lengths, identity_order(lengths.size()), cp, work);
  return work;
}

std::vector<size_t> balanced_order(const std::vector<int64_t>& lengths, int64_t cp) {
  std::vector<double> work;
  auto busiest = [&](const std::vector<size_t>& order) {
    rank_work(lengths, order, cp, work);
    return *std::max_element(work.begin(), work.end());
  };
  std::vector<size_t> order = identity_order(lengths.size()), best = order;
  double least = busiest(order);
  const double enough = kBalanced * std::accumulate(work.begin(), work.end(), 0.0) / static_cast<double>(cp);
  if (least <= enough) return best;
  if (lengths.size() <= kEveryOrderUpTo) {
    // Lexicographic from the given order: the first of the least busy orders is kept.
    while (std::next_permutation(order.begin(), order.end())) {
      const double b = busiest(order);
      if (b < least) least = b, best = order;
    }
    return best;
  }
  int weighed = 1;
  for (bool improved = true; improved && least > enough && weighed < kOrdersWeighed;) {
    improved = false;
    for (size_t i = 0; i + 1 < best.size() && weighed < kOrdersWeighed; ++i)
      for (size_t j = i + 1; j < best.size() && weighed < kOrdersWeighed; ++j) {
        if (lengths[best[i]] == lengths[best[j]]) continue;
        std::swap(best[i], best[j]);
        const double b = busiest(best);
        ++weighed;
        if (b < least) {
          least = b;
          improved = true;
        } else {
          std::swap(best[i], best[j]);
        }
      }
  }
  return best;
}

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
  if (o_.context_parallel_size > 1) balance_for_context_parallelism();
  const uint64_t per_epoch = bins_.size();
  samples_ = (std::max<uint64_t>(o_.num_samples, 1) + per_epoch - 1) / per_epoch * per_epoch;
  order_ = EpochOrder(per_epoch, o_.seed ^ kPackedOrderSalt, true);
}

void PackedSource::balance_for_context_parallelism() {
  const int64_t cp = o_.context_parallel_size;
  if (o_.seq_length % (2 * cp) != 0) return;  // validation refuses such a run
  double packed = 0, balanced = 0;
  for (std::vector<Piece>& bin : bins_) {
    int64_t used = 0;
    for (const Piece& p : bin) used += p.length;
    if (used < o_.seq_length) bin.push_back({kPadding, o_.seq_length - used});
    std::vector<int64_t> lengths;
    for (const Piece& p : bin) lengths.push_back(p.length);
    packed += busiest_over_mean(context_parallel_work(lengths, cp));
    const std::vector<size_t> order = balanced_order(lengths, cp);
    std::vector<Piece> ordered;
    std::vector<int64_t> ordered_lengths;
    for (size_t i : order) ordered.push_back(bin[i]), ordered_lengths.push_back(lengths[i]);
    balanced += busiest_over_mean(context_parallel_work(ordered_lengths, cp));
    bin = std::move(ordered);
  }
  imbalance_packed_ = packed / static_cast<double>(bins_.size());
  imbalance_ = balanced / static_cast<double>(bins_.size());
}

double PackedSource::efficiency() const {
  return static_cast<double>(real_tokens_) /
         static_cast<double>(bins_.size() * static_cast<uint64_t>(o_.seq_length));
}

std::string PackedSource::describe() const {
  std::string balance;
  if (o_.context_parallel_size > 1)
    balance = fmt::format(
        "; each sequence's documents ordered for {} context-parallel ranks: the busiest rank's "
        "attention work {:.3f}x the ranks' mean ({:.3f}x in packing order)",
        o_.context_parallel_size, imbalance_, imbalance_packed_);
  return fmt::format(
      "{} documents [{}, {}) of {}: packed best-fit decreasing into {} sequences of {} tokens "
      "per epoch, {:.1f}% of them real tokens (packing efficiency); {} documents cut to {} "
      "tokens, {} of one token skipped; {} samples{}",
      o_.split, o_.first_document, o_.end_document, o_.data->prefix(), bins_.size(),
      o_.seq_length, 100 * efficiency(), truncated_, o_.seq_length, skipped_, samples_, balance);
}

std::optional<int64_t> PackedSource::real_tokens(uint64_t index) const {
  const uint64_t epoch = (index % samples_) / bins_.size();
  int64_t n = 0;
  for (const Piece& p : bins_[order_.at(epoch, index % bins_.size())])
    if (p.document != kPadding) n += p.length;
  return n;
}

void PackedSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                          int32_t* positions) const {
  const int64_t T = o_.seq_length;
  const uint64_t epoch = (index % samples_) / bins_.size();
  const std::vector<Piece>& bin = bins_[order_.at(epoch, index % bins_.size())];
  // Padding: one more "document" whose tokens predict nothing, after the documents or where
  // the context-parallel balance placed it.
  const auto pad = [&](int64_t at, int64_t length) {
    for (int64_t k = 0; k < length; ++k) {
      tokens[at + k] = o_.pad_id;
      targets[at + k] = -1;
      if (positions) positions[at + k] = static_cast<int32_t>(k);
    }
  };
  std::vector<int32_t> doc, roles;
  int64_t at = 0;
  for (const Piece& p : bin) {
    if (p.document == kPadding) {
      pad(at, p.length);
      at += p.length;
      continue;
    }
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
  pad(at, T - at);
}

}  // namespace tessera
