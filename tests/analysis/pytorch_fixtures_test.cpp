// Real PyTorch profiler traces (tests/data/traces, see its README): every number the report
// gives is checked against an independent computation over the whole JSON document (a DOM,
// fine for fixtures this small).
#include <zlib.h>

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "tessera/analysis/bandwidth.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/ranks.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/shapes.h"
#include "tessera/analysis/timeline.h"
#include "tessera/analysis/trace_data.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::json;

const std::string kDir = std::string(TESSERA_TEST_DATA_DIR) + "/traces/";

json load_json(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr) << path;
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) text.append(buf, n);
  gzclose(f);
  return json::parse(text);
}

const json& events_of(const json& j) {
  return j.is_array() ? j : j["traceEvents"];
}

bool is_gpu(const json& e) {
  const std::string cat = e.value("cat", "");
  return e.value("ph", "") == "X" &&
         (cat == "kernel" || cat == "gpu_memcpy" || cat == "gpu_memset");
}

int64_t ns(const json& v) {
  return std::llround(v.get<double>() * 1000.0);
}

// Category totals by independent name tests: what each library's kernels are called.
std::string expected_category(const json& e) {
  const std::string cat = e["cat"], n = e["name"];
  if (cat == "gpu_memcpy") return "memcpy";
  if (cat == "gpu_memset") return "memset";
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("nccl")) return "communication";
  if (has("bprop") || has("cudnn::fusion")) return "attention_bwd";
  if (has("fprop")) return "attention_fwd";
  if (n.rfind("nvjet", 0) == 0) return "GEMM";
  if (has("FusedAdam")) return "optimizer";
  if (has("rms_norm") || has("layer_norm") || has("GammaBeta")) return "normalization";
  if (has("softmax") || has("nll_loss") || n.rfind("triton_red", 0) == 0 ||
      n.rfind("triton_per", 0) == 0) {
    return "reduction";
  }
  if (n.rfind("triton_poi", 0) == 0) return "elementwise";  // fused pointwise, whatever it fuses
  if (has("embedding") || has("gather") || has("distribution")) return "other";
  return "elementwise";
}

class PyTorchFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(PyTorchFixture, CategoryTotalsEqualIndependentSums) {
  const std::string path = kDir + GetParam();
  const json j = load_json(path);
  std::map<std::string, std::pair<int64_t, int64_t>> expected;  // category -> count, ns
  int64_t all_ns = 0, first = INT64_MAX, last = 0;
  for (const json& e : events_of(j)) {
    if (!is_gpu(e)) continue;
    auto& [count, total] = expected[expected_category(e)];
    ++count;
    total += ns(e["dur"]);
    all_ns += ns(e["dur"]);
    first = std::min(first, ns(e["ts"]));
    last = std::max(last, ns(e["ts"]) + ns(e["dur"]));
  }
  ASSERT_FALSE(expected.empty());
  TraceData d = TraceData::load(path, false);
  Table t = categories_table(d);
  ASSERT_EQ(t.rows.size(), expected.size() + 1);  // + total
  for (size_t r = 0; r + 1 < t.rows.size(); ++r) {
    const std::string cat = t.text(r, "category");
    ASSERT_TRUE(expected.count(cat)) << cat;
    EXPECT_EQ(t.number(r, "count").value(), expected[cat].first) << cat;
    EXPECT_NEAR(t.number(r, "total_ms").value(), expected[cat].second / 1e6, 1e-6) << cat;
  }
  EXPECT_NEAR(t.number(t.rows.size() - 1, "total_ms").value(), all_ns / 1e6, 1e-6);
  EXPECT_TRUE(unclassified_table(d).rows.empty());
  // The timeline spans first start to last end and its parts add up.
  auto timeline = gpu_timeline(d);
  ASSERT_EQ(timeline.size(), 1u);
  const TimelineBreakdown& b = timeline[0];
  EXPECT_NEAR(b.total, last - first, 2);
  EXPECT_EQ(b.computation + b.exposed_comm + b.exposed_memcpy + b.idle, b.total);
}

