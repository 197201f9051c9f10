// `tessera report` and `tessera trace merge` as a user runs them: outputs, exit codes (2 for
// bad flags, 3 for bad traces) and messages.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::test_dir;
using testing::TraceBuilder;
namespace fs = std::filesystem;

struct CliRun {
  int code;
  std::string output;
};

// Runs the CLI in `cwd` and captures stdout + stderr.
CliRun tessera(const std::string& args, const fs::path& cwd) {
  const std::string log = (cwd / "cli.log").string();
  const std::string cmd =
      "cd '" + cwd.string() + "' && '" + TESSERA_BINARY + "' " + args + " > '" + log + "' 2>&1";
  int status = std::system(cmd.c_str());
  std::stringstream text;
  text << std::ifstream(log).rdbuf();
  return {WEXITSTATUS(status), text.str()};
}

std::string read(const fs::path& p) {
  std::stringstream s;
  s << std::ifstream(p).rdbuf();
  return s.str();
}

// Every path under `dir` but the CLI's own log: what a failed command must leave unchanged.
std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> paths;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().filename() != "cli.log") paths.insert(fs::relative(e.path(), dir).string());
  }
  return paths;
}

std::string sample_trace(const fs::path& dir, const std::string& name, double gemm_us) {
  TraceBuilder b(dir);
  b.member("deviceProperties", {{{"name", "NVIDIA H100 80GB HBM3"}}})
      .kernel("nvjet_a", 0, gemm_us, {{"M", 1024}, {"N", 1024}, {"K", 1024}, {"dtype", "bf16"}})
      .kernel("ncclDevKernel_AllReduce_Sum_bf16", 5, 20,
              {{"collective", "all_reduce"}, {"bytes", 1 << 20}, {"group_size", 8}}, 0, 20)
      .kernel("mystery_kernel", 40, 1);
  return b.write(name);
}

TEST(ReportCli, WritesEveryFormatToTheDefaultDirectory) {
  const auto dir = test_dir();
  sample_trace(dir, "step.pt.trace.json", 10);
  CliRun r = tessera("report step.pt.trace.json", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("parsed 3 events"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("matched no category rule"), std::string::npos) << r.output;
  const fs::path out = dir / "step_report";
  for (const char* f :
       {"report.xlsx", "summary.md", "summary.html", "gpu_timeline.csv", "categories.csv",
        "top_kernels.csv", "gemm.csv", "attention.csv", "bandwidth.csv", "collectives.csv",
        "short_kernels.csv", "unclassified.csv", "kernels.csv", "ops.csv", "ops_unique_args.csv"}) {
    EXPECT_TRUE(fs::exists(out / f)) << f;
  }
  EXPECT_EQ(read(out / "report.xlsx").substr(0, 2), "PK");  // a zip container
  const std::string html = read(out / "summary.html");
  EXPECT_EQ(html.find("http"), std::string::npos);  // self-contained
  EXPECT_EQ(html.find("<script"), std::string::npos);
  const std::string md = read(out / "summary.md");
  EXPECT_NE(md.find("## GPU timeline"), std::string::npos);
  EXPECT_NE(md.find("H100"), std::string::npos);  // detected from deviceProperties
  EXPECT_NE(read(out / "unclassified.csv").find("mystery_kernel"), std::string::npos);
  EXPECT_NE(read(out / "gemm.csv").find("compute"), std::string::npos);
}

TEST(ReportCli, FormatsAndOutputDirectory) {
  const auto dir = test_dir();
  sample_trace(dir, "t.json.gz.json", 10);
  CliRun r = tessera("report t.json.gz.json -o out --format csv,md --gpu=MI300X --top 1", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "summary.md"));
  EXPECT_FALSE(fs::exists(dir / "out" / "report.xlsx"));
  EXPECT_FALSE(fs::exists(dir / "out" / "summary.html"));
  EXPECT_NE(read(dir / "out" / "summary.md").find("MI300X"), std::string::npos);
  const std::string top = read(dir / "out" / "top_kernels.csv");
  EXPECT_EQ(std::count(top.begin(), top.end(), '\n'), 2);  // header + 1 row
}

