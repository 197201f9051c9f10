#include "tessera/data/dataset.h"

#include <numeric>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/text_corpus.h"

namespace tessera {
namespace {

// Salts keep the data streams independent of the weight-initialisation stream.
constexpr uint64_t kMockSalt = 0x6d6f636b64617461ull;     // "mockdata"
constexpr uint64_t kShuffleSalt = 0x73687566666c6521ull;  // "shuffle!"

}  // namespace

std::string MockSource::describe() const {
  return fmt::format("mock data: uniform random tokens in [0, {})", vocab_);
}

void MockSource::sample(uint64_t index, int32_t* tokens, int32_t* targets) const {
  const uint64_t base = index * static_cast<uint64_t>(seq_ + 1);
  const uint64_t seed = seed_ ^ kMockSalt;
  for (int64_t t = 0; t <= seq_; ++t) {
    const int32_t id = static_cast<int32_t>(random_below(seed, base + t, static_cast<uint32_t>(vocab_)));
    if (t < seq_) tokens[t] = id;
    if (t > 0) targets[t - 1] = id;
  }
}

TokenStreamSource::TokenStreamSource(std::string name, std::vector<int32_t> stream,
                                     int64_t seq_length, uint64_t seed, bool shuffle)
    : name_(std::move(name)), stream_(std::move(stream)), seq_(seq_length), seed_(seed),
      shuffle_(shuffle) {
  windows_ = stream_.size() > static_cast<size_t>(seq_) ? (stream_.size() - 1) / seq_ : 0;
}

std::string TokenStreamSource::describe() const {
  return fmt::format("{}: {} tokens, {} samples of {}+1 tokens per epoch", name_, stream_.size(),
                     windows_, seq_);
}

// Fisher-Yates with the counter-based generator, so the order is the same on every
// platform and standard library.
const std::vector<uint32_t>& TokenStreamSource::order(uint64_t epoch) const {
  if (cached_epoch_ == epoch) return cached_order_;
  cached_order_.resize(windows_);
  std::iota(cached_order_.begin(), cached_order_.end(), 0u);
  if (shuffle_) {
    const uint64_t seed = seed_ ^ kShuffleSalt ^ splitmix64(epoch);
    for (uint64_t i = windows_ - 1; i > 0; --i) {
      const uint64_t j = random_below(seed, i, static_cast<uint32_t>(i + 1));
      std::swap(cached_order_[i], cached_order_[j]);
    }
  }
  cached_epoch_ = epoch;
  return cached_order_;
}

void TokenStreamSource::sample(uint64_t index, int32_t* tokens, int32_t* targets) const {
  const uint64_t window = order(index / windows_)[index % windows_];
  const int32_t* src = stream_.data() + window * seq_;
  std::copy(src, src + seq_, tokens);
  std::copy(src + 1, src + seq_ + 1, targets);
}

DataSources make_data_sources(const Experiment& e, const Tokenizer& tokenizer, int64_t vocab) {
  const int64_t seq = e.training.seq_length;
  const uint64_t seed = static_cast<uint64_t>(e.training.seed);
  DataSources d;
  if (e.data.mock_data) {
    d.train = std::make_unique<MockSource>(vocab, seq, seed);
    d.valid = std::make_unique<MockSource>(vocab, seq, seed + 1);
    d.description = d.train->describe();
    return d;
  }
  const std::string& path = e.data.train_data_path;
  const std::vector<std::string> docs = load_text_documents(path);
  // Documents are assigned to train/valid/test in order by the split proportions, as
  // Megatron splits its document index.
  const std::vector<double> split = parse_split(e.data.split);
  const double total = split[0] + split[1] + split[2];
  const size_t n_train = static_cast<size_t>(docs.size() * (split[0] / total) + 0.5);
  const size_t n_valid =
      static_cast<size_t>(docs.size() * ((split[0] + split[1]) / total) + 0.5) - n_train;
  std::vector<int32_t> train, valid;
  size_t bytes = 0;
  // The test split (the documents after train and valid) is left out.
  for (size_t i = 0; i < n_train + n_valid; ++i) {
    auto& out = i < n_train ? train : valid;
    tokenizer.encode(docs[i], &out);
    out.push_back(tokenizer.eod_id());
    bytes += docs[i].size();
  }
  auto train_src = std::make_unique<TokenStreamSource>("train", std::move(train), seq, seed, true);
  if (train_src->samples_per_epoch() == 0)
    throw DataError(fmt::format("{}: {} training tokens are too few for one sample of seq_length+1 = {}",
                                path, train_src->tokens(), seq + 1));
  auto valid_src = std::make_unique<TokenStreamSource>("valid", std::move(valid), seq, seed, false);
  d.description = fmt::format("{} ({} documents, {:.1f} MB of text, {} tokenizer); {}; {}", path,
                              docs.size(), bytes / 1e6, tokenizer.name(), train_src->describe(),
                              valid_src->describe());
  d.train = std::move(train_src);
  if (valid_src->samples_per_epoch() > 0) d.valid = std::move(valid_src);
  return d;
}

}  // namespace tessera
