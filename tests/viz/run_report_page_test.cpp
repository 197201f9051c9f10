// The run report as a reader sees it, laid out by headless Chromium: tables fit the window,
// CPU runs are not labelled as GPU runs, iteration ticks are whole numbers, and what is empty
// says why. Each test keeps its pages and screenshots in its scratch directory when it fails.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "chromium_page.h"
#include "common/run_command.h"

namespace tessera::viz {
namespace {

namespace fs = std::filesystem;
using testing::run_command;
using testing::run_tessera;

struct RunFiles {
  std::string device;  // the backend line of rank 0's info.log; no log when empty
  std::string config;  // config.yaml; none when empty
  int iterations = 30;
  int eval_every = 0;  // 0: no evaluation records
};

class RunReportPage : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(run_command("command -v chromium").exit_code, 0)
        << "chromium is not installed: run scripts/test.sh (or scripts/setup.sh --test)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    scratch_ = fs::temp_directory_path() /
               ("tessera_report_page_" + std::to_string(getpid()) + "_" + info->name());
    fs::remove_all(scratch_);
    fs::create_directories(scratch_);
  }
  void TearDown() override {
    if (HasFailure())
      std::cerr << "pages and screenshots kept in " << scratch_.string() << "\n";
    else
      fs::remove_all(scratch_);
  }

  fs::path write_run(const std::string& name, const RunFiles& f) {
    const fs::path dir = scratch_ / name;
    fs::create_directories(dir);
    if (!f.device.empty()) {
      fs::create_directories(dir / "logs" / "pre_trainer" / "rank-0");
      std::ofstream(dir / "logs" / "pre_trainer" / "rank-0" / "info.log")
          << "[2026-11-22 03:12:52.390][rank-0][INFO] backend: " << f.device << "\n";
    }
    if (!f.config.empty()) std::ofstream(dir / "config.yaml") << f.config;
    std::ofstream m(dir / "metrics.jsonl");
    for (int i = 1; i <= f.iterations; ++i) {
      m << "{\"iteration\":" << i << ",\"lm_loss\":" << 11.0 * std::exp(-i / 10.0) + 2
        << ",\"elapsed_ms\":" << 160 + (i == 1 ? 500 : 0)
        << ",\"tokens_per_s_per_gpu\":51000,\"tflops_per_gpu\":508,\"mem_peak_gib\":38.4,"
           "\"mem_allocated_gib\":"
        << 32.1 + (i % 2) << "}\n";
      if (f.eval_every > 0 && i % f.eval_every == 0)
        m << "{\"iteration\":" << i << ",\"eval_lm_loss\":" << 11.0 * std::exp(-i / 10.0) + 2.1
          << "}\n";
    }
    return dir;
  }

  // `tessera plot` of `runs` into scratch/<out>; returns the page.
  fs::path plot(const std::vector<fs::path>& runs, const std::string& out) {
    std::string args = "plot";
    for (const fs::path& r : runs) args += " " + r.string();
    const testing::RunResult r = run_tessera(args + " -o " + (scratch_ / out).string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return scratch_ / out / "report.html";
  }

  test::ProbedPage open(const fs::path& page, const std::string& probe, int width = 1400,
                        int height = 2000) {
    return test::probe_page(page, probe, width, height,
                            page.parent_path() / (page.parent_path().filename().string() + ".png"));
  }

  fs::path scratch_;
};

std::string slurp(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

constexpr const char* kH200 =
    "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, driver 13.0, runtime 13.0, cuBLASLt 13.1.0, "
    "attention: cuDNN 9.10.2 (auto))";

// A table's name in failure messages: its id, else the nearest heading above it.
const std::string kTableName = R"(
  const tableName = t => {
    let e = t;
    while (e && !/^H[2-4]$/.test(e.tagName)) e = e.previousElementSibling || e.parentElement;
    return t.id || (e ? e.textContent : '?');
  };
)";

// Every table with its width against the window's, every <details> opened first; the cells
// that show part of their text, with their tooltips.
const std::string kTableWidths = kTableName + R"(
  for (const d of document.querySelectorAll('details')) d.open = true;
  const tables = [...document.querySelectorAll('table')].map(t => (
      {name: tableName(t), scroll: t.scrollWidth, client: t.clientWidth,
       right: t.getBoundingClientRect().right}));
  return {viewport: document.documentElement.clientWidth,
          page: document.documentElement.scrollWidth, tables: tables,
          cut: [...document.querySelectorAll('td[title]')].map(
              td => ({shown: td.textContent, title: td.title}))};
)";