TEST_P(PyTorchFixture, GemmShapesMatchRecordShapes) {
  const std::string path = kDir + GetParam();
  const json j = load_json(path);
  std::map<int64_t, json> ops;  // External id -> cpu_op
  for (const json& e : events_of(j)) {
    if (e.value("cat", "") == "cpu_op" && e["args"].contains("External id")) {
      ops[e["args"]["External id"].get<int64_t>()] = e;
    }
  }
  std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> expected;  // (M, N, K) -> calls
  for (const json& e : events_of(j)) {
    if (!is_gpu(e) || std::string(e["name"]).rfind("nvjet", 0) != 0) continue;
    const json& op = ops.at(e["args"]["External id"].get<int64_t>());
    ASSERT_EQ(op["name"], "aten::mm");
    const json& dims = op["args"]["Input Dims"];
    ++expected[{dims[0][0].get<int64_t>(), dims[1][1].get<int64_t>(), dims[0][1].get<int64_t>()}];
  }
  Table t = gemm_table(TraceData::load(path, false), find_gpu_spec("H200"));
  std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> got;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    EXPECT_EQ(t.text(r, "dtype"), "bf16");
    got[{static_cast<int64_t>(t.number(r, "M").value()),
         static_cast<int64_t>(t.number(r, "N").value()),
         static_cast<int64_t>(t.number(r, "K").value())}] +=
        static_cast<int64_t>(t.number(r, "count").value());
  }
  EXPECT_EQ(got, expected);
}

// The launching op of every GPU event: its own External id, else its launch's.
std::map<int64_t, int64_t> external_of_correlation(const json& j) {
  std::map<int64_t, int64_t> out;
  for (const json& e : events_of(j)) {
    const std::string cat = e.value("cat", "");
    if ((cat == "cuda_runtime" || cat == "cuda_driver") && e["args"].contains("External id")) {
      out[e["args"]["correlation"].get<int64_t>()] = e["args"]["External id"].get<int64_t>();
    }
  }
  return out;
}

int64_t external_id(const json& gpu_event, const std::map<int64_t, int64_t>& by_correlation) {
  const json& a = gpu_event["args"];
  if (a.contains("External id")) return a["External id"].get<int64_t>();
  auto it = by_correlation.find(a.value("correlation", int64_t{-1}));
  return it == by_correlation.end() ? -1 : it->second;
}

// TraceLens's grouping, done here on the JSON document: the op that launched each non-NCCL GPU
// event, the union of its events' intervals, grouped by (name, pid, tid, Input Dims, Input
// type, Input Strides, Concrete Inputs).
TEST_P(PyTorchFixture, OpsUniqueArgsEqualAnIndependentGroupBy) {
  const std::string path = kDir + GetParam();
  const json j = load_json(path);
  std::map<int64_t, json> ops;
  for (const json& e : events_of(j)) {
    if (e.value("cat", "") == "cpu_op" && e["args"].contains("External id")) {
      ops[e["args"]["External id"].get<int64_t>()] = e;
    }
  }
  const auto by_correlation = external_of_correlation(j);
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> intervals;  // per op instance
  for (const json& e : events_of(j)) {
    if (!is_gpu(e) || std::string(e["name"]).find("nccl") != std::string::npos) continue;
    const int64_t ext = external_id(e, by_correlation);
    ASSERT_TRUE(ops.count(ext)) << e["name"];
    intervals[ext].emplace_back(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]));
  }
  std::map<std::string, std::vector<int64_t>> groups;  // key -> busy time per call
  for (auto& [ext, v] : intervals) {
    std::sort(v.begin(), v.end());
    int64_t busy = 0, end = INT64_MIN;
    for (const auto& [a, b] : v) {
      busy += std::max<int64_t>(0, b - std::max(a, end));
      end = std::max(end, b);
    }
    const json& op = ops.at(ext);
    const json& args = op["args"];
    const std::string key =
        json({op["name"], op["pid"], op["tid"], args.value("Input Dims", json()),
              args.value("Input type", json()), args.value("Input Strides", json()),
              args.value("Concrete Inputs", json())})
            .dump();
    groups[key].push_back(busy);
  }
  int64_t whole = 0;
  std::multiset<std::tuple<std::string, int64_t, int64_t>> expected, got;  // name, count, ns
  for (const auto& [key, busy] : groups) {
    int64_t total = 0;
    for (int64_t b : busy) total += b;
    whole += total;
    expected.insert({json::parse(key)[0], static_cast<int64_t>(busy.size()), total});
  }
  const Table t = ops_unique_args_table(TraceData::load(path, false));
  ASSERT_EQ(t.rows.size(), groups.size());
  double share = 0;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    got.insert({t.text(r, "name"), static_cast<int64_t>(t.number(r, "count").value()),
                std::llround(t.number(r, "total_ms").value() * 1e6)});
    share += t.number(r, "share_pct").value();
    if (r > 0) EXPECT_GE(t.number(r - 1, "total_ms").value(), t.number(r, "total_ms").value());
  }
  EXPECT_EQ(got, expected);
  EXPECT_NEAR(share, 100, 1e-9);
}

