// The trace recorder on a GPU: a profiled training run of a small model records CUPTI
// kernels linked to their launches and ops, with the ops' shape args; inside a profiled
// step the GPU timeline (computation + exposed comm + exposed memcpy + idle) adds up to the
// step time the trainer measured, within 2%; and the report classifies every kernel.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "gpu_test_util.h"
#include "profiler/trace_events.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/timeline.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/metrics.h"
#include "tessera/train/trainer.h"

namespace tessera::gpu_test {
namespace {

namespace fs = std::filesystem;
using profiler_test::Event;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(GpuProfiler, ProfiledStepsHaveLinkedKernelsWithShapesAndAccountForTheStepTime) {
  TS_REQUIRE_GPU();
  const fs::path work =
      fs::temp_directory_path() / ("tessera_gpu_profiler_" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  // Long enough per step (about 10 ms on an H100/H200) that the few tens of microseconds of
  // host work at a step's edges, outside the GPU timeline, stay well under 2%.
  const fs::path yaml = work / "exp.yaml";
  std::ofstream(yaml) << "model: tiny_llama\nmock_data: true\nnum_layers: 2\nhidden_size: 512\n"
                         "ffn_hidden_size: 1536\nnum_attention_heads: 8\nnum_query_groups: 4\n"
                         "vocab_size: 32000\nseq_length: 1024\nmicro_batch_size: 4\n"
                         "global_batch_size: 16\ntrain_iters: 5\nlr: 1.0e-3\nlr_warmup_iters: 1\n"
                         "log_interval: 1\nlog_progress: false\nprofile: true\n"
                         "profile_step_start: 3\nprofile_step_end: 5\n"
                      << "workspace: " << work.string() << "\nexp_name: profiled\n";
  LoadOptions o;
  o.config_path = yaml.string();
  const Experiment e = load_experiment(o);
  const fs::path root = e.experiment_root();
  const fs::path logs = root / "logs" / "pre_trainer" / "rank-0";
  {
    Logger log(logs.string(), 0, /*console=*/true, /*progress=*/false);
    MetricsWriter metrics((root / "metrics.jsonl").string());
    Trainer trainer(e, make_backend(DeviceChoice::Gpu, 0), log, &metrics);
    trainer.train();
  }
  const fs::path path = root / "traces" / "rank-0.pt.trace.json.gz";
  ASSERT_TRUE(fs::exists(path)) << read_text(logs / "info.log");

  // ---- GPU tracing worked, or the test says why not ----
  const profiler_test::Trace t = profiler_test::read_events(path.string());
  const auto meta = nlohmann::json::parse(t.members.at("tessera"));
  std::printf("[ trace    ] %s\n[ trace    ] gpu tracing: %s; clock: %s; warnings: %s\n",
              path.c_str(), meta["gpu_tracing"].get<std::string>().c_str(),
              meta["clock"].get<std::string>().c_str(), meta["warnings"].dump().c_str());
  ASSERT_EQ(meta["gpu_tracing"].get<std::string>().rfind("off", 0), std::string::npos)
      << "CUPTI did not trace the GPU: " << meta["gpu_tracing"] << " " << meta["warnings"];
  EXPECT_EQ(meta["dropped_records"], 0);
  EXPECT_EQ(t.members.count("deviceProperties"), 1u);

  const analysis::TraceData data = analysis::TraceData::load(path.string(), false);
  ASSERT_FALSE(data.gpu.empty());
  EXPECT_FALSE(data.info.devices.empty());
  EXPECT_EQ(data.info.missing_fields, 0u);

  // ---- every kernel is linked: to its launch (correlation, flow) and to its op ----
  std::unordered_set<int64_t> launches;
  for (const Event& x : t.events)
    if (x.ph == 'X' && (x.cat == "cuda_runtime" || x.cat == "cuda_driver"))
      launches.insert(x.correlation);
  size_t kernels = 0, unlinked_launch = 0, without_op = 0, gemm = 0, gemm_with_shape = 0,
         attention = 0, attention_with_shape = 0;
  std::set<std::string> no_op_names;
  for (const analysis::GpuActivity& g : data.gpu) {
    if (g.kind != analysis::GpuKind::kKernel) continue;
    ++kernels;
    EXPECT_GE(g.correlation, 0);
    unlinked_launch += launches.count(g.correlation) == 0;
    const analysis::OpRef* op = data.launching_op(g);
    if (op == nullptr) {
      ++without_op;
      no_op_names.insert(data.strings[g.name]);
    }
    if (g.category == analysis::Category::kGemm) {
      ++gemm;
      if (g.shape >= 0) {
        const analysis::ShapeArgs& s = data.shapes[g.shape];
        gemm_with_shape += s.m > 0 && s.n > 0 && s.k > 0 && data.strings[s.dtype] == "bf16";
      }
    }
    if (g.category == analysis::Category::kAttentionFwd ||
        g.category == analysis::Category::kAttentionBwd) {
      ++attention;
      if (g.shape >= 0) {
        const analysis::ShapeArgs& s = data.shapes[g.shape];
        attention_with_shape +=
            s.b == 4 && s.h == 8 && s.kv == 4 && s.t == 1024 && s.d == 64 && s.causal == 1;
      }
    }
  }
  std::printf(
      "[ kernels  ] %zu kernels: %zu GEMM (%zu with M/N/K), %zu attention (%zu with "
      "B/H/KV/T/D), %zu without a launch record, %zu without an op\n",
      kernels, gemm, gemm_with_shape, attention, attention_with_shape, unlinked_launch, without_op);
  EXPECT_GT(kernels, 100u);
  EXPECT_EQ(unlinked_launch, 0u);
  EXPECT_EQ(without_op, 0u) << "e.g. " << (no_op_names.empty() ? "" : *no_op_names.begin());
  EXPECT_GT(gemm, 0u);
  EXPECT_EQ(gemm_with_shape, gemm);
  EXPECT_GT(attention, 0u);
  EXPECT_EQ(attention_with_shape, attention);
  EXPECT_GE(data.info.flow_events, 2 * kernels);

  // ---- the GPU timeline inside each profiled step vs the trainer's step time ----
  std::map<int64_t, double> step_ms;  // metrics.jsonl: elapsed_ms of each iteration
  std::ifstream metrics_in(root / "metrics.jsonl");
  for (std::string line; std::getline(metrics_in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("elapsed_ms")) step_ms[j["iteration"].get<int64_t>()] = j["elapsed_ms"];
    if (j.contains("elapsed_ms"))
      EXPECT_EQ(j.contains("profiled"), j["iteration"] == 3 || j["iteration"] == 4) << line;
  }
  for (int64_t it : {3, 4}) {
    const auto steps = t.spans("user_annotation", "ProfilerStep#" + std::to_string(it));
    ASSERT_EQ(steps.size(), 1u) << it;
    const Event& step = *steps[0];
    analysis::TraceData in_step = data;
    in_step.gpu.clear();
    // On one clock, a step's GPU work lies inside its host span: it starts after the first
    // launch and ends before the final download returns. (2 µs of slack for CUPTI's
    // GPU-to-host timestamp conversion.)
    constexpr int64_t kSlackNs = 2000;
    size_t straddling = 0;
    for (const analysis::GpuActivity& g : data.gpu) {
      const int64_t end = g.start_ns + g.dur_ns;
      if (end <= step.ts || g.start_ns >= step.end()) continue;  // another step's
      if (g.start_ns < step.ts - kSlackNs || end > step.end() + kSlackNs) ++straddling;
      in_step.gpu.push_back(g);
    }
    EXPECT_EQ(straddling, 0u) << "iteration " << it;
    ASSERT_FALSE(in_step.gpu.empty()) << it;
    const std::vector<analysis::TimelineBreakdown> tl = analysis::gpu_timeline(in_step);
    ASSERT_EQ(tl.size(), 1u);
    const analysis::TimelineBreakdown& b = tl[0];
    EXPECT_EQ(b.computation + b.exposed_comm + b.exposed_memcpy + b.idle, b.total);
    EXPECT_EQ(b.busy + b.idle, b.total);
    const double total_ms = static_cast<double>(b.total) / 1e6;
    const double measured = step_ms.at(it);
    const double error = std::abs(total_ms - measured) / measured;
    std::printf(
        "[ step %-3lld ] trainer %.3f ms | host span %.3f ms | GPU timeline %.3f ms = "
        "computation %.3f + exposed memcpy %.3f + exposed comm %.3f + idle %.3f | "
        "difference %.2f%%\n",
        static_cast<long long>(it), measured, static_cast<double>(step.dur) / 1e6, total_ms,
        b.computation / 1e6, b.exposed_memcpy / 1e6, b.exposed_comm / 1e6, b.idle / 1e6,
        100 * error);
    // The first profiled step carries CUPTI's one-time costs (module loading for tracing):
    // the claim is made for the steady one.
    if (it == 4) EXPECT_LT(error, 0.02) << "iteration " << it;
  }

  // ---- the report classifies every kernel ----
  const analysis::Report report = analysis::build_report(data, {});
  const analysis::Table* unclassified = report.find("unclassified");
  ASSERT_NE(unclassified, nullptr);
  for (const auto& row : unclassified->rows)
    ADD_FAILURE() << "unclassified kernel: " << std::get<std::string>(row[0]);
  const analysis::Table* categories = report.find("categories");
  ASSERT_NE(categories, nullptr);
  for (const auto& row : categories->rows)  // category, count, total_ms, ...
    std::printf("[ category ] %-14s %6lld activities %9.3f ms\n",
                std::get<std::string>(row[0]).c_str(),
                static_cast<long long>(std::get<int64_t>(row[1])), std::get<double>(row[2]));

  const std::string info = read_text(logs / "info.log");
  EXPECT_NE(info.find("profiling: wrote the trace of iterations 3-4 to " + path.string()),
            std::string::npos);
  fs::remove_all(work);
}

}  // namespace
}  // namespace tessera::gpu_test
