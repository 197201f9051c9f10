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

// The tokens of document `doc` before its first assistant token: the prompt, in a pair.
std::vector<int32_t> prompt_of(const IndexedDataset& tokens, const IndexedDataset& roles, uint64_t doc) {
  const auto n = static_cast<uint64_t>(tokens.sequence_length(doc));
  std::vector<int32_t> ids(n), role(n);
  tokens.read(doc, 0, n, ids.data());
  roles.read(doc, 0, n, role.data());
  size_t k = 0;
  while (k < n && token_role(static_cast<uint8_t>(role[k])) != TokenRole::Assistant) ++k;
  ids.resize(k);
  return ids;
}

// Conversations (preprocess --chat) have roles and may come in an even count too; what makes
// documents 2p and 2p+1 a pair is one prompt, up to the first assistant token of either.
void check_pairs_share_their_prompts(const IndexedDataset& tokens, const IndexedDataset& roles,
                                     const std::string& prefix) {
  for (uint64_t pair = 0; pair < tokens.sequences() / 2; ++pair) {
    const std::vector<int32_t> chosen = prompt_of(tokens, roles, 2 * pair),
                               rejected = prompt_of(tokens, roles, 2 * pair + 1);
    if (chosen == rejected) continue;
    const auto differ = std::mismatch(chosen.begin(), chosen.end(), rejected.begin(), rejected.end());
    throw DataError(fmt::format(
        "{}: documents {} and {} (pair {}) differ at token {}, before either's answer; objective "
        "dpo trains on preference pairs, a pair's two documents the chosen and the rejected "
        "answer to one prompt (tessera preprocess --preference; --chat writes conversations)",
        prefix, 2 * pair, 2 * pair + 1, pair, differ.first - chosen.begin()));
  }
}

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

PreferenceSource::PairSides PreferenceSource::read_sides(uint64_t index) const {
  PairSides p;
  const auto n = static_cast<size_t>(2 * seq_);
  p.tokens.resize(n), p.targets.resize(n), p.positions.resize(n);
  for (int side = 0; side < 2; ++side) {
    const auto at = static_cast<size_t>(side * seq_);
    sample(index, side, p.tokens.data() + at, p.targets.data() + at, p.positions.data() + at);
    p.real[side] = std::min<int64_t>(tokens_->sequence_length(2 * pair(index) + static_cast<uint64_t>(side)), seq_);
  }
  const int32_t* rejected_tokens = p.tokens.data() + seq_;
  const int32_t* rejected_targets = p.targets.data() + seq_;
  const int64_t both = std::min(p.real[0], p.real[1]);
  while (p.shared < both && p.tokens[p.shared] == rejected_tokens[p.shared] &&
         p.targets[p.shared] < 0 && rejected_targets[p.shared] < 0)
    ++p.shared;
  return p;
}

SharedPromptPair PreferenceSource::sample_shared(uint64_t index, int64_t row_length, int32_t* tokens,
                                                 int32_t* targets, int32_t* positions) const {
  const PairSides p = read_sides(index);
  const int64_t used = p.real[0] + p.real[1] - p.shared;
  TS_CHECK(used <= row_length, "pair {} of {}: {} rows with its prompt once, in a row of {}",
           pair(index), prefix(), used, row_length);
  // Row r of the layout is side 0's row r, then side 1's rows from `shared` on.
  for (int64_t r = 0; r < row_length; ++r) {
    const int64_t from = r < p.real[0] ? r : r < used ? seq_ + p.shared + (r - p.real[0]) : -1;
    tokens[r] = from >= 0 ? p.tokens[from] : pad_id_;
    targets[r] = from >= 0 ? p.targets[from] : -1;
    positions[r] = static_cast<int32_t>(from >= 0 ? p.positions[from] : r - used);
  }
  return {static_cast<int32_t>(p.shared), static_cast<int32_t>(p.real[0]), static_cast<int32_t>(used)};
}

PreferenceSource::SharedExtent PreferenceSource::shared_extent() const {
  SharedExtent e;
  for (uint64_t i = 0; i < pairs(); ++i) {
    const PairSides p = read_sides(i);
    e.row = std::max(e.row, p.real[0] + p.real[1] - p.shared);
    e.side = std::max({e.side, p.real[0], p.real[1]});
  }
  return e;
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
  check_pairs_share_their_prompts(*tokens, *roles, prefix);
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
