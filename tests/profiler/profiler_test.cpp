// The trace recorder on the CPU: JSON writing (escaping, exact timestamps, atomic files),
// the profile_* keys, the join of GPU records to ops (with a scripted GpuTracer), and a
// profiled tiny training run whose trace the analyser reads back: ops inside model ranges
// inside trainer phases inside ProfilerStep#N spans.
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "profiler/trace_events.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/config/config.h"
#include "tessera/config/profile_ranks.h"
#include "tessera/core/error.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/metrics.h"
#include "tessera/obs/profiler/profiler.h"
#include "tessera/obs/profiler/trace_file.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/ops/op_observer.h"
#include "tessera/train/trainer.h"

namespace tessera::profiler {
namespace {

namespace fs = std::filesystem;
using profiler_test::Event;
using profiler_test::read_events;
using profiler_test::Trace;

fs::path fresh_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("tessera_profiler_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string read_gz(const fs::path& p) {
  gzFile f = gzopen(p.c_str(), "rb");
  EXPECT_NE(f, nullptr);
  std::string out;
  char buf[65536];
  int n = 0;
  while (f != nullptr && (n = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, n);
  if (f != nullptr) gzclose(f);
  return out;
}

// ---- JSON writing ----

TEST(TraceJson, EscapesNamesSoTheyReadBackUnchanged) {
  const std::string tricky =
      std::string("quote\" backslash\\ newline\n tab\t ctrl\x01\x1f del\x7f ") +
      "utf8 \xc3\xa9\xe2\x9c\x93 </script>";
  const std::string json = json_string(tricky);
  EXPECT_EQ(json_string("a\"b\\c\n"), R"("a\"b\\c\n")");
  EXPECT_EQ(json_string(std::string("\x01", 1)), R"("\u0001")");
  EXPECT_EQ(json.find('\n'), std::string::npos);
  const auto parsed = nlohmann::json::parse(json);
  EXPECT_EQ(parsed.get<std::string>(), tricky);
}

TEST(TraceJson, MicrosecondsAreExactForAnyNanosecondCount) {
  EXPECT_EQ(format_us(0), "0.000");
  EXPECT_EQ(format_us(1), "0.001");
  EXPECT_EQ(format_us(999), "0.999");
  EXPECT_EQ(format_us(1234567), "1234.567");
  EXPECT_EQ(format_us(-1500), "-1.500");
  EXPECT_EQ(format_us(1790857026123456789), "1790857026123456.789");
  EXPECT_EQ(format_us(INT64_MIN), "-9223372036854775.808");
  // The analyser parses them back to the same nanosecond.
  for (int64_t ns : {int64_t{0}, int64_t{7}, int64_t{40123456789123}, int64_t{-2500}})
    EXPECT_EQ(analysis::parse_us_to_ns(format_us(ns)), ns) << ns;
}

TEST(TraceFile, AppearsOnlyOnCommitAndAnAbandonedWriteLeavesTheOldFile) {
  const fs::path dir = fresh_dir("file");
  const fs::path path = dir / "sub" / "t.json";
  {
    TraceFile f(path.string());
    f.write("{\"old\": ");
    EXPECT_FALSE(fs::exists(path));  // only the temporary exists while writing
    EXPECT_TRUE(fs::exists(f.temp_path()));
    f.write("1}");
    EXPECT_GT(f.commit(), 0u);
  }
  EXPECT_EQ(read_file(path), "{\"old\": 1}");
  std::string temp;
  {
    TraceFile f(path.string());
    temp = f.temp_path();
    f.write("{\"new\": [1, 2");  // an exception here would leave the same state
  }
  EXPECT_EQ(read_file(path), "{\"old\": 1}");
  EXPECT_FALSE(fs::exists(temp));
  // .gz paths are gzip-compressed.
  const fs::path gz = dir / "t.json.gz";
  {
    TraceFile f(gz.string());
    f.write("{\"traceEvents\": []}");
    f.commit();
  }
  EXPECT_EQ(read_gz(gz), "{\"traceEvents\": []}");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);
  fs::remove_all(dir);
}

// ---- profile_* keys ----

TEST(ProfileKeys, RanksParse) {
  EXPECT_TRUE(parse_profile_ranks("all")->all);
  EXPECT_EQ(parse_profile_ranks("0")->ids, std::vector<int64_t>({0}));
  EXPECT_EQ(parse_profile_ranks(" 3, 0 ,12")->ids, std::vector<int64_t>({0, 3, 12}));
  EXPECT_TRUE(parse_profile_ranks("0,3")->contains(3));
  EXPECT_FALSE(parse_profile_ranks("0,3")->contains(1));
  for (const char* bad : {"", " ", "a", "-1", "1,,2", "1,", ",1", "0,0", "1.5", "all,0", "0;1"})
    EXPECT_FALSE(parse_profile_ranks(bad).has_value()) << "'" << bad << "'";
}

Experiment load_tiny(const std::vector<std::string>& overrides, int data_parallel = 1) {
  const fs::path p =
      fs::temp_directory_path() / ("tessera_profiler_cfg_" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(p) << "model: tiny_llama\nmock_data: true\nnum_layers: 2\nhidden_size: 32\n"
                      "ffn_hidden_size: 48\nnum_attention_heads: 4\nnum_query_groups: 2\n"
                      "vocab_size: 50\nseq_length: 16\nmicro_batch_size: 2\nglobal_batch_size: 4\n"
                      "train_iters: 5\nlr: 0.01\nlog_progress: false\n";
  LoadOptions o;
  o.config_path = p.string();
  o.cli_overrides = overrides;
  o.data_parallel_size = data_parallel;
  try {
    Experiment e = load_experiment(o);
    fs::remove(p);
    return e;
  } catch (...) {
    fs::remove(p);
    throw;
  }
}

std::string rejected_key(const std::vector<std::string>& overrides, int data_parallel = 1) {
  try {
    load_tiny(overrides, data_parallel);
  } catch (const ConfigError& e) {
    return e.key();
  }
  return "";
}

TEST(ProfileKeys, ValidationNamesTheKey) {
  // The default window [10, 12) starts after this 5-iteration run: nothing would be recorded.
  EXPECT_EQ(rejected_key({"--profile", "true"}), "profile_step_start");
  EXPECT_EQ(rejected_key({"--profile", "true", "--train_iters", "20"}), "");
  EXPECT_EQ(rejected_key({"--profile", "true", "--profile_step_start", "6"}), "profile_step_start");
  EXPECT_EQ(rejected_key({"--profile", "true", "--profile_step_start", "0"}), "profile_step_start");
  EXPECT_EQ(
      rejected_key({"--profile", "true", "--profile_step_start", "3", "--profile_step_end", "3"}),
      "profile_step_end");
  EXPECT_EQ(
      rejected_key({"--profile", "true", "--profile_step_start", "3", "--profile_step_end=2"}),
      "profile_step_end");
  EXPECT_EQ(rejected_key({"--profile=true", "--profile_step_start=2", "--profile_ranks", "x"}),
            "profile_ranks");
  EXPECT_EQ(rejected_key({"--profile=true", "--profile_step_start=2", "--profile_ranks", "0,0"}),
            "profile_ranks");
  EXPECT_EQ(rejected_key({"--profile=true", "--profile_step_start=2", "--profile_ranks", "1"}),
            "profile_ranks");  // only rank 0 exists
  EXPECT_EQ(rejected_key({"--profile=true", "--profile_step_start=2", "--profile_ranks", "1"}, 2),
            "");
  EXPECT_EQ(rejected_key({"--profile=true", "--profile_step_start=2", "--profile_ranks", "all"}),
            "");
  // Without profile: true the window is not checked.
  EXPECT_EQ(rejected_key({"--profile_step_start", "9", "--profile_step_end", "2"}), "");
}

// ---- the join of GPU records to ops, with a scripted tracer ----

// Hands out a fake clock and, at stop(), GPU activity for the ops that were open when
// each "launch" happened: kernel 1 linked by external correlation, kernel 2 only by time
// (no external-correlation record), a memcpy outside any op.
class ScriptedTracer : public GpuTracer {
 public:
  explicit ScriptedTracer(bool fail_start = false) : fail_start_(fail_start) {}
  std::string description() const override { return "scripted"; }
  std::vector<GpuDeviceInfo> devices() const override {
    GpuDeviceInfo d;
    d.id = 0;
    d.name = "NVIDIA H200";
    d.sms = 132;
    return {d};
  }
  bool start(std::string* error) override {
    if (fail_start_) {
      *error = "cuptiActivityEnable(CONCURRENT_KERNEL) failed: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES";
      return false;
    }
    return true;
  }
  int64_t timestamp_ns() override { return clock_ += 1000; }  // 1 µs per reading
  void push_external_id(uint64_t id) override { stack_.push_back(id); }
  void pop_external_id() override { stack_.pop_back(); }

  // Records a launch by the op on top of the stack, as CUPTI would.
  void launch(const char* kernel, bool with_external_record) {
    const uint32_t correlation = next_correlation_++;
    ApiCallRecord c;
    c.name = name(correlation % 2 ? "cudaLaunchKernel" : "cuLaunchKernelEx");
    c.driver = correlation % 2 == 0;
    c.cbid = 211;
    c.start_ns = timestamp_ns();
    c.end_ns = timestamp_ns();
    c.process = static_cast<uint32_t>(::getpid());
    c.thread = static_cast<uint32_t>(::gettid());
    c.correlation = correlation;
    trace_.api_calls.push_back(c);
    if (with_external_record && !stack_.empty()) trace_.external_ids[correlation] = stack_.back();
    GpuActivityRecord a;
    a.kind = GpuActivityKind::kKernel;
    a.name = name(kernel);
    a.start_ns = c.end_ns + 500;
    a.end_ns = a.start_ns + 20000;
    a.device = 0;
    a.stream = 7;
    a.correlation = correlation;
    a.grid[0] = 132, a.block[0] = 256;
    trace_.activities.push_back(a);
  }
  void memcpy_outside_ops() {
    GpuActivityRecord a;
    a.kind = GpuActivityKind::kMemcpy;
    a.name = name("Memcpy HtoD (Pageable -> Device)");
    a.start_ns = timestamp_ns();
    a.end_ns = a.start_ns + 3000;
    a.stream = 7;
    a.correlation = 999;
    a.bytes = 4096;
    trace_.activities.push_back(a);
  }
  GpuTrace stop() override { return std::move(trace_); }

 private:
  uint32_t name(const std::string& n) {
    trace_.names.push_back(n);
    return static_cast<uint32_t>(trace_.names.size() - 1);
  }
  bool fail_start_;
  int64_t clock_ = kTraceBaseTimeNs + 5'000'000'000;
  std::vector<uint64_t> stack_;
  uint32_t next_correlation_ = 41;
  GpuTrace trace_;
};

TEST(Profiler, JoinsKernelsToTheirOpsByExternalIdAndByTime) {
  const fs::path dir = fresh_dir("join");
  auto tracer = std::make_unique<ScriptedTracer>();
  ScriptedTracer* gpu = tracer.get();
  ProfilerOptions o;
  o.device = Device{DeviceKind::GPU, 0};
  Profiler p(o, std::move(tracer));
  p.start();
  EXPECT_EQ(p.gpu_tracing(), "scripted");
  p.begin_annotation("ProfilerStep#7");
  p.range_begin("layer_forward");
  MatmulArgs m;
  float dummy = 0;
  m.out = Tensor{&dummy, DType::BF16, Shape{512, 1024}, Device{DeviceKind::GPU, 0}};
  m.a = Tensor{&dummy, DType::BF16, Shape{512, 256}, Device{DeviceKind::GPU, 0}};
  m.b = Tensor{&dummy, DType::BF16, Shape{1024, 256}, Device{DeviceKind::GPU, 0}};
  m.trans_b = true;
  p.op_begin("matmul", op_args::matmul(m));
  gpu->launch("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", /*with_external_record=*/true);
  p.op_end();
  AttentionShape s;
  s.batch = 2, s.seq = 4096, s.heads = 32, s.kv_heads = 8, s.head_dim = 128, s.window = 1024;
  p.op_begin("attention_forward", op_args::attention(s, DType::BF16));
  gpu->launch("void tessera::cuda::(anonymous namespace)::attention_forward_kernel<128>(...)",
              /*with_external_record=*/false);  // linked by time only
  p.op_end();
  p.range_end();
  gpu->memcpy_outside_ops();
  p.end_annotation();
  p.stop();
  const fs::path path = dir / "rank-0.pt.trace.json";
  const TraceSummary sum = p.write(path.string());
  EXPECT_EQ(sum.ops, 2u);
  EXPECT_EQ(sum.annotations, 2u);
  EXPECT_EQ(sum.kernels, 2u);
  EXPECT_EQ(sum.kernels_with_op, 2u);
  EXPECT_EQ(sum.memcpys, 1u);
  EXPECT_EQ(sum.flows, 2u);

  const Trace t = read_events(path.string());
  const auto kernels = t.spans("kernel");
  ASSERT_EQ(kernels.size(), 2u);
  const Event& gemm = *kernels[0];
  EXPECT_EQ(gemm.pid, 0);  // pid = device
  EXPECT_EQ(gemm.m, 512);
  EXPECT_EQ(gemm.n, 1024);
  EXPECT_EQ(gemm.k, 256);
  EXPECT_EQ(gemm.dtype, "bf16");
  EXPECT_EQ(gemm.correlation, 41);
  const Event& att = *kernels[1];
  EXPECT_EQ(att.b, 2);
  EXPECT_EQ(att.h, 32);
  EXPECT_EQ(att.kv, 8);
  EXPECT_EQ(att.t, 4096);
  EXPECT_EQ(att.d, 128);
  EXPECT_EQ(att.window, 1024);
  EXPECT_EQ(att.causal, 1);
  const auto ops = t.spans("cpu_op");
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_EQ(gemm.external_id, ops[0]->external_id);
  EXPECT_EQ(att.external_id, ops[1]->external_id);
  EXPECT_NE(ops[0]->external_id, ops[1]->external_id);
  // Runtime and driver launches carry the correlation and the op's External id.
  EXPECT_EQ(t.spans("cuda_runtime").size(), 1u);
  EXPECT_EQ(t.spans("cuda_driver").size(), 1u);
  EXPECT_EQ(t.spans("cuda_runtime")[0]->external_id, ops[0]->external_id);
  // Flows: one s/f pair per launch, with the correlation as id.
  int starts = 0, finishes = 0;
  for (const Event& e : t.events) {
    if (e.cat != "ac2g") continue;
    starts += e.ph == 's';
    finishes += e.ph == 'f';
  }
  EXPECT_EQ(starts, 2);
  EXPECT_EQ(finishes, 2);
  const auto copies = t.spans("gpu_memcpy");
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0]->external_id, -1);  // launched by no op
  // Metadata: GPU and CPU process names, deviceProperties, rank.
  const auto whole = nlohmann::json::parse(read_file(path));  // strict JSON, as a whole
  std::set<std::string> labels, threads;
  for (const auto& e : whole["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_labels") labels.insert(e["args"]["labels"]);
    if (e["ph"] == "M" && e["name"] == "thread_name") threads.insert(e["args"]["name"]);
  }
  EXPECT_EQ(labels, std::set<std::string>({"GPU 0", "CPU"}));
  EXPECT_TRUE(threads.count("stream 7"));
  EXPECT_EQ(t.members.count("deviceProperties"), 1u);
  EXPECT_EQ(nlohmann::json::parse(t.members.at("baseTimeNanoseconds")).get<int64_t>(),
            kTraceBaseTimeNs);
  std::string why;
  EXPECT_TRUE(profiler_test::spans_nest(t, ::getpid(), &why)) << why;

