#include "tessera/data/dataset.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/blended_dataset.h"
#include "tessera/data/chat.h"
#include "tessera/data/gpt_dataset.h"
#include "tessera/data/indexed_dataset.h"
#include "tessera/data/packed_dataset.h"
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

void positions_after_eod(const int32_t* tokens, int64_t n, int32_t eod, int32_t* positions) {
  for (int64_t t = 0; t < n; ++t)
    positions[t] = t == 0 || (eod >= 0 && tokens[t - 1] == eod) ? 0 : positions[t - 1] + 1;
}

void MockSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                        int32_t* positions) const {
  const int32_t masked = eod_mask_loss_ ? eod_ : -1;
  const uint64_t base = index * static_cast<uint64_t>(seq_ + 1);
  const uint64_t seed = seed_ ^ kMockSalt;
  for (int64_t t = 0; t <= seq_; ++t) {
    const int32_t id = static_cast<int32_t>(random_below(seed, base + t, static_cast<uint32_t>(vocab_)));
    if (t < seq_) tokens[t] = id;
    if (t > 0) targets[t - 1] = masked >= 0 && tokens[t - 1] == masked ? -1 : id;
  }
  if (positions) positions_after_eod(tokens, seq_, eod_, positions);
}

TokenStreamSource::TokenStreamSource(std::string name, std::vector<int32_t> stream,
                                     int64_t seq_length, uint64_t seed, bool shuffle,
                                     int32_t eod, bool eod_mask_loss)
    : name_(std::move(name)), stream_(std::move(stream)), seq_(seq_length), seed_(seed),
      shuffle_(shuffle), eod_(eod), eod_mask_loss_(eod_mask_loss) {
  windows_ = stream_.size() > static_cast<size_t>(seq_) ? (stream_.size() - 1) / seq_ : 0;
  order_ = EpochOrder(windows_, seed_ ^ kShuffleSalt, shuffle_);
}

std::string TokenStreamSource::describe() const {
  return fmt::format("{}: {} tokens, {} samples of {}+1 tokens per epoch", name_, stream_.size(),
                     windows_, seq_);
}

const std::vector<uint32_t>& EpochOrder::of(uint64_t epoch) const {
  if (cached_epoch_ == epoch) return cached_;
  cached_.resize(n_);
  std::iota(cached_.begin(), cached_.end(), 0u);
  if (shuffle_ && n_ > 1) {
    const uint64_t seed = seed_ ^ splitmix64(epoch);
    for (uint64_t i = n_ - 1; i > 0; --i)
      std::swap(cached_[i], cached_[random_below(seed, i, static_cast<uint32_t>(i + 1))]);
  }
  cached_epoch_ = epoch;
  return cached_;
}

void TokenStreamSource::sample(uint64_t index, int32_t* tokens, int32_t* targets,
                               int32_t* positions) const {
  const uint64_t window = order_.at(index / windows_, index % windows_);
  const int32_t* src = stream_.data() + window * seq_;
  std::copy(src, src + seq_, tokens);
  std::copy(src + 1, src + seq_ + 1, targets);
  if (masks_targets())
    for (int64_t t = 0; t < seq_; ++t)
      if (tokens[t] == eod_) targets[t] = -1;
  if (positions) positions_after_eod(tokens, seq_, eod_, positions);
}

