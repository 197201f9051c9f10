// TensorBoard event files: the CRC-32C against published test vectors, the writer's files
// against an independent reader (tests/obs/read_tfevents.py: its own CRC and protocol buffer
// decoder, strict about every field), and a training run's every scalar against the same
// run's metrics.jsonl. Last, the keys' mistakes: exit 2 naming the key, before any work.
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "common/tiny_run.h"
#include "tessera/obs/tensorboard.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::metrics_lines;
using testing::ScratchDir;

std::string bytes(std::initializer_list<int> values) {
  std::string s;
  for (int v : values) s += static_cast<char>(v);
  return s;
}

// RFC 3720 (iSCSI) appendix B.4, the usual CRC-32C vectors (also leveldb's crc32c_test), and
// the check value of the CRC catalogue ("123456789").
TEST(Crc32c, PublishedTestVectors) {
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i)
    ascending += static_cast<char>(i), descending += static_cast<char>(31 - i);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  const std::string iscsi_read_pdu =
      bytes({0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
             0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
             0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
             0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  EXPECT_EQ(crc32c(iscsi_read_pdu), 0xD9963A56u);
}

// TensorFlow's mask: rotate right by 15, add 0xa282ead8 (mod 2^32).
TEST(Crc32c, MaskedAsTfRecordStoresIt) {
  EXPECT_EQ(masked_crc32c(""), 0xA282EAD8u);
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);  // rotr(0xE3069283, 15) + 0xa282ead8
}

nlohmann::json read_events(const fs::path& file, int expected_exit = 0) {
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                                      "/obs/read_tfevents.py " + file.string());
  EXPECT_EQ(r.exit_code, expected_exit) << r.output;
  if (expected_exit != 0) return r.output;
  return nlohmann::json::parse(r.output)["events"];
}

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

// TensorFlow's name: events.out.tfevents.<10-digit seconds>.<host>.<pid>.<n>.
void expect_event_file_name(const fs::path& file) {
  static const std::regex kName(R"(events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+)");
  EXPECT_TRUE(std::regex_match(file.filename().string(), kName)) << file;
}

TEST(EventFileWriter, RecordsReadByAnIndependentReader) {
  ScratchDir dir;
  const double before = static_cast<double>(std::time(nullptr));
  std::string path;
  {
    EventFileWriter w((dir / "new" / "tb").string());  // made if missing
    w.add_scalar("lm loss", 2.5, 1);
    w.add_scalar("a tag/with slashes", -1e-7, 0);
    w.add_scalar("big step", 123456.789, int64_t{1} << 40);
    w.add_scalar("ünïcode", 3.0, 300);  // a multi-byte varint step and UTF-8 tag
    w.flush();
    path = w.path();
  }
  expect_event_file_name(path);
  EXPECT_EQ(fs::path(path).parent_path(), dir / "new" / "tb");

  const nlohmann::json events = read_events(path);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0]["file_version"], "brain.Event:2");
  EXPECT_FALSE(events[0].contains("scalars"));
  for (const auto& e : events) {
    EXPECT_GE(e["wall_time"].get<double>(), before - 1);
    EXPECT_LE(e["wall_time"].get<double>(), before + 120);
  }
  const std::vector<std::tuple<std::string, float, int64_t>> expected = {
      {"lm loss", 2.5f, 1},
      {"a tag/with slashes", -1e-7f, 0},
      {"big step", 123456.789f, int64_t{1} << 40},
      {"ünïcode", 3.0f, 300}};
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& e = events[i + 1];
    const auto& [tag, value, step] = expected[i];
    EXPECT_EQ(e["step"].get<int64_t>(), step);
    ASSERT_EQ(e["scalars"].size(), 1u);
    EXPECT_EQ(e["scalars"][0][0].get<std::string>(), tag);
    EXPECT_EQ(e["scalars"][0][1].get<double>(), static_cast<double>(value)) << tag;
  }
}