TEST_F(RunReportPage, SingleRunTablesFitA1400PxWindow) {
  const std::string name =
      "llama3.1_8B_bf16_fsdp8_seq8192_mbs1_gbs128_full_recompute_cosine_lr3e-4_warmup2000_run42";
  const std::string data_path =
      "/lustre/fsw/portfolios/llm/projects/pretraining/datasets/dclm_baseline_1.0_tokenized_"
      "llama3_128k_vocab/global-shard_01_of_10/local-shard_0_of_10/shard_00000000_processed_"
      "text_document";
  const fs::path run =
      write_run(name, {kH200,
                       "exp_name: \"" + name + "\"\nmodel: \"llama3.1_8B\"\nnum_layers: 32\n" +
                           "train_data_path: \"" + data_path + "\"\ntokenizer_model: \"" +
                           data_path + "/tokenizer.json\"\nadam_betas: [0.9, 0.95]\n" +
                           "profile_ranks: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]\n",
                       30, 10});
  const fs::path report = run / "trace_report";
  fs::create_directories(report);
  std::ofstream(report / "gpu_timeline.csv")
      << "device,type,time_ms,percent\n0,computation,120.5,92.1\n0,idle,10.3,7.9\n";
  std::string kernel =
      "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple";
  while (kernel.size() < 300) kernel += "<int,int,int,int>,cutlass::gemm::collective::Collective";
  std::ofstream(report / "top_kernels.csv")
      << "name,category,count,total_ms,mean_us,median_us,min_us,max_us,share_pct,op,rule\n\""
      << kernel << "\",GEMM,512,90.1,176.0,175.2,170.1,190.3,70.5,"
      << "aten::_scaled_dot_product_cudnn_attention_backward_with_a_long_name,cuBLAS/CUTLASS\n";
  std::ofstream(report / "gemm.csv")
      << "op,M,N,K,batch,dtype,count,total_ms,mean_us,gflop,mbytes,flops_per_byte,tflops,"
         "peak_tflops,peak_pct,ridge_flops_per_byte,bound,roofline_pct\n"
         "tessera::linear_forward_output_projection_with_residual,8192,4096,14336,1,bf16,"
         "128,45.25,353.5,962.07,318.77,3018.1,721.8,989.4,72.95,295.2,compute,72.95\n";
  std::ofstream(report / "attention.csv")
      << "pass,B,H,KV,T,S,D,causal,window,dtype,op,count,total_ms,mean_us,gflop,tflops,"
         "peak_tflops,peak_pct\nforward,1,32,8,8192,8192,128,true,0,bf16,"
         "aten::_scaled_dot_product_cudnn_attention,32,12.5,390.6,274.9,703.8,989.4,71.1\n";

  const fs::path page = plot({run}, "out");
  const test::ProbedPage p = open(page, kTableWidths);
  ASSERT_TRUE(p.probe.is_object()) << p.output;
  const int viewport = p.probe["viewport"].get<int>();
  EXPECT_GE(viewport, 1380);  // at most a scrollbar narrower than the window
  EXPECT_LE(p.probe["page"].get<int>(), viewport) << p.probe.dump(1);
  ASSERT_GE(p.probe["tables"].size(), 7u) << p.probe.dump(1);
  for (const auto& t : p.probe["tables"]) {
    const std::string what = t["name"].get<std::string>();
    EXPECT_LE(t["scroll"].get<int>(), t["client"].get<int>()) << what << " scrolls sideways";
    EXPECT_LE(t["right"].get<double>(), viewport) << what << " ends past the window";
  }
  // The kernel name is cut in its cell, whole in the cell's tooltip.
  ASSERT_EQ(p.probe["cut"].size(), 1u) << p.probe["cut"].dump(1);
  EXPECT_EQ(p.probe["cut"][0]["title"].get<std::string>(), kernel);
  const std::string shown = p.probe["cut"][0]["shown"].get<std::string>();
  EXPECT_LT(shown.size(), kernel.size() / 2);
  EXPECT_EQ(kernel.rfind(shown.substr(0, shown.size() - std::string("\u2026").size()), 0), 0u)
      << shown;
}