namespace {

// Plain or Brown-corpus text, tokenized in memory. Documents are assigned to train/valid/test
// in order by the split proportions, as Megatron splits its document index.
DataSources make_text_sources(const Experiment& e, const Tokenizer& tokenizer) {
  const int64_t seq = e.training.seq_length;
  const uint64_t seed = static_cast<uint64_t>(e.training.seed);
  const std::string& path = e.data.train_data_path;
  const std::vector<std::string> docs = load_text_documents(path);
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
  const bool mask = e.data.eod_mask_loss;
  auto train_src = std::make_unique<TokenStreamSource>("train", std::move(train), seq, seed, true,
                                                       tokenizer.eod_id(), mask);
  if (train_src->samples_per_epoch() == 0)
    throw DataError(fmt::format("{}: {} training tokens are too few for one sample of seq_length+1 = {}",
                                path, train_src->tokens(), seq + 1));
  auto valid_src = std::make_unique<TokenStreamSource>("valid", std::move(valid), seq, seed, false,
                                                       tokenizer.eod_id(), mask);
  DataSources d;
  d.description = fmt::format("{} ({} documents, {:.1f} MB of text, {} tokenizer); {}; {}", path,
                              docs.size(), bytes / 1e6, tokenizer.name(), train_src->describe(),
                              valid_src->describe());
  d.train = std::move(train_src);
  if (valid_src->samples_per_epoch() > 0) d.valid = std::move(valid_src);
  return d;
}

// Megatron's document range of split part `part` (0 train, 1 valid, 2 test) of n documents:
// cumulative normalised proportions scaled by n and rounded half to even, as Python's
// round(). Empty when the part's proportion is 0.
std::pair<uint64_t, uint64_t> split_range(const std::vector<double>& split, int part, uint64_t n) {
  const double total = split[0] + split[1] + split[2];
  double bounds[4] = {0, 0, 0, 0};
  for (int i = 0; i < 3; ++i) bounds[i + 1] = bounds[i] + split[i] / total;
  if (bounds[part + 1] <= bounds[part]) return {0, 0};
  const double count = static_cast<double>(n);
  return {static_cast<uint64_t>(std::nearbyint(bounds[part] * count)),
          static_cast<uint64_t>(std::nearbyint(bounds[part + 1] * count))};
}

// What every indexed source of one experiment shares; each prefix is opened once.
struct IndexedContext {
  int64_t seq_length;
  uint32_t seed;
  std::string cache_dir;  // empty: a cache/ directory beside the data
  int64_t vocab;
  std::string tokenizer;
  int32_t eod_mask;
  LossMask loss_mask;
  PackingStrategy packing;
  int32_t pad_id;  // bfd padding
  // Context-parallel ranks whose attention work each bfd sequence's order balances (documents
  // that do not see each other only; PackedDatasetOptions).
  int64_t balanced_ranks;
  std::map<std::string, std::shared_ptr<const IndexedDataset>> opened;
  // The roles of chat datasets (preprocess --chat), by token prefix; null for other data.
  std::map<std::string, std::shared_ptr<const IndexedDataset>> roles;
  // Datasets without a tokenizer record, which validation could not check (validate.cpp).
  std::vector<std::string> unrecorded;