  // The analyser sees the GEMM and attention shapes and the launching ops.
  analysis::TraceData data = analysis::TraceData::load(path.string(), false);
  ASSERT_EQ(data.gpu.size(), 3u);
  EXPECT_EQ(data.info.devices, std::vector<std::string>({"NVIDIA H200"}));
  EXPECT_EQ(data.strings[data.launching_op(data.gpu[0])->name], "matmul");
  EXPECT_EQ(data.strings[data.launching_op(data.gpu[1])->name], "attention_forward");
  EXPECT_EQ(data.gpu[0].category, analysis::Category::kGemm);
  EXPECT_EQ(data.gpu[1].category, analysis::Category::kAttentionFwd);
  const analysis::Report report = analysis::build_report(data, {});
  ASSERT_NE(report.find("gemm"), nullptr);
  EXPECT_EQ(report.find("gemm")->rows.size(), 1u);
  ASSERT_NE(report.find("attention"), nullptr);
  EXPECT_EQ(report.find("attention")->rows.size(), 1u);
  fs::remove_all(dir);
}

// The time-based join walks back over nested ops that ended before the launch to the op
// still open around it, and stops at a top-level op.
TEST(Profiler, ALaunchByTimeGoesToTheInnermostOpStillOpen) {
  const fs::path dir = fresh_dir("nested_join");
  auto tracer = std::make_unique<ScriptedTracer>();
  ScriptedTracer* gpu = tracer.get();
  ProfilerOptions o;
  o.device = Device{DeviceKind::GPU, 0};
  Profiler p(o, std::move(tracer));
  p.start();
  p.op_begin("outer", OpArgs());
  p.op_begin("inner", OpArgs());
  gpu->launch("in_inner", /*with_external_record=*/false);
  p.op_end();
  gpu->launch("in_outer_after_inner", /*with_external_record=*/false);
  p.op_end();
  gpu->launch("outside_ops", /*with_external_record=*/false);
  p.stop();
  const fs::path path = dir / "t.json";
  EXPECT_EQ(p.write(path.string()).kernels_with_op, 2u);
  const Trace t = read_events(path.string());
  const auto outer = t.spans("cpu_op", "outer");
  const auto inner = t.spans("cpu_op", "inner");
  ASSERT_EQ(outer.size(), 1u);
  ASSERT_EQ(inner.size(), 1u);
  EXPECT_EQ(t.spans("kernel", "in_inner").at(0)->external_id, inner[0]->external_id);
  EXPECT_EQ(t.spans("kernel", "in_outer_after_inner").at(0)->external_id, outer[0]->external_id);
  EXPECT_EQ(t.spans("kernel", "outside_ops").at(0)->external_id, -1);
  fs::remove_all(dir);
}

TEST(Profiler, AGpuTracerThatCannotStartGivesAHostOnlyTraceWithTheReason) {
  const fs::path dir = fresh_dir("nogpu");
  ProfilerOptions o;
  o.device = Device{DeviceKind::GPU, 0};
  Profiler p(o, std::make_unique<ScriptedTracer>(/*fail_start=*/true));
  p.start();
  ASSERT_EQ(p.warnings().size(), 1u);
  EXPECT_NE(p.warnings()[0].find("INSUFFICIENT_PRIVILEGES"), std::string::npos);
  EXPECT_EQ(p.gpu_tracing().rfind("off: ", 0), 0u);
  p.op_begin("fill", OpArgs().add("numel", 10));
  p.op_end();
  p.stop();
  const fs::path path = dir / "t.json.gz";
  p.write(path.string());
  const Trace t = read_events(path.string());
  EXPECT_EQ(t.spans("cpu_op").size(), 1u);
  EXPECT_TRUE(t.spans("kernel").empty());
  const auto meta = nlohmann::json::parse(t.members.at("tessera"));
  EXPECT_EQ(meta["gpu_tracing"].get<std::string>().rfind("off: ", 0), 0u);
  EXPECT_EQ(meta["warnings"].size(), 1u);
  fs::remove_all(dir);
}

// The real GPU tracer of this build (CUPTI when compiled in) asked for a GPU: where there is
// none (or CUPTI cannot start) it must leave a warning and a host-only trace, not a crash.
TEST(Profiler, TheBuildsGpuTracerNeverStopsARecording) {
  const fs::path dir = fresh_dir("real_tracer");
  ProfilerOptions o;
  o.device = Device{DeviceKind::GPU, 0};
  Profiler p(o);
  p.start();
  p.op_begin("fill", OpArgs().add("numel", 1));
  p.op_end();
  p.stop();
  std::printf(
      "[ tracer   ] %s; warnings: %zu%s%s\n", p.gpu_tracing().c_str(), p.warnings().size(),
      p.warnings().empty() ? "" : ", first: ", p.warnings().empty() ? "" : p.warnings()[0].c_str());
  if (gpu_device_count() == 0) {
    EXPECT_EQ(p.gpu_tracing().rfind("off: ", 0), 0u);
    EXPECT_FALSE(p.warnings().empty());
  }
  const TraceSummary s = p.write((dir / "t.json").string());
  EXPECT_EQ(s.ops, 1u);
  const Trace t = read_events((dir / "t.json").string());
  EXPECT_EQ(t.spans("cpu_op", "fill").size(), 1u);
  fs::remove_all(dir);
}

TEST(Profiler, RecordsOnlyWhileObservingAndSpansLeftOpenEndAtStop) {
  auto backend = make_cpu_backend();
  DeviceBuffer buf(*backend, 64 * sizeof(float), "test");
  const Tensor x = buf.tensor(DType::F32, {64});
  ProfilerOptions o;
  Profiler p(o);  // CPU: no GPU tracer
  EXPECT_EQ(p.gpu_tracing(), "off: the device is the CPU");
  backend->fill(x, 1.0f);  // no observer: nothing to record into
  p.start();
  backend->set_op_observer(&p);
  backend->range_push("layer_forward");
  backend->fill(x, 2.0f);
  backend->range_push("left_open");
  backend->set_op_observer(nullptr);
  backend->fill(x, 3.0f);  // detached: not recorded
  p.stop();
  EXPECT_EQ(p.warnings().size(), 1u);  // two spans were left open
  const fs::path dir = fresh_dir("observe");
  const TraceSummary s = p.write((dir / "t.json").string());
  EXPECT_EQ(s.ops, 1u);
  EXPECT_EQ(s.annotations, 2u);
  const Trace t = read_events((dir / "t.json").string());
  const auto fills = t.spans("cpu_op", "fill");
  ASSERT_EQ(fills.size(), 1u);
  EXPECT_EQ(Trace::enclosing(t.spans("user_annotation", "layer_forward"), *fills[0]).size(), 1u);
  fs::remove_all(dir);
}

// ---- a profiled training run on the CPU ----

struct ProfiledRun {
  fs::path root, trace;
  std::string info_log;
  std::vector<nlohmann::json> metrics;
};

ProfiledRun run_profiled(const std::string& name, const std::vector<std::string>& overrides) {
  ProfiledRun r;
  const fs::path work = fresh_dir(name);
  std::vector<std::string> all = {"--workspace", work.string(),    "--exp_name",
                                  name,          "--log_interval", "1"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  const Experiment e = load_tiny(all);
  r.root = e.experiment_root();
  r.trace = r.root / "traces" / "rank-0.pt.trace.json.gz";
  const fs::path logs = r.root / "logs" / "pre_trainer" / "rank-0";
  {
    Logger log(logs.string(), 0, /*console=*/false, /*progress=*/false);
    MetricsWriter metrics((r.root / "metrics.jsonl").string());
    Trainer trainer(e, make_cpu_backend(), log, &metrics);
    trainer.train();
  }
  r.info_log = read_file(logs / "info.log");
  std::ifstream in(r.root / "metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) r.metrics.push_back(nlohmann::json::parse(line));
  return r;
}

TEST(TrainingProfile, CpuRunWritesATraceWithOpsInsideLayersInsideIterations) {
  const ProfiledRun run = run_profiled(
      "cpu_run", {"--profile", "true", "--profile_step_start", "2", "--profile_step_end", "4"});
  ASSERT_TRUE(fs::exists(run.trace)) << run.info_log;
  // Atomic: only the finished file is in the directory.
  std::vector<std::string> files;
  for (const auto& f : fs::directory_iterator(run.trace.parent_path()))
    files.push_back(f.path().filename().string());
  EXPECT_EQ(files, std::vector<std::string>({"rank-0.pt.trace.json.gz"}));
  EXPECT_NE(
      run.info_log.find("profiling: wrote the trace of iterations 2-3 to " + run.trace.string()),
      std::string::npos)
      << run.info_log;

  const Trace t = read_events(run.trace.string());
  const int64_t pid = ::getpid();
  const auto steps = t.spans("user_annotation");
  const auto step2 = t.spans("user_annotation", "ProfilerStep#2");
  const auto step3 = t.spans("user_annotation", "ProfilerStep#3");
  ASSERT_EQ(step2.size(), 1u);
  ASSERT_EQ(step3.size(), 1u);
  EXPECT_LT(step2[0]->end(), step3[0]->ts);
  EXPECT_TRUE(t.spans("user_annotation", "ProfilerStep#1").empty());
  EXPECT_TRUE(t.spans("user_annotation", "ProfilerStep#4").empty());
  const std::vector<const Event*> iterations = {step2[0], step3[0]};

  // Every op is inside an iteration; the model's ops are inside the model's ranges, which
  // are inside a micro-batch's forward_backward phase.
  const auto ops = t.spans("cpu_op");
  ASSERT_GT(ops.size(), 50u);
  const auto fwd_bwd = t.spans("user_annotation", "forward_backward");
  EXPECT_EQ(fwd_bwd.size(), 4u);  // 2 iterations x 2 micro-batches
  std::vector<const Event*> model_ranges;
  for (const char* n : {"embedding_forward", "layer_forward", "output_head", "layer_backward",
                        "embedding_backward"}) {
    for (const Event* e : t.spans("user_annotation", n)) model_ranges.push_back(e);
  }
  EXPECT_EQ(t.spans("user_annotation", "layer_forward").size(), 8u);  // 2 layers x 4
  EXPECT_EQ(t.spans("user_annotation", "layer_backward").size(), 8u);
  for (const Event* op : ops) {
    EXPECT_EQ(op->pid, pid);
    EXPECT_GT(op->external_id, 0) << op->name;
    EXPECT_EQ(Trace::enclosing(iterations, *op).size(), 1u) << op->name << " at " << op->ts;
    if (!Trace::enclosing(fwd_bwd, *op).empty())
      EXPECT_FALSE(Trace::enclosing(model_ranges, *op).empty()) << op->name << " at " << op->ts;
  }
  for (const Event* layer : t.spans("user_annotation", "layer_forward")) {
    EXPECT_EQ(Trace::enclosing(fwd_bwd, *layer).size(), 1u);
    EXPECT_EQ(Trace::enclosing(iterations, *layer).size(), 1u);
  }
  for (const Event* a : t.spans("cpu_op", "attention_forward")) {
    EXPECT_EQ(Trace::enclosing(t.spans("user_annotation", "attention_block"), *a).size(), 1u);
    EXPECT_EQ(a->b, 2);
    EXPECT_EQ(a->h, 4);
    EXPECT_EQ(a->kv, 2);
    EXPECT_EQ(a->t, 16);
    EXPECT_EQ(a->d, 8);
    EXPECT_EQ(a->causal, 1);
    EXPECT_EQ(a->dtype, "fp32");
  }
  for (const Event* m : t.spans("cpu_op", "matmul")) {
    EXPECT_GT(m->m, 0);
    EXPECT_GT(m->n, 0);
    EXPECT_GT(m->k, 0);
    EXPECT_EQ(m->dtype, "fp32");
  }
  // Trainer phases of each iteration.
  for (const char* phase : {"grad_norm", "optimizer", "loss_readback"})
    EXPECT_EQ(t.spans("user_annotation", phase).size(), 2u) << phase;
  EXPECT_EQ(t.spans("user_annotation", "data_loading").size(), 4u);
  EXPECT_EQ(t.spans("cpu_op", "adamw_step").size(), 2u);
  EXPECT_GE(t.spans("user_annotation", "logging").size(), 2u);
  std::string why;
  EXPECT_TRUE(profiler_test::spans_nest(t, pid, &why)) << why;
  EXPECT_GT(steps.size(), 30u);

  // Metadata: the process and thread are named; rank and world size; no GPU.
  int process_names = 0, thread_names = 0;
  for (const Event& e : t.events) {
    process_names += e.ph == 'M' && e.name == "process_name" && e.pid == pid;
    thread_names += e.ph == 'M' && e.name == "thread_name" && e.pid == pid;
  }
  EXPECT_EQ(process_names, 1);
  EXPECT_EQ(thread_names, 1);
  EXPECT_EQ(t.members.count("deviceProperties"), 0u);
  const auto meta = nlohmann::json::parse(t.members.at("tessera"));
  EXPECT_EQ(meta["gpu_tracing"], "off: the device is the CPU");
  EXPECT_EQ(meta["run"]["profile_step_start"], 2);
  const analysis::TraceData data = analysis::TraceData::load(run.trace.string(), false);
  EXPECT_EQ(data.info.rank, 0);
  EXPECT_EQ(data.info.world_size, 1);
  EXPECT_EQ(data.info.cpu_ops, ops.size());
  EXPECT_EQ(data.info.missing_fields, 0u);
  const analysis::Table op_table = analysis::ops_table(data);
  bool has_matmul = false;
  for (const auto& row : op_table.rows) has_matmul |= std::get<std::string>(row[0]) == "matmul";
  EXPECT_TRUE(has_matmul);

  // The iteration lines and metrics of profiled iterations say so, and only those.
  for (int it = 1; it <= 5; ++it) {
    const size_t at = run.info_log.find(fmt::format("iteration {:>8}/", it));
    ASSERT_NE(at, std::string::npos) << it;
    const std::string line = run.info_log.substr(at, run.info_log.find('\n', at) - at);
    EXPECT_EQ(line.find("| profiled") != std::string::npos, it == 2 || it == 3) << line;
  }
  int profiled_records = 0;
  for (const auto& m : run.metrics) {
    if (!m.contains("profiled")) continue;
    ++profiled_records;
    EXPECT_TRUE(m["iteration"] == 2 || m["iteration"] == 3) << m.dump();
  }
  EXPECT_EQ(profiled_records, 2);
  fs::remove_all(run.root.parent_path().parent_path().parent_path());
}

TEST(TrainingProfile, AWindowPastTheEndStopsWithTheRun) {
  const ProfiledRun run = run_profiled(
      "past_end", {"--profile", "true", "--profile_step_start", "5", "--profile_step_end", "50"});
  ASSERT_TRUE(fs::exists(run.trace)) << run.info_log;
  EXPECT_NE(run.info_log.find("profiling: wrote the trace of iteration 5 to"), std::string::npos)
      << run.info_log;
  const Trace t = read_events(run.trace.string());
  EXPECT_EQ(t.spans("user_annotation", "ProfilerStep#5").size(), 1u);
  fs::remove_all(run.root.parent_path().parent_path().parent_path());
}

TEST(TrainingProfile, RanksNotListedAndProfileOffRecordNothing) {
  const fs::path work = fresh_dir("unlisted");
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--profile", "true", "--profile_step_start", "2", "--profile_ranks", "1"},
           {"--profile", "false", "--profile_step_start", "2"}}) {
    std::vector<std::string> all = {"--workspace", work.string(), "--log_interval", "1"};
    all.insert(all.end(), extra.begin(), extra.end());
    const Experiment e = load_tiny(all, /*data_parallel=*/2);  // rank 1 exists; we are rank 0
    Logger log("", 0, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr);
    trainer.train();
    EXPECT_FALSE(fs::exists(fs::path(e.experiment_root()) / "traces"));
    EXPECT_EQ(trainer.backend().op_observer(), nullptr);
  }
  fs::remove_all(work);
}

}  // namespace
}  // namespace tessera::profiler
