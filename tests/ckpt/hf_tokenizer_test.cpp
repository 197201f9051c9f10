// Hugging Face exports carry the run's tokenizer, so that transformers' AutoTokenizer and
// pipeline("text-generation") load them: tokenizer.json copied byte for byte, and
// tokenizer_config.json, special_tokens_map.json, generation_config.json and config.json naming
// the ids Tessera's tokenizer gives the special tokens (end of document = eos). The reference
// implementation (@huggingface/tokenizers under node, reading the exported directory) encodes
// a few sentences to the same ids as Tessera. A byte-level run exports ids only, with a warning
// (docs/checkpoints.md says why).
#include <cstdlib>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/hf_model.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/data/bpe_tokenizer.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"

namespace tessera::testing {
namespace {

using nlohmann::json;

constexpr int64_t kMaxPositions = 256;  // != seq_length: model_max_length must be this one

// A one-iteration mock-data run of a tiny model, its vocabulary the tokenizer's (`tokenizer`
// sets tokenizer_type and tokenizer_model; vocab_size 0), saved in dir/ckpt.
std::string train_tiny(const fs::path& dir, const std::string& tokenizer) {
  const std::string save = (dir / "ckpt").string();
  const fs::path p = dir / "experiment.yaml";
  std::ofstream(p) << "model: tiny_llama\nmock_data: true\nvocab_size: 0\nnum_layers: 1\n"
                      "hidden_size: 16\nffn_hidden_size: 32\nnum_attention_heads: 2\n"
                      "num_query_groups: 1\nmax_position_embeddings: "
                   << kMaxPositions
                   << "\nseq_length: 8\nmicro_batch_size: 1\nglobal_batch_size: 1\n"
                      "train_iters: 1\nlr_warmup_iters: 0\nlog_progress: false\n"
                   << tokenizer << "save: " << save << "\n";
  LoadOptions o;
  o.config_path = p.string();
  Logger log("", 0, false, false);
  make_trainer(load_experiment(o), log)->train();
  return save;
}

json read_json(const fs::path& p) {
  return json::parse(read_file(p));
}

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

const std::set<std::string> kTokenizerExport = {"config.json",       "generation_config.json",
                                                "model.safetensors", "special_tokens_map.json",
                                                "tokenizer.json",    "tokenizer_config.json"};

const std::vector<std::string> kSentences = {
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, a tab\tand numbers 1234567 and 3.14159\n\nnew paragraph",
    "Unicode: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽",
    "Special tokens in the text: <|end_of_text|> <|endoftext|> <s> </s>",
    "def f(x):\n    return x ** 2  # squared\n",
};

// The ids @huggingface/tokenizers gives each sentence from the exported directory (its
// tokenizer.json and tokenizer_config.json; scripts/tokenizer/encode_reference.mjs).
std::vector<std::vector<int32_t>> reference_ids(const fs::path& hf, const fs::path& scratch) {
  std::string cmd = "node " + std::string(TESSERA_SOURCE_DIR) +
                    "/scripts/tokenizer/encode_reference.mjs '" + (hf / "tokenizer.json").string() +
                    "' --out '" + (scratch / "reference.json").string() + "'";
  for (size_t i = 0; i < kSentences.size(); ++i) {
    const fs::path text = scratch / ("sentence" + std::to_string(i) + ".txt");
    write_file(text, kSentences[i]);
    cmd += " '" + text.string() + "'";
  }
  const RunResult r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  if (r.exit_code != 0) return {};
  return read_json(scratch / "reference.json")["ids"].get<std::vector<std::vector<int32_t>>>();
}

struct SpecialIds {
  std::optional<int32_t> bos, eos, pad;
};

json id_or_null(std::optional<int32_t> id) {
  return id ? json(*id) : json(nullptr);
}

// The export in `hf` of the Hugging Face tokenizer `name` (shipped name or path), against
// Tessera's own tokenizer of that name and the special token ids `want`.
void expect_tokenizer_export(const fs::path& hf, const std::string& name, const SpecialIds& want,
                             const fs::path& scratch) {
  SCOPED_TRACE("tokenizer " + name);
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = name;
  const std::unique_ptr<Tokenizer> loaded = make_tokenizer(data);
  const auto& tokenizer = dynamic_cast<const BpeTokenizer&>(*loaded);
  const fs::path source = tokenizer_json_path(name);
  EXPECT_EQ(files_in(hf), kTokenizerExport);
  EXPECT_TRUE(read_file(hf / "tokenizer.json") == read_file(source))
      << hf / "tokenizer.json"
      << " is not a byte-for-byte copy of " << source;

  const json tc = read_json(hf / "tokenizer_config.json"),
             map = read_json(hf / "special_tokens_map.json"),
             gen = read_json(hf / "generation_config.json"), config = read_json(hf / "config.json");
  // The special tokens are those Tessera's tokenizer has at these ids; eos is what training
  // ended every document with.
  const auto id_of = [&](const char* key) -> std::optional<int32_t> {
    if (!tc.contains(key) || tc[key].is_null()) return std::nullopt;
    const auto id = tokenizer.token_to_id(tc[key].get<std::string>());
    EXPECT_TRUE(id.has_value()) << key << " " << tc[key];
    return id;
  };
  EXPECT_EQ(tc["eos_token"], tokenizer.eod_token());
  EXPECT_EQ(id_of("eos_token"), tokenizer.eod_id());
  EXPECT_EQ(id_of("eos_token"), want.eos);
  EXPECT_EQ(id_of("bos_token"), want.bos);
  EXPECT_EQ(id_of("pad_token"), want.pad);
  EXPECT_EQ(tc["model_max_length"], kMaxPositions);
  EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
  for (const json* j : {&gen, &config}) {
    EXPECT_EQ((*j)["bos_token_id"], id_or_null(want.bos)) << *j;
    EXPECT_EQ((*j)["eos_token_id"], id_or_null(want.eos)) << *j;
    EXPECT_EQ(j->contains("pad_token_id"), want.pad.has_value()) << *j;
    if (want.pad) EXPECT_EQ((*j)["pad_token_id"], *want.pad) << *j;
  }
  json want_gen = {{"bos_token_id", id_or_null(want.bos)}, {"eos_token_id", id_or_null(want.eos)}};
  if (want.pad) want_gen["pad_token_id"] = *want.pad;
  want_gen["do_sample"] = false;  // greedy: the run has no sampling settings
  EXPECT_EQ(gen, want_gen);
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    const bool has = tc.contains(key) && !tc[key].is_null();
    EXPECT_EQ(map.contains(key), has) << key;
    if (has && map.contains(key)) EXPECT_EQ(map[key]["content"], tc[key]) << key;
  }
  // Based on the package's tokenizer_config.json (chat template, added tokens, options): only
  // eos_token, model_max_length and tokenizer_class may differ.
  const fs::path source_config = source.parent_path() / "tokenizer_config.json";
  if (fs::exists(source_config)) {
    const json original = read_json(source_config);
    for (const auto& [key, value] : original.items())
      if (key != "eos_token" && key != "model_max_length" && key != "tokenizer_class")
        EXPECT_EQ(tc[key], value) << key;
    EXPECT_EQ(tc.size(), original.size());
    if (original.contains("additional_special_tokens") &&
        !original["additional_special_tokens"].empty())
      EXPECT_EQ(map["additional_special_tokens"], original["additional_special_tokens"]);
  }