  std::shared_ptr<const IndexedDataset> open(const std::string& prefix) {
    auto& slot = opened[prefix];
    if (!slot) {
      slot = std::make_shared<const IndexedDataset>(prefix, vocab, tokenizer);
      if (!std::filesystem::exists(dataset_meta_path(prefix))) unrecorded.push_back(prefix);
      if (std::filesystem::exists(chat_roles_prefix(prefix) + ".idx"))
        roles[prefix] = open_roles(*slot);
    }
    return slot;
  }
  // A chat dataset's roles, which must describe its tokens one for one.
  static std::shared_ptr<const IndexedDataset> open_roles(const IndexedDataset& tokens) {
    auto r = std::make_shared<const IndexedDataset>(chat_roles_prefix(tokens.prefix()));
    bool aligned = r->sequences() == tokens.sequences() && r->documents() == tokens.documents();
    for (uint64_t i = 0; aligned && i < tokens.sequences(); ++i)
      aligned = r->sequence_length(i) == tokens.sequence_length(i);
    if (!aligned)
      throw DataError(fmt::format(
          "{}: the roles do not match the tokens of {} ({} vs {} sequences, or a length "
          "differs); preprocess --chat writes both together: run it again",
          r->prefix(), tokens.prefix(), r->sequences(), tokens.sequences()));
    return r;
  }
  std::string cache_for(const std::string& prefix) const {
    return !cache_dir.empty() ? cache_dir
                              : (std::filesystem::path(prefix).parent_path() / "cache").string();
  }
};

// The `name` ("train", "valid") source of a blend: part `part` of each dataset's documents
// by `split`, or all of them when split is null. Null when the split leaves it empty.
std::unique_ptr<SampleSource> make_blend_source(const std::vector<BlendEntry>& blend,
                                                const std::vector<double>* split, int part,
                                                const std::string& name, uint64_t samples,
                                                IndexedContext& ctx) {
  std::vector<double> weights;
  for (const auto& b : blend) weights.push_back(b.weight);
  // Each dataset of a blend builds a margin of samples beyond its share (Megatron's
  // mid_level_dataset_surplus), so that the interleave never runs out.
  const std::vector<uint64_t> sizes = blend.size() == 1
                                          ? std::vector<uint64_t>{samples}
                                          : blend_source_sizes(weights, samples, 0.005);
  std::vector<std::unique_ptr<SampleSource>> sources;
  std::string identity;
  for (size_t i = 0; i < blend.size(); ++i) {
    const auto data = ctx.open(blend[i].prefix);
    const auto [first, end] = split ? split_range(*split, part, data->sequences())
                                    : std::pair<uint64_t, uint64_t>{0, data->sequences()};
    if (first >= end) {
      if (blend.size() == 1) return nullptr;
      throw DataError(
          fmt::format("{}: split leaves the {} part of its {} documents empty, but "
                      "the blend draws {} samples from it",
                      blend[i].prefix, name, data->sequences(), sizes[i]));
    }
    const auto roles = ctx.roles.find(blend[i].prefix);
    if (ctx.packing == PackingStrategy::Bfd) {
      sources.push_back(std::make_unique<PackedSource>(PackedDatasetOptions{
          .data = data,
          .roles = roles == ctx.roles.end() ? nullptr : roles->second,
          .first_document = first,
          .end_document = end,
          .split = name,
          .seq_length = ctx.seq_length,
          .seed = ctx.seed,
          .num_samples = sizes[i],
          .loss_mask = ctx.loss_mask,
          .eod_mask = ctx.eod_mask,
          .pad_id = ctx.pad_id,
          .context_parallel_size = ctx.balanced_ranks,
      }));
      identity += fmt::format("{}\"{}[{}, {}) bfd\"", i ? ", " : "[",
                              std::filesystem::absolute(blend[i].prefix).string(), first, end);
      continue;
    }
    sources.push_back(std::make_unique<GptSource>(GptDatasetOptions{
        .data = data,
        .roles = roles == ctx.roles.end() ? nullptr : roles->second,
        .loss_mask = ctx.loss_mask,
        .eod_mask = ctx.eod_mask,
        .first_document = first,
        .end_document = end,
        .split = name,
        .seq_length = ctx.seq_length,
        .seed = ctx.seed,
        .num_samples = sizes[i],
        .cache_dir = ctx.cache_for(blend[i].prefix),
    }));
    identity += fmt::format("{}\"{}[{}, {})\"", i ? ", " : "[",
                            std::filesystem::absolute(blend[i].prefix).string(), first, end);
  }
  if (sources.size() == 1) return std::move(sources[0]);
  // The blend's own size is the sum of the sources' shares (at least `samples`).
  uint64_t size = 0;
  for (uint64_t share : blend_source_sizes(weights, samples, 0)) size += share;
  return std::make_unique<BlendedSource>(std::move(sources), weights, size, name,
                                         ctx.cache_for(blend[0].prefix), identity + "]");
}

std::string origin_of(const Experiment& e, const std::string& key) {
  const auto it = e.origin.find(key);
  return it == e.origin.end() ? "default" : it->second;
}

}  // namespace