// The reader checks what it claims to: a flipped bit in a record's data or a cut-off file
// fails it.
TEST(EventFileWriter, TheReaderRejectsCorruptAndTruncatedFiles) {
  ScratchDir dir;
  std::string path;
  {
    EventFileWriter w(dir.path().string());
    w.add_scalar("lm loss", 2.5, 1);
    path = w.path();
  }
  std::string data;
  {
    std::ifstream in(path, std::ios::binary);
    data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::string flipped = data;
  flipped[flipped.size() - 8] ^= 0x01;  // inside the last record's data
  std::ofstream(dir / "flipped", std::ios::binary) << flipped;
  EXPECT_NE(read_events(dir / "flipped", 1).get<std::string>().find("data CRC mismatch"),
            std::string::npos);
  std::ofstream(dir / "cut", std::ios::binary) << data.substr(0, data.size() - 3);
  EXPECT_NE(read_events(dir / "cut", 1).get<std::string>().find("truncated"), std::string::npos);
}

// A tiny CPU run of 2 ranks (threads), ~10 ms per iteration.
std::string tiny_run(const fs::path& workspace) {
  return "train --device cpu --nproc_per_node 2 --model tiny_llama --mock_data true "
         "--num_layers 2 --hidden_size 32 --ffn_hidden_size 48 --vocab_size 64 --seq_length 16 "
         "--micro_batch_size 2 --global_batch_size 4 --lr_warmup_iters 1 --log_progress false "
         "--workspace " +
         workspace.string() + " --work_group g --user_name u --exp_name e";
}

// Every scalar of a run: the TensorBoard file holds exactly Megatron's tags at the steps
// Megatron writes them, with this run's values (float32 of what metrics.jsonl records).
TEST(TrainingTensorBoard, EveryScalarOfARunMatchesItsMetrics) {
  ScratchDir dir;
  const testing::RunResult r = testing::run_tessera(
      tiny_run(dir.path()) +
      " --train_iters 6 --log_interval 1 --eval_interval 3 --eval_iters 2 --tensorboard_dir tb "
      "--log_timers_to_tensorboard --log_throughput_to_tensorboard --log_memory_to_tensorboard "
      "--log_validation_ppl_to_tensorboard");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path root = dir / "g" / "u" / "e";
  // A relative tensorboard_dir lies under the experiment directory; only rank 0 writes.
  const std::vector<fs::path> files = files_in(root / "tb");
  ASSERT_EQ(files.size(), 1u);
  expect_event_file_name(files[0]);
  EXPECT_NE(r.output.find("tensorboard: " + files[0].string()), std::string::npos) << r.output;

  const nlohmann::json events = read_events(files[0]);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0]["file_version"], "brain.Event:2");
  std::map<std::pair<std::string, int64_t>, double> tb;  // (tag, step) -> value
  for (size_t i = 1; i < events.size(); ++i) {
    ASSERT_EQ(events[i]["scalars"].size(), 1u);
    const auto key = std::make_pair(events[i]["scalars"][0][0].get<std::string>(),
                                    events[i]["step"].get<int64_t>());
    EXPECT_FALSE(tb.count(key)) << key.first << " twice at step " << key.second;
    tb[key] = events[i]["scalars"][0][1].get<double>();
  }

  std::map<std::pair<std::string, int64_t>, double> expected;
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  int64_t iterations = 0, evaluations = 0;
  for (const nlohmann::json& m : metrics_lines(root / "metrics.jsonl")) {
    const int64_t it = m["iteration"];
    const int64_t samples = it * 4;
    if (m.contains("eval_lm_loss")) {
      ++evaluations;
      for (const auto& [tag, value] :
           {std::pair<std::string, double>{"lm loss validation", m["eval_lm_loss"]},
            {"lm loss validation ppl", m["eval_ppl"]}}) {
        expected[{tag, it}] = f32(value);
        expected[{tag + " vs samples", samples}] = f32(value);
      }
      continue;
    }
    ++iterations;
    ASSERT_EQ(m["consumed_samples"].get<int64_t>(), samples);
    for (const auto& [tag, value] :
         {std::pair<std::string, double>{"learning-rate", m["lr"]},
          {"batch-size", 4.0},
          {"lm loss", m["lm_loss"]},  // log_interval 1: the iteration's own loss
          {"grad-norm", m["grad_norm"]}}) {
      expected[{tag, it}] = f32(value);
      expected[{tag + " vs samples", samples}] = f32(value);
    }
    const double ms = m["elapsed_ms"], tflops = m["tflops_per_gpu"];
    if (it > 1) expected[{"iteration-time", it}] = f32(ms / 1e3);  // not the first alone
    expected[{"throughput", it}] = f32(tflops);
    expected[{"throughput/tflops/device", it}] = f32(tflops);
    expected[{"throughput/tflops", it}] = f32(tflops * 2);
    expected[{"throughput/tokens_per_sec/device", it}] = f32(m["tokens_per_s_per_gpu"]);
    expected[{"throughput/tokens_per_sec", it}] = f32(m["tokens_per_s"]);
    // metrics.jsonl has GiB; compared below within float32 rounding.
    expected[{"mem-allocated-bytes", it}] = m["mem_allocated_gib"].get<double>() * (1 << 30);
    expected[{"mem-max-allocated-bytes", it}] = m["mem_peak_gib"].get<double>() * (1 << 30);
  }
  EXPECT_EQ(iterations, 6);
  EXPECT_EQ(evaluations, 2);  // iterations 3 and 6

  std::set<std::pair<std::string, int64_t>> written, wanted;
  for (const auto& [key, value] : tb) written.insert(key);
  for (const auto& [key, value] : expected) wanted.insert(key);
  EXPECT_EQ(written, wanted);
  for (const auto& [key, value] : expected) {
    if (!tb.count(key)) continue;
    const double got = tb.at(key);
    if (key.first.starts_with("mem-"))
      EXPECT_NEAR(got, value, 1e-6 * value + 1) << key.first << " at " << key.second;
    else
      EXPECT_EQ(got, value) << key.first << " at " << key.second;
  }
  EXPECT_GT(tb.at({"mem-max-allocated-bytes", 6}), 0);
}