  const auto want_ids = reference_ids(hf, scratch);
  ASSERT_EQ(want_ids.size(), kSentences.size());
  for (size_t i = 0; i < kSentences.size(); ++i) {
    std::vector<int32_t> got;
    tokenizer.encode(kSentences[i], &got);
    EXPECT_EQ(got, want_ids[i]) << "sentence: " << kSentences[i];
  }
}

class HfTokenizerExport : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(std::system("node --version > /dev/null 2>&1"), 0)
        << "node is needed to run the reference tokenizer (scripts/setup.sh installs it)";
  }
};

TEST_F(HfTokenizerExport, ShippedTokenizersAreCopiedWithTheRunsSpecialTokenIds) {
  ScratchDir dir;
  // Qwen 3's vocabulary is the largest: the other shipped tokenizers fit the model too.
  const std::string save =
      train_tiny(dir.path(), "tokenizer_type: HuggingFaceTokenizer\ntokenizer_model: qwen3\n");
  struct Case {
    std::string option, name;
    SpecialIds ids;
  } cases[] = {
      // The checkpoint's own tokenizer. Qwen's package names <|im_end|> (151645) eos, the end
      // of a chat turn; the run ended documents with <|endoftext|>, which is also its pad.
      {"", "qwen3", {std::nullopt, 151643, 151643}},
      {"--tokenizer llama2", "llama2", {1, 2, std::nullopt}},
      {"--tokenizer llama3", "llama3", {128000, 128001, std::nullopt}},
      // The package's eos is the instruct model's <|eot_id|> (128009).
      {"--tokenizer llama3.1", "llama3.1", {128000, 128001, std::nullopt}},
  };
  for (const Case& c : cases) {
    const fs::path hf = dir / ("hf_" + c.name);
    const RunResult r =
        run_tessera("convert --from " + save + " --to-hf " + hf.string() + " " + c.option);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "tokenizer " + c.name + ")")) << r.output;
    EXPECT_FALSE(contains(r.output, "warning")) << r.output;
    expect_tokenizer_export(hf, c.name, c.ids, dir.path());
  }
}