TEST(ReportCli, CompareWritesDiffColumns) {
  const auto dir = test_dir();
  sample_trace(dir, "a.json", 10);
  sample_trace(dir, "b.json", 15);
  CliRun r = tessera("report --compare a.json b.json", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string csv = read(dir / "a_vs_b_report" / "categories.csv");
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "category,count_a,count_b,count_diff,count_pct,total_ms_a,total_ms_b,"
            "total_ms_diff,total_ms_pct,mean_us_a,mean_us_b,mean_us_diff,mean_us_pct,"
            "median_us_a,median_us_b,median_us_diff,median_us_pct,min_us_a,min_us_b,"
            "min_us_diff,min_us_pct,max_us_a,max_us_b,max_us_diff,max_us_pct,share_pct_a,"
            "share_pct_b,share_pct_diff,share_pct_pct");
  EXPECT_NE(csv.find("GEMM,1,1,0,0,0.01,0.015,0.005"), std::string::npos) << csv;
}

TEST(ReportCli, RanksAndMerge) {
  const auto dir = test_dir();
  fs::create_directories(dir / "run");
  sample_trace(dir / "run", "rank-0.json", 10);
  sample_trace(dir / "run", "rank-1.json", 12);
  CliRun r = tessera("report --ranks run", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "run_ranks_report" / "stragglers.csv"));
  EXPECT_TRUE(fs::exists(dir / "run_ranks_report" / "collective_skew.csv"));
  r = tessera("trace merge run -o merged.json.gz", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("merged 2 ranks"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "merged.json.gz"));
}

// The benchmark generator (scripts/analysis/make_big_trace.py) must keep writing traces the
// report reads completely: every kernel classified, shapes and collective sizes found.
TEST(ReportCli, BenchmarkGeneratorTraceIsFullyUnderstood) {
  const auto dir = test_dir();
  const std::string gen = std::string(TESSERA_TESTS_DIR) + "/../scripts/analysis/make_big_trace.py";
  const std::string cmd = std::string(TESSERA_PYTHON) + " '" + gen +
                          "' --size-gb 0.002 --layers 4 -o '" +
                          (dir / "big.pt.trace.json.gz").string() + "' > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  CliRun r = tessera("report big.pt.trace.json.gz -o out --format csv", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string unclassified = read(dir / "out" / "unclassified.csv");
  EXPECT_EQ(std::count(unclassified.begin(), unclassified.end(), '\n'), 1) << unclassified;
  const std::string categories = read(dir / "out" / "categories.csv");
  for (const char* c : {"GEMM", "attention_fwd", "attention_bwd", "normalization", "elementwise",
                        "optimizer", "communication", "memcpy"}) {
    EXPECT_NE(categories.find(std::string(c) + ","), std::string::npos) << c;
  }
  EXPECT_EQ(read(dir / "out" / "gemm.csv").find(",,,"), std::string::npos);  // every shape known
  EXPECT_NE(read(dir / "out" / "collectives.csv").find("all_reduce,bf16,50000000,8"),
            std::string::npos);
}

TEST(ReportCli, BadFlagsExitTwo) {
  const auto dir = test_dir();
  sample_trace(dir, "t.json", 10);
  for (const char* args :
       {"report", "report t.json --format pdf", "report t.json --top 0", "report t.json --gpu H300",
        "report t.json --bogus", "report t.json t.json", "report --compare t.json",
        "report --ranks . t.json", "report --ranks . --gpu H100",
        "report --ranks . --categories c.yaml", "report t.json --categories", "report t.json -o",
        "trace", "trace split t.json", "trace merge t.json", "trace merge t.json -o out.txt"}) {
    CliRun r = tessera(args, dir);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("error"), std::string::npos) << args << "\n" << r.output;
  }
  EXPECT_EQ(tessera("report --help", dir).code, 0);
}

TEST(ReportCli, BadTracesExitThreeNamingTheFile) {
  const auto dir = test_dir();
  testing::write_file(dir / "cut.json", R"({"traceEvents": [{"ph": "X", "name": "k")");
  testing::write_file(dir / "text.json", "not json at all");
  struct Case {
    const char* args;
    const char* file;
    const char* says;
  } cases[] = {
      {"report missing.json", "missing.json", "cannot open"},
      {"report cut.json", "cut.json", "truncated"},
      {"report text.json", "text.json", "expected '{' or '['"},
      {"report --ranks nowhere", "nowhere", "not a directory"},
      {"report .", ".", "is a directory"},
      {"trace merge missing.json -o m.json", "missing.json", "no such trace"},
  };
  for (const Case& c : cases) {
    CliRun r = tessera(c.args, dir);
    EXPECT_EQ(r.code, 3) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.file), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
  }
}

