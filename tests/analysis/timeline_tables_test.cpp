// GPU timeline (TraceLens definitions) and the kernel tables on a hand-built trace whose
// answers are worked out in the comments.
#include <gtest/gtest.h>

#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/timeline.h"
#include "tessera/analysis/trace_data.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::test_dir;
using testing::TraceBuilder;

// Device 0, in µs:
//   [0,10)  GEMM (stream 7)          [5,15) elementwise (stream 8): overlapping compute
//   [12,30) NCCL all-reduce: overlaps compute on [12,15) -> exposed comm 15
//   [28,35) memcpy: overlaps comm on [28,30) -> exposed memcpy 5
//   [35,50) idle   [50,52) memset (compute)   [52,60) rmsnorm   [60,70) idle
//   [70,71) unclassified kernel
//   total 71, busy 35 + 10 + 1 = 46, idle 25, computation 15 + 10 + 1 = 26
// Device 1: one GEMM [100,110).
TraceData build(const std::filesystem::path& dir) {
  TraceBuilder b(dir);
  b.cpu_op("aten::linear", 0, 50, {{"External id", 10}})
      .cpu_op("aten::mm", 1, 20, {{"External id", 1}})  // nested in aten::linear
      .cpu_op("aten::add", 22, 5, {{"External id", 2}})
      .runtime(23, 502, 2)
      .kernel("nvjet_sm90_a", 0, 10, {{"External id", 1}, {"correlation", 501}})
      .kernel("void at::native::vectorized_elementwise_kernel<4, add>", 5, 10,
              {{"correlation", 502}}, 0, 8)  // linked through the runtime call only
      .kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 12, 18, {}, 0, 20)
      .memcpy(28, 7)
      .memset(50, 2)
      .kernel("rmsnorm_forward_kernel", 52, 8)
      .kernel("mystery_kernel", 70, 1)
      .kernel("nvjet_sm90_b", 100, 10, {}, 1);
  return TraceData::load(b.write("t.json"), false);
}

double cell(const Table& t, size_t row, const char* column) {
  const Cell& c = t.rows[row][t.column(column)];
  if (auto* i = std::get_if<int64_t>(&c)) return static_cast<double>(*i);
  return std::get<double>(c);
}

size_t find_row(const Table& t, const std::string& key, const char* column) {
  for (size_t r = 0; r < t.rows.size(); ++r) {
    if (std::get<std::string>(t.rows[r][t.column(column)]) == key) return r;
  }
  ADD_FAILURE() << "no row " << key << " in " << t.name;
  return 0;
}

TEST(Intervals, MergeAndSubtract) {
  auto merged = merge_intervals({{5, 10}, {0, 3}, {3, 4}, {8, 12}, {20, 21}});
  EXPECT_EQ(merged, (std::vector<Interval>{{0, 4}, {5, 12}, {20, 21}}));
  auto rest = subtract_intervals({{0, 10}, {20, 30}}, {{2, 3}, {5, 22}, {25, 26}, {40, 50}});
  EXPECT_EQ(rest, (std::vector<Interval>{{0, 2}, {3, 5}, {22, 25}, {26, 30}}));
  EXPECT_EQ(total_length(rest), 2 + 2 + 3 + 4);
  EXPECT_TRUE(subtract_intervals({{0, 5}}, {{0, 5}}).empty());
}

TEST(GpuTimeline, TraceLensBreakdownPerDevice) {
  TraceData d = build(test_dir());
  auto timeline = gpu_timeline(d);
  ASSERT_EQ(timeline.size(), 2u);
  const TimelineBreakdown& t = timeline[0];
  EXPECT_EQ(t.device, 0);
  EXPECT_EQ(t.total, 71000);
  EXPECT_EQ(t.busy, 46000);
  EXPECT_EQ(t.idle, 25000);
  EXPECT_EQ(t.computation, 26000);
  EXPECT_EQ(t.exposed_comm, 15000);
  EXPECT_EQ(t.exposed_memcpy, 5000);
  EXPECT_EQ(t.total_comm, 18000);
  EXPECT_EQ(t.total_memcpy, 7000);
  EXPECT_EQ(t.computation + t.exposed_comm + t.exposed_memcpy + t.idle, t.total);
  EXPECT_EQ(timeline[1].device, 1);
  EXPECT_EQ(timeline[1].total, 10000);
  EXPECT_EQ(timeline[1].idle, 0);

  Table table = gpu_timeline_table(timeline);
  EXPECT_EQ(table.rows.size(), 16u);
  EXPECT_DOUBLE_EQ(cell(table, 1, "time_ms"), 0.015);  // exposed_comm of device 0
  EXPECT_NEAR(cell(table, 1, "percent"), 100.0 * 15 / 71, 1e-9);
}