TEST_F(HfTokenizerExport, TokenizerJsonWithoutConfigAndOneThatIsGoneLeavesNoDirectory) {
  ScratchDir dir;
  fs::create_directories(dir / "tok");
  const fs::path copy = dir / "tok" / "tokenizer.json";
  fs::copy_file(tokenizer_json_path("llama2"), copy);
  const std::string save = train_tiny(
      dir.path(), "tokenizer_type: HuggingFaceTokenizer\ntokenizer_model: " + copy.string() + "\n");
  const fs::path hf = dir / "hf";
  RunResult r = run_tessera("convert --from " + save + " --to-hf " + hf.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Without a tokenizer_config.json beside it: bos is what the post-processor prepends, and
  // decoding keeps spaces as Tessera's decode does.
  expect_tokenizer_export(hf, copy.string(), {1, 2, std::nullopt}, dir.path());
  EXPECT_EQ(read_json(hf / "tokenizer_config.json"),
            json::parse(R"({"bos_token": "<s>", "clean_up_tokenization_spaces": false,
                            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                            "model_max_length": 256})"));
  EXPECT_EQ(read_json(hf / "special_tokens_map.json"),
            json::parse(R"({"bos_token": {"content": "<s>", "lstrip": false, "normalized": false,
                                          "rstrip": false, "single_word": false},
                            "eos_token": {"content": "</s>", "lstrip": false, "normalized": false,
                                          "rstrip": false, "single_word": false}})"));

  // The checkpoint's tokenizer has gone: nothing is written, and the message says what to do.
  fs::remove(copy);
  const fs::path none = dir / "none";
  r = run_tessera("convert --from " + save + " --to-hf " + none.string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, copy.string() + ": no such file")) << r.output;
  EXPECT_TRUE(contains(r.output, "--tokenizer NAME|PATH exports another")) << r.output;
  EXPECT_FALSE(fs::exists(none));
  EXPECT_FALSE(fs::exists(dir / "none.tmp"));
}