DataSources make_data_sources(const Experiment& e, const Tokenizer& tokenizer, int64_t vocab) {
  const int64_t seq = e.training.seq_length;
  const uint64_t seed = static_cast<uint64_t>(e.training.seed);
  const DataConfig& dc = e.data;
  DataSources d;
  const int32_t eod_mask = dc.eod_mask_loss ? tokenizer.eod_id() : -1;
  if (dc.mock_data) {
    const int32_t eod = tokenizer.eod_id();
    d.train = std::make_unique<MockSource>(vocab, seq, seed, eod, dc.eod_mask_loss);
    d.valid = std::make_unique<MockSource>(vocab, seq, seed + 1, eod, dc.eod_mask_loss);
    d.description = d.train->describe();
    return d;
  }
  const uint64_t batch = static_cast<uint64_t>(e.training.global_batch_size);
  const uint64_t train_samples = static_cast<uint64_t>(e.training.train_iters) * batch;
  const uint64_t valid_samples = static_cast<uint64_t>(dc.eval_iters) * batch;
  const bool evaluate = dc.eval_interval > 0;
  // NumPy's RandomState, which fixes Megatron's order, takes 32-bit seeds.
  IndexedContext ctx{.seq_length = seq,
                     .seed = static_cast<uint32_t>(seed),
                     .cache_dir = dc.data_cache_path,
                     .vocab = vocab,
                     .tokenizer = tokenizer.name(),
                     .eod_mask = eod_mask,
                     .loss_mask = dc.loss_mask,
                     .packing = dc.packing_strategy,
                     .pad_id = tokenizer.eod_id(),
                     .balanced_ranks = dc.reset_attention_mask ? e.training.context_parallel_size : 1,
                     .opened = {},
                     .roles = {},
                     .unrecorded = {}};
  if (!dc.train_data_path.empty() && is_text_corpus_path(dc.train_data_path)) {
    // bfd packs the documents of indexed datasets; text read into memory is one stream.
    if (dc.packing_strategy == PackingStrategy::Bfd)
      throw ConfigError(origin_of(e, "packing_strategy"), "packing_strategy", "bfd",
                        "wrapped with a text train_data_path: bfd packs the documents of "
                        "indexed datasets (tessera preprocess makes them)");
    d = make_text_sources(e, tokenizer);
  } else {
    const bool split_data = !dc.data_path.empty();
    const std::string key = split_data ? "data_path" : "train_data_path";
    const auto blend =
        parse_blend(split_data ? dc.data_path : dc.train_data_path, key, origin_of(e, key));
    const std::vector<double> split = parse_split(dc.split);
    d.train =
        make_blend_source(blend, split_data ? &split : nullptr, 0, "train", train_samples, ctx);
    if (!d.train)
      throw DataError(fmt::format("{}: no training documents ({} documents, split '{}')",
                                  blend[0].prefix, ctx.open(blend[0].prefix)->sequences(),
                                  dc.split));
    if (split_data && evaluate && dc.valid_data_path.empty())
      d.valid = make_blend_source(blend, &split, 1, "valid", valid_samples, ctx);
    d.description = fmt::format("{} tokenizer; {}", tokenizer.name(), d.train->describe());
    if (d.valid) d.description += "; " + d.valid->describe();
  }
  if (!dc.valid_data_path.empty() && evaluate) {
    const auto blend =
        parse_blend(dc.valid_data_path, "valid_data_path", origin_of(e, "valid_data_path"));
    d.valid = make_blend_source(blend, nullptr, 1, "valid", valid_samples, ctx);
    if (d.valid) d.description += "; validation from valid_data_path: " + d.valid->describe();
  }
  if (!ctx.unrecorded.empty())
    d.description += fmt::format(
        "; tokenizer not checked for {} (no .meta.json: made by Megatron's tools or an older "
        "Tessera)",
        fmt::join(ctx.unrecorded, ", "));
  return d;
}

}  // namespace tessera