TEST(ReportCli, JsonThatIsNotATraceExitsThreeAndWritesNothing) {
  const auto dir = test_dir();
  testing::write_file(dir / "a.json", R"({"a": 1})");
  testing::write_file(dir / "metrics.jsonl",
                      "{\"iteration\": 1, \"lm_loss\": 9.5}\n"
                      "{\"iteration\": 2, \"lm_loss\": 9.1}\n");
  const std::set<std::string> before = listing(dir);
  struct Case {
    const char* args;
    const char* says;
  } cases[] = {
      {"report a.json",
       "a.json: not a Chrome/PyTorch profiler trace (a JSON object with a \"traceEvents\" "
       "array of events, or a JSON array of events): found a JSON object with members \"a\""},
      {"report metrics.jsonl -o out",
       "metrics.jsonl: not a Chrome/PyTorch profiler trace (a JSON object with a "
       "\"traceEvents\" array of events, or a JSON array of events): found a JSON object with "
       "members \"iteration\", \"lm_loss\" and more JSON objects after it (JSON Lines, e.g. "
       "metrics.jsonl)"},
      {"report --compare a.json a.json", "a.json: not a Chrome/PyTorch profiler trace"},
  };
  for (const Case& c : cases) {
    CliRun r = tessera(c.args, dir);
    EXPECT_EQ(r.code, 3) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("wrote"), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(listing(dir), before) << c.args;
  }
}

// A cut trace fails only once parsed: a bad option must be reported first, with exit 2.
TEST(ReportCli, OptionsAndOutputDirectoryAreCheckedBeforeAnyTraceIsRead) {
  const auto dir = test_dir();
  testing::write_file(dir / "cut.json", R"({"traceEvents": [{"ph": "X", "name": "k")");
  testing::write_file(dir / "notes.txt", "precious");
  fs::create_directories(dir / "run");
  testing::write_file(dir / "run" / "rank-0.json", R"({"traceEvents": [{"ph": "X")");
  const std::set<std::string> before = listing(dir);
  const std::string under_file =
      "key 'o' has value 'notes.txt/out': expected a directory that "
      "can be created and written (notes.txt is a regular file, not a "
      "directory)";
  struct Case {
    const char* args;
    std::string says;
  } cases[] = {
      {"report cut.json --gpu H300",
       "key 'gpu' has value 'H300': expected one of H100, H200, B200"},
      {"report --compare cut.json cut.json --gpu h300", "key 'gpu' has value 'h300'"},
      {"report cut.json -o notes.txt/out", under_file},
      {"report cut.json -o notes.txt",
       "key 'o' has value 'notes.txt': expected a directory that can be created and written "
       "(notes.txt is a regular file, not a directory)"},
      {"report --compare cut.json cut.json -o notes.txt/out", under_file},
      {"report --ranks run -o notes.txt/out", under_file},
  };
  for (const Case& c : cases) {
    CliRun r = tessera(c.args, dir);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("truncated"), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(listing(dir), before) << c.args;
  }
  EXPECT_EQ(read(dir / "notes.txt"), "precious");
  // Both traces are opened before either is parsed.
  sample_trace(dir, "a.json", 10);
  CliRun r = tessera("report --compare a.json missing.json", dir);
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("missing.json: cannot open trace"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("parsed"), std::string::npos) << r.output;
}

// Files appear only when the whole report is written: a failure leaves none, not even a part.
TEST(ReportCli, AFailedWriteLeavesNoPartOfTheReport) {
  const auto dir = test_dir();
  sample_trace(dir, "t.json", 10);
  fs::create_directories(dir / "out" / "summary.md.tmp");  // the markdown cannot be written
  CliRun r = tessera("report t.json -o out", dir);
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("summary.md.tmp: cannot write"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_empty(dir / "out")) << "left: " << testing::json(listing(dir / "out"));
}