TEST_F(HfTokenizerExport, ByteLevelRunExportsIdsWithoutTokenizerFiles) {
  ScratchDir dir;
  const std::string save = train_tiny(dir.path(), "tokenizer_type: ByteLevel\n");
  const fs::path hf = dir / "hf";
  const RunResult r = run_tessera("convert --from " + save + " --to-hf " + hf.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "warning: " + hf.string() +
                                     ": no tokenizer files: no Hugging Face tokenizer encodes "
                                     "exactly like Tessera's byte tokenizer"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "generation_config.json hold its end-of-document id 256"))
      << r.output;
  EXPECT_EQ(files_in(hf),
            (std::set<std::string>{"config.json", "generation_config.json", "model.safetensors"}));
  const ByteTokenizer bytes;
  EXPECT_EQ(
      read_json(hf / "generation_config.json"),
      (json{{"bos_token_id", nullptr}, {"eos_token_id", bytes.eod_id()}, {"do_sample", false}}));
  const json config = read_json(hf / "config.json");
  EXPECT_EQ(config["bos_token_id"], nullptr);
  EXPECT_EQ(config["eos_token_id"], bytes.eod_id());
  EXPECT_EQ(config["vocab_size"], 384);  // 257 padded to a multiple of 128
}

TEST_F(HfTokenizerExport, TokenizerOptionIsCheckedBeforeAnythingIsWritten) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const std::string save = (dir / "ckpt").string();
  make_trainer(tiny_experiment(dir.path(), "save: " + save + "\n"), log)->train();
  // Mock data over a vocabulary of its own (50): the configured tokenizer never encoded it.
  const fs::path plain = dir / "plain";
  RunResult r = run_tessera("convert --from " + save + " --to-hf " + plain.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "no tokenizer files, generation_config.json or token ids: the "
                       "run trained on mock data over vocab_size 50"))
      << r.output;
  EXPECT_EQ(files_in(plain), (std::set<std::string>{"config.json", "model.safetensors"}));
  EXPECT_FALSE(read_json(plain / "config.json").contains("eos_token_id"));

  write_file(dir / "notes.txt", "not a tokenizer");
  const std::set<std::string> before = listing(dir.path());
  const std::string out = " --to-hf " + (dir / "hf").string();
  struct Case {
    std::string args, says;
  } cases[] = {
      {out + " --tokenizer gpt5",
       "key 'tokenizer' has value 'gpt5': expected a shipped name (llama2, llama3, llama3.1, "
       "qwen3) or an existing Hugging Face tokenizer.json"},
      {out + " --tokenizer=", "key 'tokenizer' has value '': expected a shipped name"},
      {out + " --tokenizer " + (dir / "notes.txt").string(),
       "key 'tokenizer' has value '" + (dir / "notes.txt").string() + "': expected a shipped name"},
      {out + " --tokenizer llama2",
       "key 'tokenizer' has value 'llama2': expected a tokenizer of this model: its ids run to "
       "31999, but the model's vocabulary has 50"},
      {" --to " + (dir / "w").string() + " --tokenizer llama3",
       "key 'tokenizer' has value 'llama3': expected --to-hf OUT_DIR with --tokenizer"},
  };
  for (const Case& c : cases) {
    r = run_tessera("convert --from " + save + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error: command line: " + c.says)) << c.args << "\n" << r.output;
    EXPECT_EQ(listing(dir.path()), before) << c.args;
  }
  // Loaded before the source is read: a missing checkpoint would give exit code 3.
  r = run_tessera("convert --from " + (dir / "nowhere").string() + out + " --tokenizer " +
                  (dir / "notes.txt").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

TEST(HfTokenizerFiles, AFailedWriteLeavesNoDirectory) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const ModelSpec spec = make_trainer(tiny_experiment(dir.path()), log)->spec();
  HfTokenizer tokenizer;
  tokenizer.name = "vanished";
  tokenizer.vocab = spec.vocab_size;
  tokenizer.eos_id = 0;
  tokenizer.tokenizer_json = (dir / "vanished.json").string();
  const fs::path out = dir / "hf";
  EXPECT_THROW(
      write_hf_model(out.string(), spec,
                     [](const ParamInfo& p) { return std::vector<float>(p.numel(), 0.5f); },
                     {DType::F32, 1ull << 30, tokenizer}),
      DataError);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(dir / "hf.tmp"));
}

}  // namespace
}  // namespace tessera::testing
