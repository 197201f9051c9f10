// Megatron's GPT dataset and blends over indexed data: samples tile the document stream,
// the order is Megatron's (checked against numpy), determinism, split boundaries, blend
// proportions and the index cache.
#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "data_fixtures.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/data/blended_dataset.h"
#include "tessera/data/chat.h"
#include "tessera/data/dataset.h"
#include "tessera/data/gpt_dataset.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

using testing::ScratchDir;

const std::vector<int> kLengths = {37, 5, 120, 64, 1, 90, 33, 48, 77, 12, 250, 19, 8, 61, 40};

GptDatasetOptions options(const std::string& prefix, const std::string& cache, uint64_t samples,
                          int64_t seq = 16, uint32_t seed = 1234) {
  auto data = std::make_shared<const IndexedDataset>(prefix);
  GptDatasetOptions o;
  o.data = data;
  o.first_document = 0;
  o.end_document = data->sequences();
  o.seq_length = seq;
  o.seed = seed;
  o.num_samples = samples;
  o.cache_dir = cache;
  return o;
}

std::vector<int32_t> sample_tokens(const GptSource& s, uint64_t i, int64_t seq) {
  std::vector<int32_t> out(static_cast<size_t>(seq) + 1);
  s.read_sample(i, out.data());
  return out;
}

class GptDataset : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = (dir_ / "corpus").string();
    testing::write_dataset(prefix_, testing::distinct_documents(kLengths));
    for (int n : kLengths) total_ += static_cast<uint64_t>(n);
  }
  ScratchDir dir_;
  std::string prefix_;
  uint64_t total_ = 0;
};

// With distinct token ids, one epoch's samples must tile the shuffled document stream:
// inside a sample, a token is followed by the next one of its document or by the first of
// another; every token is the start of at most one step; the samples cover all but the tail.
TEST_F(GptDataset, OneEpochOfSamplesTilesTheDocuments) {
  const int64_t seq = 16;
  GptSource s(options(prefix_, (dir_ / "cache").string(), 10, seq));
  EXPECT_EQ(s.epochs(), 1u);
  ASSERT_EQ(s.samples_per_epoch(), (total_ - 1) / seq);
  std::set<int32_t> starts_of_documents;
  int32_t next = 0;
  for (int n : kLengths) starts_of_documents.insert(next), next += n;
  std::map<int32_t, int> seen;
  for (uint64_t i = 0; i < s.samples_per_epoch(); ++i) {
    const auto t = sample_tokens(s, i, seq);
    for (int64_t k = 0; k < seq; ++k) {
      ++seen[t[k]];
      EXPECT_TRUE(t[k + 1] == t[k] + 1 || starts_of_documents.count(t[k + 1])) << i << " " << k;
    }
  }
  EXPECT_EQ(seen.size(), s.samples_per_epoch() * seq);  // no token twice
  for (const auto& [token, count] : seen) EXPECT_EQ(count, 1) << token;
  std::vector<int32_t> tokens(seq), targets(seq);
  s.sample(3, tokens.data(), targets.data());
  const auto raw = sample_tokens(s, 3, seq);
  EXPECT_EQ(tokens, std::vector<int32_t>(raw.begin(), raw.end() - 1));
  EXPECT_EQ(targets, std::vector<int32_t>(raw.begin() + 1, raw.end()));
}

TEST_F(GptDataset, DeterministicForASeedAndShuffled) {
  const int64_t seq = 8;
  GptSource a(options(prefix_, (dir_ / "a").string(), 100, seq, 7));
  GptSource b(options(prefix_, (dir_ / "b").string(), 100, seq, 7));
  GptSource c(options(prefix_, (dir_ / "c").string(), 100, seq, 8));
  std::vector<int32_t> firsts;
  bool differs_by_seed = false;
  for (uint64_t i = 0; i < a.samples_per_epoch(); ++i) {
    const auto ta = sample_tokens(a, i, seq);
    EXPECT_EQ(ta, sample_tokens(b, i, seq)) << i;
    differs_by_seed |= ta != sample_tokens(c, i, seq);
    firsts.push_back(ta[0]);
  }
  EXPECT_TRUE(differs_by_seed);
  EXPECT_FALSE(std::is_sorted(firsts.begin(), firsts.end()));  // samples are shuffled
}