// Bytes from record_shapes, recomputed here for the rules that are exact: copy_ reads its
// source and writes its destination; a Triton kernel touches each tensor argument once.
TEST_P(PyTorchFixture, BandwidthFromRecordShapes) {
  const std::string path = kDir + GetParam();
  const json j = load_json(path);
  std::set<std::string> categories = {"elementwise", "reduction", "normalization",
                                      "optimizer",   "memcpy",    "memset"};
  const auto by_correlation = external_of_correlation(j);
  std::set<int64_t> calls;
  int64_t lone = 0, total_ns = 0;
  for (const json& e : events_of(j)) {
    if (!is_gpu(e) || !categories.count(expected_category(e))) continue;
    const int64_t ext = external_id(e, by_correlation);
    ext < 0 ? ++lone : (calls.insert(ext), 0);
    total_ns += ns(e["dur"]);
  }
  const Table t = bandwidth_table(TraceData::load(path, false), find_gpu_spec("H200"));
  auto element_size = [](const std::string& type) {
    static const std::map<std::string, int> sizes = {
        {"float", 4}, {"c10::BFloat16", 2}, {"c10::Half", 2}, {"long int", 8}, {"int", 4}};
    auto it = sizes.find(type);
    return it == sizes.end() ? 0 : it->second;
  };
  int64_t count = 0, checked = 0;
  double total_ms = 0;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    count += static_cast<int64_t>(t.number(r, "count").value());
    total_ms += t.number(r, "total_ms").value();
    const std::string op = t.text(r, "op");
    if (t.text(r, "category") == "memcpy" || t.text(r, "category") == "memset") {
      // The event's own byte count; device to device reads and writes it.
      const double bytes = json::parse(t.text(r, "args"))["bytes"].get<double>();
      const bool dtod = t.text(r, "kernel").find("DtoD") != std::string::npos;
      EXPECT_DOUBLE_EQ(t.number(r, "mbytes").value(), (dtod ? 2 : 1) * bytes / 1e6)
          << t.text(r, "kernel");
      continue;
    }
    if (op != "aten::copy_" && op.rfind("triton_", 0) != 0) continue;
    const json dims = json::parse(t.text(r, "input_dims"));
    const json types = json::parse(t.text(r, "input_type"));
    double bytes = 0;
    for (size_t i = 0; i < types.size(); ++i) {
      double n = 1;
      for (const json& d : dims[i]) n *= d.get<double>();
      bytes += n * element_size(types[i]);
    }
    EXPECT_NEAR(t.number(r, "mbytes").value(), bytes / 1e6, 1e-12) << op;
    EXPECT_NEAR(t.number(r, "gbps").value(), bytes / (t.number(r, "mean_us").value() / 1e6) / 1e9,
                1e-6)
        << op;
    EXPECT_NEAR(t.number(r, "hbm_pct").value(), t.number(r, "gbps").value() / 48, 1e-9)
        << op;  // H200: 4.8 TB/s
    ++checked;
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(count, static_cast<int64_t>(calls.size()) + lone);  // every call, derived or not
  EXPECT_NEAR(total_ms, total_ns / 1e6, 1e-9);
  // Fused AdamW takes tensor lists, which carry no element type: listed, with the reason.
  bool adamw = false;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    if (t.text(r, "op") != "aten::_fused_adamw_") continue;
    adamw = true;
    EXPECT_EQ(t.text(r, "bytes_basis"),
              "not derived: argument 0 is a TensorList, which the trace gives no element type for");
  }
  EXPECT_TRUE(adamw);
}

INSTANTIATE_TEST_SUITE_P(Traces, PyTorchFixture,
                         ::testing::Values("torch_gpu_step.pt.trace.json.gz",
                                           "torch_compiled_step.pt.trace.json.gz",
                                           "ddp/rank-0.pt.trace.json.gz",
                                           "ddp/rank-1.pt.trace.json.gz"));

