// `tessera plot` end to end on two synthetic runs, and its HTML report opened in headless
// Chromium: the page loads without script errors, the charts are in the DOM and the
// screenshot is not blank.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "png_reader.h"

namespace tessera::viz {
namespace {

namespace fs = std::filesystem;
using testing::RunResult;
using testing::run_command;
using testing::run_tessera;

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string slurp(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Two runs as `tessera train` writes them; the first also holds a `tessera report` output.
class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tessera_plot_" + std::to_string(getpid()));
    fs::remove_all(root_);
    make_run("llama_a", "llama3.1_8B", 30, 1.0, true);
    make_run("qwen_b", "qwen2.5_7B", 20, 0.9, false);
    std::ofstream(root_ / "qwen_b" / "metrics.jsonl", std::ios::app) << "{\"iteration\": 21, \"lm_";
    const fs::path report = root_ / "llama_a" / "trace_report";
    fs::create_directories(report);
    std::ofstream(report / "gpu_timeline.csv") << "device,metric,time_ms,percent\n0,computation,"
                                                  "120.5,92.1\n0,idle,10.3,7.9\n";
    std::ofstream(report / "categories.csv")
        << "category,count,total_ms,share_pct\nGEMM,512,90.1,70.5\n\"attention, fwd+bwd\",64,"
           "30.2,23.6\n";
    out_ = root_ / "out";
  }
  void TearDown() override { fs::remove_all(root_); }

  void make_run(const std::string& name, const std::string& model, int iters, double speed,
                bool eval) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir / "logs" / "pre_trainer" / "rank-0");
    std::ofstream(dir / "config.yaml")
        << "# Effective configuration\nexp_name: \"" << name << "\"\nmodel: \"" << model
        << "\"\nseq_length: 8192\nmicro_batch_size: 1\nlr: 1e-05\n";
    std::ofstream(dir / "logs" / "pre_trainer" / "rank-0" / "info.log")
        << "[2026-11-22 03:12:52.390][rank-0][INFO] backend: NVIDIA H200 (sm_90, test)\n";
    std::ofstream m(dir / "metrics.jsonl");
    for (int i = 1; i <= iters; ++i) {
      m << "{\"iteration\":" << i << ",\"lm_loss\":" << 11.0 * std::exp(-i / 10.0) + 2
        << ",\"elapsed_ms\":" << 160 / speed + (i == 1 ? 500 : 0)
        << ",\"tokens_per_s_per_gpu\":" << 51000 * speed << ",\"tflops_per_gpu\":" << 508 * speed
        << ",\"mem_peak_gib\":38.4,\"mem_allocated_gib\":" << 32.1 + (i % 2) << "}\n";
      if (eval && i % 10 == 0)
        m << "{\"iteration\":" << i << ",\"eval_lm_loss\":" << 11.0 * std::exp(-i / 10.0) + 2.1
          << ",\"eval_ppl\":10}\n";
    }
  }

  fs::path root_, out_;
};

TEST_F(PlotTest, WritesChartsTablesAndASelfContainedReport) {
  const RunResult r = run_tessera("plot " + (root_ / "llama_a").string() + " " +
                       (root_ / "qwen_b").string() + " -o " + out_.string() + " --format svg,png");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped 1 metrics.jsonl line"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("plotted 2 run(s), 50 iteration records"), std::string::npos);
  for (const char* stem : {"loss", "iteration_time", "tokens_per_s", "memory"}) {
    EXPECT_TRUE(fs::exists(out_ / (std::string(stem) + ".svg"))) << stem;
    const auto png =
        test::decode_png(test::read_file((out_ / (std::string(stem) + ".png")).string()));
    EXPECT_EQ(png.width, 1600) << stem;
  }
  const std::string throughput = slurp(out_ / "throughput.csv");
  EXPECT_EQ(count(throughput, "\n"), 3u) << throughput;
  EXPECT_NE(throughput.find("llama_a,\"NVIDIA H200 (sm_90, test)\",30,30,160,"), std::string::npos)
      << throughput;  // the median leaves out the warm-up record
  const std::string config = slurp(out_ / "config.csv");
  EXPECT_NE(config.find("model,yes,llama3.1_8B,qwen2.5_7B"), std::string::npos) << config;
  EXPECT_NE(config.find("seq_length,,8192,8192"), std::string::npos) << config;

  const std::string html = slurp(out_ / "report.html");
  EXPECT_EQ(count(html, "<svg"), 4u);
  // loss: 2 runs + 1 validation; time and tokens/s: 2 each; memory: peak + allocated per run.
  EXPECT_EQ(count(html, "class=\"series\""), 3u + 2 + 2 + 4);
  EXPECT_NE(html.find("attention, fwd+bwd"), std::string::npos);  // trace report table
  EXPECT_NE(html.find("No trace report in"), std::string::npos);  // qwen_b has none
  // Self-contained: nothing fetched from anywhere.
  for (const char* ref : {"src=", "href=", "<script", "<link", "url("})
    EXPECT_EQ(html.find(ref), std::string::npos) << ref;
}