// More samples than one epoch holds: more epochs; each document appears once per epoch.
TEST_F(GptDataset, EpochsCoverTheRequestedSamples) {
  const int64_t seq = 16;
  const uint64_t per_epoch = (total_ - 1) / seq;
  GptSource s(options(prefix_, (dir_ / "cache").string(), 3 * per_epoch, seq));
  EXPECT_EQ(s.epochs(), 3u);  // 3 x 54 x 16 + 1 = 2593 tokens fit in 3 epochs of 865
  EXPECT_GE(s.samples_per_epoch(), 3 * per_epoch);
  std::map<int32_t, int> seen;
  for (uint64_t i = 0; i < s.samples_per_epoch(); ++i)
    for (int32_t t : sample_tokens(s, i, seq)) ++seen[t];
  EXPECT_EQ(seen.size(), total_);  // every token is used
}

// The indices match Megatron's, computed by a numpy implementation of gpt_dataset.py: one
// epoch, several epochs mixed, and a separately shuffled last epoch.
TEST_F(GptDataset, IndicesMatchMegatronsBuiltWithNumpy) {
  const uint64_t per_epoch = (total_ - 1) / 16;
  struct Case {
    uint64_t samples;
    uint32_t seed;
    int64_t seq;
  };
  for (const Case& c : {Case{20, 1234, 16}, Case{3 * per_epoch - 2, 99, 16},
                        Case{2 * per_epoch + 3, 5, 16}, Case{400, 1234, 3}}) {
    const std::string cache = (dir_ / fmt::format("cache{}", c.samples)).string();
    GptSource s(options(prefix_, cache, c.samples, c.seq, c.seed));
    const auto r = testing::run_command(fmt::format(
        "{} {}/megatron_gpt_indices.py {} 0 {} {} {} {} {} train", TESSERA_PYTHON,
        TESSERA_TEST_DATA_DIR, prefix_, kLengths.size(), c.samples, c.seq, c.seed, cache));
    if (r.exit_code == 77) GTEST_SKIP() << "numpy is not installed";
    EXPECT_EQ(r.exit_code, 0) << "samples " << c.samples << ": " << r.output;
  }
}

TEST_F(GptDataset, CacheIsReusedAndInvalidated) {
  const std::string cache = (dir_ / "cache").string();
  auto entries = [&] {
    int n = 0;
    for (const auto& f : std::filesystem::directory_iterator(cache))
      n += f.path().string().ends_with("description.txt");
    return n;
  };
  GptSource first(options(prefix_, cache, 50));
  EXPECT_NE(first.describe().find("built, saved in"), std::string::npos) << first.describe();
  GptSource again(options(prefix_, cache, 50));
  EXPECT_NE(again.describe().find("loaded from"), std::string::npos) << again.describe();
  EXPECT_EQ(sample_tokens(first, 17, 16), sample_tokens(again, 17, 16));
  EXPECT_EQ(entries(), 1);
  GptSource other_seed(options(prefix_, cache, 50, 16, 1));
  GptSource other_seq(options(prefix_, cache, 50, 12));
  GptSource other_count(options(prefix_, cache, 60));
  EXPECT_EQ(entries(), 4);

  // Data rewritten with the same totals but other document lengths gets new indices.
  std::vector<int> swapped = kLengths;
  std::swap(swapped[0], swapped[1]);
  testing::write_dataset(prefix_, testing::distinct_documents(swapped));
  GptSource rewritten(options(prefix_, cache, 50));
  EXPECT_NE(rewritten.describe().find("built"), std::string::npos);
  EXPECT_EQ(entries(), 5);

  // A damaged cache file is rebuilt, not trusted.
  for (const auto& f : std::filesystem::directory_iterator(cache))
    if (f.path().string().ends_with("shuffle_index.npy"))
      std::filesystem::resize_file(f.path(), 100);
  GptSource repaired(options(prefix_, cache, 50));
  EXPECT_NE(repaired.describe().find("built, saved in"), std::string::npos) << repaired.describe();
  EXPECT_EQ(sample_tokens(repaired, 17, 16), sample_tokens(rewritten, 17, 16));
}