// The console leads with the headline, before the list of files.
TEST(ReportCli, ConsoleHeadline) {
  const auto dir = test_dir();
  TraceBuilder b(dir);
  b.member("deviceProperties", {{{"name", "NVIDIA H100 80GB HBM3"}}})
      .step(1, 0, 500)
      .kernel("nvjet_a", 0, 10, {{"M", 1024}, {"N", 1024}, {"K", 1024}, {"dtype", "bf16"}})
      .cpu_op("fill", 10, 10, {{"External id", 1}, {"numel", 1 << 20}, {"dtype", "fp32"}})
      .kernel("fill_kernel", 10, 10, {{"External id", 1}});
  b.write("t.json");
  CliRun r = tessera("report t.json", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const double tflops = 2.0 * 1024 * 1024 * 1024 / 10e-6 / 1e12;
  const double bps = 4.0 * (1 << 20) / 10e-6;
  const std::string expected =
      "step time        0.500 ms (mean of 1 ProfilerStep# ranges)\n"
      "GPU busy         100.0% of 0.020 ms: computation 100.0%, exposed communication 0.0%, "
      "exposed memcpy 0.0%, idle 0.0%\n"
      "top categories   GEMM 50.0%, elementwise 50.0% of GPU time\n" +
      fmt::format(
          "GEMM             {:.1f} TFLOP/s, {:.1f}% of peak (1 calls, 0.010 ms; shapes "
          "for 100% of that time)\n",
          tflops, 100 * tflops / 989.4) +
      fmt::format(
          "bandwidth        {:.2f} TB/s, {:.1f}% of H100 HBM (1 calls, 0.010 ms of "
          "elementwise, reduction, normalization, optimizer and copy work; bytes for "
          "100% of that time)\n",
          bps / 1e12, 100 * bps / 3.35e12) +
      fmt::format(
          "worst bandwidth  fill {{\"dtype\": \"fp32\", \"numel\": 1048576}}: {:.0f} "
          "GB/s, {:.1f}% of HBM (1 calls, {:.3f} ms above the bandwidth floor)\n",
          bps / 1e9, 100 * bps / 3.35e12, 0.010 - 4.0 * (1 << 20) / 3.35e12 * 1e3) +
      "wrote 15 files to t_report/\n";
  const size_t at = r.output.find("step time");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.substr(at), expected);
  EXPECT_NE(read(dir / "t_report" / "summary.md").find("- **step time**: 0.500 ms"),
            std::string::npos);
  EXPECT_NE(read(dir / "t_report" / "summary.html").find("<li><b>GPU busy</b>: 100.0%"),
            std::string::npos);
  // --compare prints both headlines.
  r = tessera("report --compare t.json t.json -o cmp --format csv", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("A step time"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("B worst bandwidth"), std::string::npos) << r.output;
}

// The PyTorch path: a real torch.compile step, its headline and the two new sheets.
TEST(ReportCli, ConsoleHeadlineOfAPyTorchTrace) {
  const auto dir = test_dir();
  const std::string trace =
      std::string(TESSERA_TEST_DATA_DIR) + "/traces/torch_compiled_step.pt.trace.json.gz";
  CliRun r = tessera("report '" + trace + "' -o out --format csv", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* line :
       {"\nGPU busy         3.0% of 6.404 ms: computation 3.0%", "\ntop categories   GEMM 29.6%",
        "\nGEMM             33.9 TFLOP/s, 3.4% of peak (18 calls, 0.056 ms; shapes for 100%",
        "of H200 HBM (46 calls, 0.114 ms of elementwise", "\nworst bandwidth  triton_",
        "\n                 triton_", "\nwrote 12 files to out/"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  EXPECT_EQ(r.output.find("step time"), std::string::npos);  // no ProfilerStep# in this trace
}

TEST(ReportCli, CategoriesFile) {
  const auto dir = test_dir();
  sample_trace(dir, "t.json", 10);
  testing::write_file(dir / "cats.yaml", "rules:\n  - kernel: '^mystery'\n    category: other\n");
  CliRun r = tessera("report t.json --categories cats.yaml -o out --format csv", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("matched no category rule"), std::string::npos) << r.output;
  EXPECT_NE(read(dir / "out" / "kernels.csv")
                .find("mystery_kernel,other,1,0.001,1,1,1,1,3.22580645,,cats.yaml:2: kernel "
                      "matches '^mystery'"),
            std::string::npos)
      << read(dir / "out" / "kernels.csv");
  // A bad file fails with exit 2, naming the file and line, before the trace is read.
  testing::write_file(dir / "cut.json", R"({"traceEvents": [{"ph": "X", "name": "k")");
  testing::write_file(dir / "bad.json",
                      "{\"rules\": [\n  {\"kernel\": \"x\", \"category\": 7}\n]}");
  const std::set<std::string> before = listing(dir);
  r = tessera("report cut.json --categories bad.json", dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("error: bad.json:2: key 'rules[0].category' has value '7': expected one "
                          "of GEMM"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(listing(dir), before);
  r = tessera("report t.json --categories missing.yaml", dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("key 'categories' has value 'missing.yaml': expected a readable file"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace tessera::analysis