// Packed chat data: the positions the loss counted, and the real tokens/s and packing
// efficiency of each interval, equal to metrics.jsonl's.
TEST(TrainingTensorBoard, LossTokensAndPackingMatchTheirMetrics) {
  ScratchDir dir;
  {
    std::ofstream out(dir / "chat.jsonl");
    for (int i = 0; i < 30; ++i)
      out << nlohmann::json{{"messages",
                             {{{"role", "user"}, {"content", "Count to " + std::to_string(i % 7 + 1)}},
                              {{"role", "assistant"}, {"content", std::string(i % 7 + 1, 'x')}}}}}
                 .dump()
          << "\n";
  }
  testing::RunResult r = testing::run_tessera("preprocess --chat --input " + (dir / "chat.jsonl").string() +
                                              " --output-prefix " + (dir / "c").string() +
                                              " --tokenizer-model llama3.1 --workers 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_tessera(
      "train --device cpu --model tiny_llama --num_layers 1 --hidden_size 16 --ffn_hidden_size 32 "
      "--num_attention_heads 2 --num_query_groups 1 --tokenizer_model llama3.1 --seq_length 64 "
      "--micro_batch_size 2 --global_batch_size 2 --train_iters 3 --lr_warmup_iters 0 "
      "--log_interval 1 --log_progress false --train_data_path null --split 100,0,0 --data_path " +
      (dir / "c_chat_document").string() +
      " --packing_strategy bfd --tensorboard_dir tb --log_throughput_to_tensorboard --workspace " +
      dir.path().string() + " --work_group g --user_name u --exp_name e");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path root = dir / "g" / "u" / "e";
  const std::vector<fs::path> files = files_in(root / "tb");
  ASSERT_EQ(files.size(), 1u);
  std::map<std::pair<std::string, int64_t>, double> tb;
  const nlohmann::json events = read_events(files[0]);
  for (size_t i = 1; i < events.size(); ++i)
    tb[{events[i]["scalars"][0][0].get<std::string>(), events[i]["step"].get<int64_t>()}] =
        events[i]["scalars"][0][1].get<double>();
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  int lines = 0;
  for (const nlohmann::json& m : metrics_lines(root / "metrics.jsonl")) {
    if (!m.contains("lm_loss")) continue;
    ++lines;
    const int64_t it = m["iteration"];
    EXPECT_EQ(tb.at({"loss-tokens", it}), f32(m["loss_tokens"])) << it;
    EXPECT_EQ(tb.at({"packing-efficiency", it}), f32(m["packing_efficiency"])) << it;
    EXPECT_EQ(tb.at({"throughput/real_tokens_per_sec/device", it}), f32(m["real_tokens_per_s_per_gpu"])) << it;
    EXPECT_GT(m["packing_efficiency"].get<double>(), 0.0);
    EXPECT_LT(m["loss_tokens"].get<int64_t>(), 2 * 64);
  }
  EXPECT_EQ(lines, 3);
}

// Megatron's defaults: learning rate on; timers, throughput, memory and perplexity off; the
// per-iteration values every tensorboard_log_interval, whatever log_interval is.
TEST(TrainingTensorBoard, DefaultTagsEveryTensorboardLogInterval) {
  ScratchDir dir;
  const fs::path tb = dir / "absolute_tb";
  const testing::RunResult r =
      testing::run_tessera(tiny_run(dir.path()) +
                           " --train_iters 6 --log_interval 3 --eval_interval 0 "
                           "--tensorboard_log_interval 2 --tensorboard_dir " +
                           tb.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<fs::path> files = files_in(tb);
  ASSERT_EQ(files.size(), 1u);
  std::set<std::pair<std::string, int64_t>> written;
  for (const auto& e : read_events(files[0]))
    if (e.contains("scalars"))
      written.insert({e["scalars"][0][0].get<std::string>(), e["step"].get<int64_t>()});
  std::set<std::pair<std::string, int64_t>> wanted;
  for (int64_t it : {2, 4, 6})
    for (const char* tag : {"learning-rate", "batch-size", "lm loss", "grad-norm"}) {
      wanted.insert({tag, it});
      wanted.insert({std::string(tag) + " vs samples", it * 4});
    }
  EXPECT_EQ(written, wanted);
}

TEST(TrainingTensorBoard, BadKeysExit2NamingTheKeyBeforeAnyWork) {
  ScratchDir dir;
  testing::RunResult r =
      testing::run_tessera(tiny_run(dir.path()) + " --tensorboard_log_interval 0");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'tensorboard_log_interval'"), std::string::npos) << r.output;

  const fs::path file = dir / "a_file";
  std::ofstream(file) << "x";
  r = testing::run_tessera(tiny_run(dir.path()) + " --tensorboard_dir " + (file / "tb").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'tensorboard_dir'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(file.string() + " is a regular file, not a directory"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "g")) << "the experiment directory was made";

  // A relative directory is checked where it will be: under the experiment directory.
  fs::create_directories(dir / "g" / "u" / "e");
  std::ofstream(dir / "g" / "u" / "e" / "tb") << "x";
  r = testing::run_tessera(tiny_run(dir.path()) + " --tensorboard_dir tb/run1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find((dir / "g" / "u" / "e" / "tb").string() + " is a regular file"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace tessera