TEST_F(GptDataset, UnwritableCacheKeepsIndicesInMemory) {
  std::ofstream(dir_ / "a_file") << "x";
  GptSource s(options(prefix_, (dir_ / "a_file" / "cache").string(), 50));
  EXPECT_NE(s.describe().find("not cached"), std::string::npos) << s.describe();
  EXPECT_EQ(sample_tokens(s, 3, 16).size(), 17u);
}

TEST(Blend, ParseNormalisesWeightsAndNamesBadTokens) {
  const auto b = parse_blend("0.7 /data/a  0.3 /data/b", "data_path", "exp.yaml:3");
  ASSERT_EQ(b.size(), 2u);
  EXPECT_DOUBLE_EQ(b[0].weight, 0.7);
  EXPECT_EQ(b[1].prefix, "/data/b");
  const auto c = parse_blend("3 a 1 b", "data_path", "x");
  EXPECT_DOUBLE_EQ(c[0].weight, 0.75);
  EXPECT_EQ(parse_blend("/data/single", "k", "x")[0].weight, 1.0);
  for (const auto& [text, token] :
       std::vector<std::pair<std::string, std::string>>{{"0.7 a x b", "'x'"},
                                                        {"0.7 a -1 b", "'-1'"},
                                                        {"0 a 1 b", "'0'"},
                                                        {"a b c", "3 words"},
                                                        {"/data/a_document.bin", "extension"},
                                                        {"0.5 a 0.5 b.idx", "'b.idx'"}}) {
    try {
      parse_blend(text, "train_data_path", "exp.yaml:9");
      ADD_FAILURE() << text;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), "train_data_path");
      EXPECT_NE(std::string(e.what()).find("exp.yaml:9"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find(token), std::string::npos) << e.what();
    }
  }
}

// Megatron's interleave: after any number of samples each source is within one sample of
// its weighted share, and sizes follow ceil(size x weight) (with 0.5% surplus for sources).
TEST(Blend, IndicesFollowTheWeightsAtEveryPrefix) {
  const std::vector<double> w = {0.5, 0.3, 0.2};
  const auto idx = build_blending_indices(w, 1000);
  std::vector<int64_t> drawn(3, 0);
  for (uint64_t i = 0; i < 1000; ++i) {
    const auto d = static_cast<size_t>(idx[0].at(i));
    EXPECT_EQ(idx[1].at(i), drawn[d]);  // each source's samples in order
    ++drawn[d];
    for (size_t k = 0; k < 3; ++k) EXPECT_LT(std::abs(drawn[k] - w[k] * (i + 1)), 1.0 + 1e-9);
  }
  EXPECT_EQ(drawn, (std::vector<int64_t>{500, 300, 200}));
  EXPECT_EQ(blend_source_sizes({0.7, 0.3}, 1000, 0), (std::vector<uint64_t>{700, 300}));
  EXPECT_EQ(blend_source_sizes({0.7, 0.3}, 1000, 0.005), (std::vector<uint64_t>{704, 302}));
}

// Builds an experiment from YAML text with tiny training settings.
Experiment experiment(const ScratchDir& dir, const std::string& data_yaml) {
  const auto yaml = dir / "exp.yaml";
  std::ofstream(yaml) << "model: tiny_llama\nseq_length: 16\nmicro_batch_size: 2\n"
                         "global_batch_size: 4\ntrain_iters: 25\neval_iters: 3\n"
                         "data_cache_path: "
                      << (dir / "cache").string() << "\n"
                      << data_yaml;
  LoadOptions o;
  o.config_path = yaml.string();
  return load_experiment(o);
}

std::set<int32_t> tokens_of(const SampleSource& s, uint64_t n, int64_t seq = 16) {
  std::set<int32_t> out;
  std::vector<int32_t> tokens(seq), targets(seq);
  for (uint64_t i = 0; i < n; ++i) {
    s.sample(i, tokens.data(), targets.data());
    out.insert(tokens.begin(), tokens.end());
    out.insert(targets.begin(), targets.end());
  }
  return out;
}