// A workspace ({workspace}/{work_group}/{user_name}/{exp_name}) names every run below it, but
// not a run's previous_runs/ (earlier runs of the same experiment) or hidden directories; -o
// defaults to plots/ in the working directory.
TEST_F(PlotTest, AWorkspaceFindsItsRunsAndOutputDefaultsToPlots) {
  const fs::path ws = root_ / "ws";
  for (const char* exp : {"llama_a", "qwen_b"}) {
    fs::create_directories(ws / "team" / "me");
    fs::rename(root_ / exp, ws / "team" / "me" / exp);
  }
  fs::create_directories(ws / "team" / "me" / "llama_a" / "previous_runs");
  fs::copy(ws / "team" / "me" / "qwen_b", ws / "team" / "me" / "llama_a" / "previous_runs" / "old",
           fs::copy_options::recursive);
  fs::create_directories(ws / ".cache" / "hidden_run");
  fs::copy_file(ws / "team" / "me" / "qwen_b" / "metrics.jsonl",
                ws / ".cache" / "hidden_run" / "metrics.jsonl");
  fs::create_directories(ws / "other" / "me" / "crashed" / "logs");  // a run without metrics
  const fs::path cwd = root_ / "cwd";
  fs::create_directories(cwd);

  RunResult r =
      run_command("cd " + cwd.string() + " && " + TESSERA_BINARY + " plot " + ws.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(ws.string() + ": 2 run(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("plotted 2 run(s), 50 iteration records"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(cwd / "plots" / "report.html"));
  const std::string throughput = slurp(cwd / "plots" / "throughput.csv");
  EXPECT_EQ(count(throughput, "\n"), 3u) << throughput;
  EXPECT_NE(throughput.find("llama_a,"), std::string::npos) << throughput;
  EXPECT_NE(throughput.find("qwen_b,"), std::string::npos) << throughput;

  // A workspace and a run inside it, and a run directory alone, as before.
  r = run_tessera("plot " + ws.string() + " " + (ws / "team" / "me" / "qwen_b").string() + " -o " +
                  out_.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("plotted 2 run(s)"), std::string::npos) << r.output;
  r = run_tessera("plot " + (ws / "team" / "me" / "llama_a" / "previous_runs" / "old").string() +
                  " -o " + out_.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("plotted 1 run(s), 20 iteration records"), std::string::npos) << r.output;
}

TEST_F(PlotTest, BadInputsAreNamedBeforeAnythingIsWritten) {
  const fs::path empty = root_ / "empty";
  fs::create_directories(empty / "team" / "me");
  RunResult r = run_tessera("plot " + empty.string() + " -o " + out_.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;  // neither a run nor a workspace with runs
  EXPECT_NE(r.output.find("key 'RUN_DIR' has value '" + empty.string() + "'"), std::string::npos)
      << r.output;
  r = run_tessera("plot " + (root_ / "no_such_dir").string() + " -o " + out_.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_tessera("plot " + (root_ / "llama_a").string() + " -o " + out_.string() +
                  " --format gif");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::ofstream(root_ / "file.txt") << "x";
  r = run_tessera("plot " + (root_ / "llama_a").string() + " -o " + (root_ / "file.txt").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;  // an output that cannot be a directory
  EXPECT_NE(r.output.find("key 'output'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out_));
}

// Debian's chromium, as scripts/setup.sh installs it for the test suite.
TEST_F(PlotTest, ReportRendersInHeadlessChromium) {
  const RunResult which = run_command("command -v chromium");
  ASSERT_EQ(which.exit_code, 0)
      << "chromium is not installed: run scripts/test.sh (or scripts/setup.sh --test), which "
         "installs Debian's chromium for this test";
  ASSERT_EQ(run_tessera("plot " + (root_ / "llama_a").string() + " " +
                (root_ / "qwen_b").string() + " -o " + out_.string())
                .exit_code,
            0);
  const fs::path profile = root_ / "chromium-profile", shot = root_ / "shot.png";
  const std::string chromium =
      "timeout 180 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
      "--disable-background-networking --disable-component-update --disable-sync "
      "--enable-logging=stderr --v=0 --user-data-dir=" +
      profile.string() + " --window-size=1200,900 ";
  const std::string url = "file://" + fs::absolute(out_ / "report.html").string();

  const RunResult dom = run_command(chromium + "--dump-dom " + url);
  ASSERT_EQ(dom.exit_code, 0) << dom.output;
  EXPECT_EQ(dom.output.find("Uncaught"), std::string::npos) << dom.output;
  EXPECT_EQ(dom.output.find(":CONSOLE"), std::string::npos) << dom.output;
  EXPECT_EQ(count(dom.output, "<svg"), 4u);
  EXPECT_EQ(count(dom.output, "class=\"series\""), 11u);
  for (const char* id : {"chart-loss", "chart-iteration_time", "chart-tokens_per_s", "chart-memory",
                         "table-throughput"})
    EXPECT_NE(dom.output.find(id), std::string::npos) << id;

  const RunResult s = run_command(chromium + "--screenshot=" + shot.string() + " " + url);
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const test::DecodedPng png = test::decode_png(test::read_file(shot.string()));
  ASSERT_EQ(png.width, 1200);
  // Not blank: the luminance varies and a good share of pixels is not background.
  double sum = 0, sum_sq = 0;
  size_t inked = 0, blue = 0;
  const size_t n = static_cast<size_t>(png.width) * png.height;
  for (int y = 0; y < png.height; ++y)
    for (int x = 0; x < png.width; ++x) {
      const double l = 0.299 * png.r(x, y) + 0.587 * png.g(x, y) + 0.114 * png.b(x, y);
      sum += l, sum_sq += l * l;
      inked += l < 200;
      blue += png.b(x, y) > 150 && png.r(x, y) < 60;  // the first run's curve colour
    }
  const double mean = sum / n, variance = sum_sq / n - mean * mean;
  EXPECT_GT(variance, 100.0);
  EXPECT_GT(inked, n / 100);
  EXPECT_GT(blue, 50u);
}

}  // namespace
}  // namespace tessera::viz