// Headings, labels and tooltips of every chart and table.
constexpr const char* kPageText = "return document.body.textContent;";

// The page's text, without the scratch directory (runs are named by their paths, which say
// nothing about devices).
std::string page_text(const test::ProbedPage& p, const fs::path& scratch) {
  if (!p.probe.is_string()) {
    ADD_FAILURE() << "no page text:\n" << p.output;
    return "";
  }
  std::string text = p.probe.get<std::string>();
  const std::string dir = scratch.string();
  for (size_t at = text.find(dir); at != std::string::npos; at = text.find(dir, at))
    text.erase(at, dir.size());
  return text;
}

TEST_F(RunReportPage, CpuRunsNameTheirDevice) {
  const fs::path cpu =
      write_run("cpu_run", {"cpu (OpenBLAS, 16 threads)", "exp_name: cpu_run\ndevice: cpu\n"});
  const fs::path cpu_no_log = write_run("cpu_no_log", {"", "exp_name: cpu_no_log\ndevice: cpu\n"});
  const fs::path gpu = write_run("gpu_run", {kH200, "exp_name: gpu_run\ndevice: auto\n"});
  const std::vector<std::string> gpu_words = {"GPU memory", "per GPU", "TFLOP/s/GPU", "_per_gpu"};

  const std::string cpu_text = page_text(open(plot({cpu}, "cpu"), kPageText), scratch_);
  for (const std::string& w : gpu_words)
    EXPECT_EQ(cpu_text.find(w), std::string::npos) << w << " in a CPU run's page";
  EXPECT_NE(cpu_text.find("Memory (host)"), std::string::npos);
  EXPECT_NE(cpu_text.find("tokens/s per rank"), std::string::npos);
  EXPECT_NE(cpu_text.find("tflops_per_rank"), std::string::npos);
  EXPECT_EQ(slurp(scratch_ / "cpu" / "throughput.csv").find("_per_gpu"), std::string::npos);
  EXPECT_EQ(slurp(scratch_ / "cpu" / "memory.svg").find("GPU"), std::string::npos);

  // Runs of both kinds: the words hold for each. Without a log, config.yaml names the device.
  const std::string mixed = page_text(open(plot({cpu_no_log, gpu}, "mixed"), kPageText), scratch_);
  for (const std::string& w : gpu_words)
    EXPECT_EQ(mixed.find(w), std::string::npos) << w << " where one run is on the CPU";
  EXPECT_NE(mixed.find("Memory (GPU; host for CPU runs)"), std::string::npos);
  EXPECT_NE(mixed.find("tokens/s per rank"), std::string::npos);
  EXPECT_NE(mixed.find("cpu (config.yaml)"), std::string::npos);
  EXPECT_NE(slurp(scratch_ / "mixed" / "throughput.csv").find("tokens_per_s_per_rank"),
            std::string::npos);

  const std::string gpu_text = page_text(open(plot({gpu}, "gpu"), kPageText), scratch_);
  EXPECT_NE(gpu_text.find("GPU memory"), std::string::npos);
  EXPECT_NE(gpu_text.find("tokens/s per GPU"), std::string::npos);
  EXPECT_NE(gpu_text.find("tflops_per_gpu"), std::string::npos);
  EXPECT_EQ(gpu_text.find("host"), std::string::npos);
  EXPECT_EQ(gpu_text.find("per rank"), std::string::npos);
}

// Each chart's x tick labels (centred under the axis; y ticks are right-aligned).
constexpr const char* kXTicks = R"(
  const out = {};
  for (const f of document.querySelectorAll('figure'))
    out[f.id] = [...f.querySelectorAll('g.ticks text[text-anchor="middle"]')]
                    .map(t => t.textContent);
  return out;
)";

