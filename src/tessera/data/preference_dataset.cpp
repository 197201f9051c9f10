#include "tessera/data/preference_dataset.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/data/chat.h"

namespace tessera {
namespace {

constexpr uint64_t kPairOrderSalt = 0x7072656665720001ull;  // "prefer"

}  // namespace

PreferenceSource::PreferenceSource(std::shared_ptr<const IndexedDataset> tokens,
                                   std::shared_ptr<const IndexedDataset> roles, uint64_t first,
                                   uint64_t end, int64_t seq_length, uint32_t seed,
                                   int32_t pad_id, bool shuffle)
    : tokens_(std::move(tokens)), roles_(std::move(roles)), first_(first), end_(end),
      seq_(seq_length), pad_id_(pad_id), order_(end - first, seed ^ kPairOrderSalt, shuffle) {}

std::string PreferenceSource::describe() const {
  return fmt::format("preference pairs [{}, {}) of {}: each side a sequence of {} tokens", first_,
                     end_, tokens_->prefix(), seq_);
}

void PreferenceSource::sample(uint64_t index, int side, int32_t* tokens, int32_t* targets,
                              int32_t* positions) const {
  const uint64_t doc = 2 * pair(index) + static_cast<uint64_t>(side);
  const int64_t full = tokens_->sequence_length(doc);
  const int64_t kept = std::min(full, seq_), read = std::min(full, seq_ + 1);
  std::vector<int32_t> ids(static_cast<size_t>(read)), roles(static_cast<size_t>(read));
  tokens_->read(doc, 0, static_cast<uint64_t>(read), ids.data());
  roles_->read(doc, 0, static_cast<uint64_t>(read), roles.data());
  for (int64_t k = 0; k < seq_; ++k) {
    const bool real = k < kept;
    tokens[k] = real ? ids[k] : pad_id_;
    positions[k] = static_cast<int32_t>(real ? k : k - kept);
    const bool counts = real && k + 1 < read &&
                        counts_for_loss(static_cast<uint8_t>(roles[k + 1]), LossMask::Completion);
    targets[k] = counts ? ids[k + 1] : -1;
  }
}

int64_t PreferenceSource::real_tokens(uint64_t index) const {
  int64_t n = 0;
  for (uint64_t side = 0; side < 2; ++side) n += std::min<int64_t>(tokens_->sequence_length(2 * pair(index) + side), seq_);
  return n;
}

PreferenceSources make_preference_sources(const Experiment& e, int64_t vocab,
                                          const std::string& tokenizer_name, int32_t pad_id) {
  const std::string& prefix = e.data.data_path;
  if (prefix.empty() || prefix.find(' ') != std::string::npos)
    throw ConfigError("configuration", "data_path", prefix,
                      "one preference dataset with objective dpo (preprocess --preference's "
                      "PREFIX_preference_document; blends are not taken)");
  auto tokens = std::make_shared<const IndexedDataset>(prefix, vocab, tokenizer_name);
  if (!std::filesystem::exists(chat_roles_prefix(prefix) + ".idx"))
    throw DataError(fmt::format("{}: no {}.idx beside it; objective dpo trains on preference pairs "
                                "(tessera preprocess --preference)",
                                prefix, chat_roles_prefix(prefix)));
  auto roles = std::make_shared<const IndexedDataset>(chat_roles_prefix(prefix));
  if (tokens->sequences() % 2 != 0 || roles->sequences() != tokens->sequences())
    throw DataError(fmt::format("{}: {} documents (roles: {}); expected pairs, an even count with "
                                "their roles (tessera preprocess --preference)",
                                prefix, tokens->sequences(), roles->sequences()));
  const uint64_t pairs = tokens->sequences() / 2;
  const std::vector<double> split = parse_split(e.data.split);
  const double total = split[0] + split[1] + split[2];
  const auto bound = [&](double share) {
    return static_cast<uint64_t>(std::nearbyint(share / total * static_cast<double>(pairs)));
  };
  const uint64_t train_end = bound(split[0]), valid_end = bound(split[0] + split[1]);
  if (train_end == 0)
    throw DataError(fmt::format("{}: split '{}' leaves none of its {} pairs for training", prefix,
                                e.data.split, pairs));
  const int64_t T = e.training.seq_length;
  const auto seed = static_cast<uint32_t>(e.training.seed);
  PreferenceSources s;
  s.train = std::make_unique<PreferenceSource>(tokens, roles, 0, train_end, T, seed, pad_id, true);
  if (valid_end > train_end)
    s.valid = std::make_unique<PreferenceSource>(tokens, roles, train_end, valid_end, T, seed,
                                                 pad_id, false);
  return s;
}

}  // namespace tessera