TEST(PyTorchFixtures, AttentionShapesFromCudnnOps) {
  TraceData d = TraceData::load(kDir + "torch_gpu_step.pt.trace.json.gz", false);
  Table t = attention_table(d, find_gpu_spec("H200"));
  ASSERT_EQ(t.rows.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(t.number(r, "B").value(), 2);
    EXPECT_EQ(t.number(r, "H").value(), 4);
    EXPECT_EQ(t.number(r, "KV").value(), 2);
    EXPECT_EQ(t.number(r, "T").value(), 128);
    EXPECT_EQ(t.number(r, "D").value(), 64);
    EXPECT_EQ(t.text(r, "causal"), "true");
    EXPECT_EQ(t.number(r, "count").value(), 1);
  }
}

TEST(PyTorchFixtures, DdpCollectivesAndRankSkew) {
  // Independent: NCCL kernel starts, sizes and durations per rank.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> starts(2);  // (start, elements)
  for (int r = 0; r < 2; ++r) {
    const json j = load_json(kDir + "ddp/rank-" + std::to_string(r) + ".pt.trace.json.gz");
    ASSERT_EQ(j["distributedInfo"]["rank"], r);
    for (const json& e : events_of(j)) {
      if (is_gpu(e) && std::string(e["name"]).find("nccl") != std::string::npos) {
        starts[r].emplace_back(ns(e["ts"]), e["args"]["In msg nelems"].get<int64_t>());
      }
    }
    std::sort(starts[r].begin(), starts[r].end());
  }
  ASSERT_EQ(starts[0].size(), 2u);
  ASSERT_EQ(starts[1].size(), 2u);

  Report report = ranks_report(kDir + "ddp", false);
  const Table* skew = report.find("collective_skew");
  ASSERT_NE(skew, nullptr);
  ASSERT_EQ(skew->rows.size(), 2u);
  std::set<std::pair<int64_t, double>> expected, got;
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(starts[0][k].second, starts[1][k].second);
    expected.insert({starts[0][k].second * 4,  // fp32 gradients
                     std::llabs(starts[0][k].first - starts[1][k].first) / 1e3});
    got.insert({static_cast<int64_t>((*skew).number(k, "bytes").value()),
                (*skew).number(k, "start_skew_us").value()});
    EXPECT_EQ((*skew).text(k, "collective"), "all_reduce");
  }
  ASSERT_EQ(got.size(), expected.size());
  for (auto g = got.begin(), e = expected.begin(); g != got.end(); ++g, ++e) {
    EXPECT_EQ(g->first, e->first);
    EXPECT_NEAR(g->second, e->second, 0.002);
  }
  const Table* ranks = report.find("ranks");
  ASSERT_EQ(ranks->rows.size(), 2u);
  EXPECT_EQ((*ranks).number(1, "rank").value(), 1);
  EXPECT_EQ((*ranks).number(0, "collectives").value(), 2);
}

TEST(PyTorchFixtures, LegacyCpuTraceOpsEqualIndependentSums) {
  const std::string path = kDir + "torch_cpu_legacy.pt.trace.json.gz";
  const json j = load_json(path);
  ASSERT_TRUE(j.is_array());  // the pre-Kineto format: a bare array, no "cat"
  std::map<std::string, std::pair<int64_t, int64_t>> expected;
  for (const json& e : j) {
    auto& [calls, total] = expected[e["name"]];
    ++calls;
    total += ns(e["dur"]);
  }
  TraceData d = TraceData::load(path, false);
  EXPECT_TRUE(d.gpu.empty());
  Report report = build_report(d, {});
  const Table* ops = report.find("ops");
  ASSERT_NE(ops, nullptr);
  ASSERT_EQ(ops->rows.size(), expected.size());
  for (size_t r = 0; r < ops->rows.size(); ++r) {
    const auto& [calls, total] = expected.at((*ops).text(r, "op"));
    EXPECT_EQ((*ops).number(r, "calls").value(), calls);
    EXPECT_NEAR((*ops).number(r, "cpu_total_ms").value(), total / 1e6, 1e-9);
  }
  EXPECT_FALSE(report.warnings.empty());  // "no GPU activity"
}

}  // namespace
}  // namespace tessera::analysis