// Documents 0..9 hold only the token 10+d, so a token names its document.
std::vector<std::vector<int32_t>> labelled_documents(int count, int length, int base) {
  std::vector<std::vector<int32_t>> docs(count);
  for (int d = 0; d < count; ++d) docs[d].assign(length, base + d);
  return docs;
}

TEST(IndexedSources, SplitBoundariesFollowMegatronRounding) {
  ScratchDir dir;
  const std::string p = (dir / "ten").string();
  testing::write_dataset(p, labelled_documents(10, 40, 10));
  ByteTokenizer tok;
  // 1/3 and 2/3 of 10 documents: 3.33 -> 3, 6.67 -> 7.
  const DataSources d = make_data_sources(
      experiment(dir, "data_path: " + p + "\nsplit: \"1,1,1\"\neval_interval: 5\n"), tok, 257);
  ASSERT_TRUE(d.valid);
  EXPECT_EQ(tokens_of(*d.train, d.train->samples_per_epoch()), (std::set<int32_t>{10, 11, 12}));
  EXPECT_EQ(tokens_of(*d.valid, d.valid->samples_per_epoch()), (std::set<int32_t>{13, 14, 15, 16}));
  // 5 documents, "1,1,0": 2.5 rounds half to even, to 2.
  const std::string q = (dir / "five").string();
  testing::write_dataset(q, labelled_documents(5, 40, 10));
  const DataSources e = make_data_sources(
      experiment(dir, "data_path: " + q + "\nsplit: \"1,1,0\"\neval_interval: 5\n"), tok, 257);
  EXPECT_EQ(tokens_of(*e.train, e.train->samples_per_epoch()), (std::set<int32_t>{10, 11}));
  // Without evaluation no validation source is built; a zero validation share has none.
  EXPECT_FALSE(make_data_sources(experiment(dir, "data_path: " + p + "\n"), tok, 257).valid);
  EXPECT_FALSE(
      make_data_sources(
          experiment(dir, "data_path: " + p + "\nsplit: \"1,0,0\"\neval_interval: 5\n"), tok, 257)
          .valid);
}

TEST(IndexedSources, BlendDrawsByWeightAndSizesByTrainingLength) {
  ScratchDir dir;
  const std::string a = (dir / "a").string(), b = (dir / "b").string(), v = (dir / "v").string();
  testing::write_dataset(a, labelled_documents(10, 30, 10));   // tokens 10-19
  testing::write_dataset(b, labelled_documents(10, 30, 100));  // tokens 100-109
  testing::write_dataset(v, labelled_documents(4, 30, 200));   // tokens 200-203
  ByteTokenizer tok;
  const Experiment e = experiment(dir, "train_data_path: \"0.75 " + a + " 0.25 " + b +
                                           "\"\nvalid_data_path: " + v + "\neval_interval: 5\n");
  const DataSources d = make_data_sources(e, tok, 257);
  const uint64_t wanted = 25 * 4;                   // train_iters x global_batch_size
  EXPECT_EQ(d.train->samples_per_epoch(), wanted);  // ceil(75) + ceil(25)
  std::vector<int32_t> tokens(16), targets(16);
  int from_a = 0;
  for (uint64_t i = 0; i < wanted; ++i) {
    d.train->sample(i, tokens.data(), targets.data());
    const bool in_a = tokens[0] < 100;
    from_a += in_a;
    for (int32_t t : tokens) EXPECT_EQ(t < 100, in_a);  // a sample comes from one dataset
  }
  EXPECT_EQ(from_a, 75);
  ASSERT_TRUE(d.valid);
  for (int32_t t : tokens_of(*d.valid, 12)) EXPECT_GE(t, 200);
  EXPECT_NE(d.description.find("blend of 100 samples"), std::string::npos) << d.description;
}