TEST_F(RunReportPage, IterationTicksAreWholeNumbers) {
  const std::regex whole("-?[0-9]+[kM]?");
  for (const int iterations : {3, 1, 5}) {
    const fs::path run = write_run("short_" + std::to_string(iterations),
                                   {kH200, "exp_name: short\n", iterations, 0});
    const test::ProbedPage p = open(plot({run}, "out_" + std::to_string(iterations)), kXTicks);
    ASSERT_TRUE(p.probe.is_object()) << p.output;
    ASSERT_EQ(p.probe.size(), 4u) << p.probe.dump();
    for (const auto& [chart, ticks] : p.probe.items()) {
      EXPECT_GE(ticks.size(), 2u) << chart;
      bool has_last = false;
      for (const auto& t : ticks) {
        const std::string label = t.get<std::string>();
        EXPECT_TRUE(std::regex_match(label, whole))
            << chart << " of a " << iterations << "-iteration run has tick " << label;
        has_last |= label == std::to_string(iterations);
      }
      EXPECT_TRUE(has_last) << chart << ": " << ticks.dump();
    }
  }
}

// Tables with no data rows, and the page's text.
const std::string kEmptyTables = kTableName + R"(
  const empty = [...document.querySelectorAll('table')]
                    .filter(t => t.querySelectorAll('tr').length < 2)
                    .map(tableName);
  return {empty: empty, text: document.body.textContent};
)";

TEST_F(RunReportPage, EmptyTablesSayWhy) {
  const fs::path no_eval =
      write_run("no_eval", {kH200, "exp_name: no_eval\neval_interval: 0\nprofile: true\n"});
  const fs::path report = no_eval / "trace_report";
  fs::create_directories(report);
  std::ofstream(report / "gpu_timeline.csv")
      << "device,type,time_ms,percent\n0,computation,120.5,92.1\n";
  std::ofstream(report / "gemm.csv") << "op,M,N,K,batch,dtype,count,total_ms\n";
  std::ofstream(report / "collectives.csv") << "collective,dtype,bytes,group_size,count\n";
  const fs::path stopped = write_run(
      "stopped", {kH200, "exp_name: stopped\neval_interval: 50\nprofile: false\n", 20, 0});
  // No config.yaml, a trace recorded but no `tessera report` of it.
  const fs::path traced = write_run("traced", {kH200, "", 30, 0});
  fs::create_directories(traced / "traces");
  std::ofstream(traced / "traces" / "rank-0.pt.trace.json.gz") << "not read";
  // Profiling and evaluation asked for, neither happened: the run ended before profiling
  // began, and its log says why it could not evaluate.
  const fs::path early = write_run(
      "early",
      {kH200, "exp_name: early\neval_interval: 2\nprofile: true\nprofile_step_start: 10\n", 5, 0});
  std::ofstream(early / "logs" / "pre_trainer" / "rank-0" / "warning.log")
      << "[2026-11-22 03:12:52.390][rank-0][WARNING] no validation data (split '100,0,0' leaves "
         "none, or set valid_data_path): evaluation is disabled\n";

  const test::ProbedPage p = open(plot({no_eval, stopped, traced, early}, "out"), kEmptyTables);
  ASSERT_TRUE(p.probe.is_object()) << p.output;
  EXPECT_TRUE(p.probe["empty"].empty()) << p.probe["empty"].dump();
  const std::string text = p.probe["text"].get<std::string>();
  for (const char* why :
       {"eval_interval is 0", "eval_interval is 50", "stopped at iteration 20",
        "no communication kernels", "no kernel classified as GEMM", "traced has no config.yaml",
        "traces/rank-0.pt.trace.json.gz", "not profiled",
        "split '100,0,0' leaves none, or set valid_data_path): evaluation is disabled",
        "stopped at iteration 5, before profile_step_start 10"})
    EXPECT_NE(text.find(why), std::string::npos) << why << " not in\n" << text;

  // A run without config.yaml alone: no configuration table at all, and why.
  const test::ProbedPage alone = open(plot({traced}, "alone"), kEmptyTables);
  ASSERT_TRUE(alone.probe.is_object()) << alone.output;
  EXPECT_TRUE(alone.probe["empty"].empty()) << alone.probe["empty"].dump();
  EXPECT_NE(alone.probe["text"].get<std::string>().find("traced has no config.yaml"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera::viz