TEST(KernelTables, CategoriesCountTimeMedianShare) {
  TraceData d = build(test_dir());
  Table t = categories_table(d);
  const double total_us = 10 + 10 + 18 + 7 + 2 + 8 + 1 + 10;
  size_t gemm = find_row(t, "GEMM", "category");
  EXPECT_EQ(cell(t, gemm, "count"), 2);
  EXPECT_DOUBLE_EQ(cell(t, gemm, "total_ms"), 0.020);
  EXPECT_DOUBLE_EQ(cell(t, gemm, "median_us"), 10);
  EXPECT_NEAR(cell(t, gemm, "share_pct"), 100 * 20 / total_us, 1e-9);
  EXPECT_EQ(cell(t, find_row(t, "communication", "category"), "count"), 1);
  EXPECT_EQ(cell(t, find_row(t, "memcpy", "category"), "count"), 1);
  EXPECT_EQ(cell(t, find_row(t, "memset", "category"), "count"), 1);
  EXPECT_EQ(cell(t, find_row(t, "normalization", "category"), "count"), 1);
  EXPECT_EQ(cell(t, find_row(t, "elementwise", "category"), "count"), 1);
  EXPECT_EQ(cell(t, find_row(t, "unclassified", "category"), "count"), 1);
  size_t total = find_row(t, "total", "category");
  EXPECT_EQ(total, t.rows.size() - 1);
  EXPECT_EQ(cell(t, total, "count"), 8);
  EXPECT_DOUBLE_EQ(cell(t, total, "total_ms"), total_us / 1000);
  EXPECT_DOUBLE_EQ(cell(t, total, "min_us"), 1);
  EXPECT_DOUBLE_EQ(cell(t, total, "max_us"), 18);
  double shares = 0;
  for (size_t r = 0; r + 1 < t.rows.size(); ++r) shares += cell(t, r, "share_pct");
  EXPECT_NEAR(shares, 100, 1e-9);
}

TEST(KernelTables, KernelsTopKUnclassifiedAndHistogram) {
  TraceData d = build(test_dir());
  Table kernels = kernels_table(d);
  EXPECT_EQ(kernels.rows.size(), 8u);
  size_t add = find_row(kernels, "void at::native::vectorized_elementwise_kernel<4, add>", "name");
  EXPECT_EQ(std::get<std::string>(kernels.rows[add][kernels.column("op")]), "aten::add");
  size_t mm = find_row(kernels, "nvjet_sm90_a", "name");
  EXPECT_EQ(std::get<std::string>(kernels.rows[mm][kernels.column("op")]), "aten::mm");
  EXPECT_EQ(std::get<std::string>(kernels.rows[mm][kernels.column("rule")]),
            "kernel starts with 'nvjet'");

  Table top = top_kernels_table(kernels, 2);
  ASSERT_EQ(top.rows.size(), 2u);
  EXPECT_EQ(std::get<std::string>(top.rows[0][0]), "ncclDevKernel_AllReduce_Sum_bf16_RING_LL");

  Table unclassified = unclassified_table(d);
  ASSERT_EQ(unclassified.rows.size(), 1u);
  EXPECT_EQ(std::get<std::string>(unclassified.rows[0][0]), "mystery_kernel");

  // Kernels only: 1 (<5), 8 (5-10), 10, 10, 18, 10 (10-50).
  Table h = short_kernels_table(d);
  ASSERT_EQ(h.rows.size(), 5u);
  EXPECT_EQ(cell(h, 0, "count"), 1);
  EXPECT_EQ(cell(h, 1, "count"), 1);
  EXPECT_EQ(cell(h, 2, "count"), 4);
  EXPECT_EQ(cell(h, 3, "count"), 0);
  EXPECT_EQ(cell(h, 4, "count"), 0);
  EXPECT_DOUBLE_EQ(cell(h, 2, "total_ms"), 0.048);
  EXPECT_EQ(std::get<std::string>(h.rows[0][0]), "<5 us");
  EXPECT_EQ(std::get<std::string>(h.rows[4][0]), ">=100 us");
}

TEST(KernelTables, OpsCountNestedOpsInclusively) {
  TraceData d = build(test_dir());
  Table ops = ops_table(d);
  size_t linear = find_row(ops, "aten::linear", "op");
  size_t mm = find_row(ops, "aten::mm", "op");
  EXPECT_DOUBLE_EQ(cell(ops, linear, "cpu_total_ms"), 0.050);
  EXPECT_DOUBLE_EQ(cell(ops, mm, "cpu_total_ms"), 0.020);
  // GPU time goes to the innermost (launching) op only.
  EXPECT_EQ(cell(ops, linear, "gpu_kernels"), 0);
  EXPECT_EQ(cell(ops, mm, "gpu_kernels"), 1);
  EXPECT_DOUBLE_EQ(cell(ops, mm, "gpu_total_ms"), 0.010);
  EXPECT_EQ(cell(ops, find_row(ops, "aten::add", "op"), "gpu_kernels"), 1);
}

}  // namespace
}  // namespace tessera::analysis