TEST(IndexedSources, ConfigErrorsNameKeyAndToken) {
  ScratchDir dir;
  const std::string p = (dir / "x").string();
  testing::write_dataset(p, labelled_documents(4, 30, 10));
  auto error_of = [&](const std::string& yaml) -> std::string {
    try {
      experiment(dir, yaml);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const std::string weight = error_of("data_path: \"0.5 " + p + " half " + p + "\"\n");
  EXPECT_NE(weight.find("data_path"), std::string::npos) << weight;
  EXPECT_NE(weight.find("'half'"), std::string::npos) << weight;
  EXPECT_NE(error_of("data_path: " + p + "\ntrain_data_path: " + p + "\n").find("data_path"),
            std::string::npos);
  EXPECT_NE(error_of("train_data_path: " + p + "_missing\n").find("scripts/setup.sh"),
            std::string::npos);
  EXPECT_NE(error_of("data_path: " + p + "\ntarget_loss: 2.0\n").find("eval_interval"),
            std::string::npos);
  // An existing PREFIX.bin is a mistaken prefix, not a text file.
  EXPECT_NE(error_of("train_data_path: " + p + ".bin\n").find("extension"), std::string::npos);
  EXPECT_EQ(error_of("train_data_path: " + p + "\n"), "");  // a prefix is accepted
}

TEST(IndexedSources, VocabularyMismatchIsADataError) {
  ScratchDir dir;
  const std::string p = (dir / "wide").string();
  testing::write_dataset(p, labelled_documents(4, 30, 10), TokenDType::Int32);
  ByteTokenizer tok;
  EXPECT_THROW(make_data_sources(experiment(dir, "data_path: " + p + "\n"), tok, 257), DataError);
}

// Chat data: the roles beside a dataset choose which targets count, by loss_mask; a target
// is masked by its own role (the token it predicts). eod_mask_loss masks the positions whose
// input is the end-of-document token.
TEST(IndexedSources, LossMasksFollowTheRolesOfTheTargets) {
  ScratchDir dir;
  const std::string p = (dir / "chat_chat_document").string();
  const auto docs = testing::distinct_documents({30, 25, 40});
  // Each conversation: a user turn, an assistant turn, a user turn, the final assistant turn.
  std::vector<std::vector<int32_t>> roles;
  for (const auto& d : docs) {
    roles.emplace_back();
    for (size_t k = 0; k < d.size(); ++k) {
      const auto user = static_cast<int32_t>(TokenRole::User), bot = static_cast<int32_t>(TokenRole::Assistant);
      roles.back().push_back(k < 8 ? user : k < 14 ? bot : k < 19 ? user : bot | kFinalTurn);
    }
  }
  testing::write_dataset(p, docs);
  testing::write_dataset(chat_roles_prefix(p), roles, TokenDType::UInt8);
  std::map<int32_t, uint8_t> role_of;  // token id -> the role of that token
  for (size_t d = 0; d < docs.size(); ++d)
    for (size_t k = 0; k < docs[d].size(); ++k) role_of[docs[d][k]] = static_cast<uint8_t>(roles[d][k]);
  ByteTokenizer tok;
  const auto sources = [&](const std::string& mask) {
    return make_data_sources(experiment(dir, "data_path: " + p + "\nsplit: \"1,0,0\"\nloss_mask: " + mask + "\n"), tok, 257);
  };
  const DataSources all = sources("all");
  EXPECT_FALSE(all.train->masks_targets());
  for (const auto& [name, mask] : std::vector<std::pair<std::string, LossMask>>{
           {"assistant", LossMask::Assistant}, {"completion", LossMask::Completion}}) {
    SCOPED_TRACE(name);
    const DataSources d = sources(name);
    EXPECT_TRUE(d.train->masks_targets());
    std::vector<int32_t> tokens(16), targets(16), all_tokens(16), all_targets(16);
    int64_t counted = 0, masked = 0;
    for (uint64_t i = 0; i < 20; ++i) {
      d.train->sample(i, tokens.data(), targets.data());
      all.train->sample(i, all_tokens.data(), all_targets.data());
      EXPECT_EQ(tokens, all_tokens);
      for (size_t t = 0; t < 16; ++t) {
        const bool counts = counts_for_loss(role_of.at(all_targets[t]), mask);
        EXPECT_EQ(targets[t], counts ? all_targets[t] : -1) << "sample " << i << " position " << t;
        (counts ? counted : masked) += 1;
      }
    }
    EXPECT_GT(counted, 0);
    EXPECT_GT(masked, 0);
  }
  // Roles that do not match their tokens are refused naming both.
  testing::write_dataset(chat_roles_prefix(p), {roles[0], roles[1]}, TokenDType::UInt8);
  try {
    make_data_sources(experiment(dir, "data_path: " + p + "\nsplit: \"1,0,0\"\n"), tok, 257);
    ADD_FAILURE() << "misaligned roles accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("the roles do not match the tokens"), std::string::npos) << e.what();
  }
}

TEST(TokenStreams, EodMaskLossMasksPositionsWhoseInputEndsADocument) {
  std::vector<int32_t> stream;
  for (int d = 0; d < 6; ++d) {
    for (int k = 0; k < 7; ++k) stream.push_back(10 + k);
    stream.push_back(256);
  }
  TokenStreamSource plain("s", stream, 8, 1, false, 256), masked("s", stream, 8, 1, false, 256, true);
  EXPECT_FALSE(plain.masks_targets());
  EXPECT_TRUE(masked.masks_targets());
  std::vector<int32_t> tokens(8), targets(8), plain_targets(8);
  for (uint64_t i = 0; i < masked.samples_per_epoch(); ++i) {
    masked.sample(i, tokens.data(), targets.data());
    plain.sample(i, tokens.data(), plain_targets.data());
    for (size_t t = 0; t < 8; ++t) EXPECT_EQ(targets[t], tokens[t] == 256 ? -1 : plain_targets[t]);
  }
  MockSource mock(300, 64, 3, 7, true);  // random ids below 300: some are 7
  std::vector<int32_t> mt(64), mg(64);
  int sevens = 0;
  for (uint64_t i = 0; i < 50; ++i) {
    mock.sample(i, mt.data(), mg.data());
    for (size_t t = 0; t < 64; ++t)
      if (mt[t] == 7) {
        ++sevens;
        EXPECT_EQ(mg[t], -1);
      }
  }
  EXPECT_GT(sevens, 0);
}

// reset_position_ids: positions restart after each end-of-document token (token streams, mock
// data) and where an indexed dataset's documents meet (chat data has no such token).
TEST(Positions, RestartAtEachDocumentOfTheSample) {
  std::vector<int32_t> stream;
  for (int d = 0; d < 6; ++d) {
    for (int k = 0; k < 5 + d; ++k) stream.push_back(10 + k);
    stream.push_back(256);
  }
  TokenStreamSource source("s", stream, 8, 1, false, 256);
  std::vector<int32_t> tokens(8), targets(8), positions(8);
  for (uint64_t i = 0; i < source.samples_per_epoch(); ++i) {
    source.sample(i, tokens.data(), targets.data(), positions.data());
    for (size_t t = 0; t < 8; ++t)
      EXPECT_EQ(positions[t], t == 0 || tokens[t - 1] == 256 ? 0 : positions[t - 1] + 1) << i << " " << t;
  }
  ScratchDir dir;
  const std::string p = (dir / "docs").string();
  const auto docs = testing::distinct_documents({5, 9, 3, 11, 7, 6});
  testing::write_dataset(p, docs);
  std::map<int32_t, std::pair<size_t, int32_t>> where;  // token -> (document, index in it)
  for (size_t d = 0; d < docs.size(); ++d)
    for (size_t k = 0; k < docs[d].size(); ++k) where[docs[d][k]] = {d, static_cast<int32_t>(k)};
  ByteTokenizer tok;
  const DataSources d = make_data_sources(experiment(dir, "data_path: " + p + "\nsplit: \"1,0,0\"\n"), tok, 257);
  std::vector<int32_t> t16(16), g16(16), p16(16);
  for (uint64_t i = 0; i < 8; ++i) {
    d.train->sample(i, t16.data(), g16.data(), p16.data());
    EXPECT_EQ(p16[0], 0);
    for (size_t t = 1; t < 16; ++t) {
      // The same document instance: its next token (a document may follow itself across epochs).
      const bool same = where.at(t16[t]).first == where.at(t16[t - 1]).first && t16[t] == t16[t - 1] + 1;
      EXPECT_EQ(p16[t], same ? p16[t - 1] + 1 : 0) << "sample " << i << " token " << t;
      if (!same) EXPECT_EQ(where.at(t16[t]).second, 0);  // a document's first token
    }
  }
}

}  // namespace
}  // namespace tessera
