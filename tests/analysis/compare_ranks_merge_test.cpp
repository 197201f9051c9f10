// --compare joins, --ranks skew and stragglers, and `trace merge` on hand-built traces.
#include <zlib.h>

#include <gtest/gtest.h>

#include <set>

#include "tessera/analysis/compare.h"
#include "tessera/analysis/ranks.h"
#include "tessera/analysis/trace_merge.h"
#include "tessera/core/error.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::json;
using testing::test_dir;
using testing::TraceBuilder;

Table small_table(std::vector<std::vector<Cell>> rows) {
  Table t;
  t.name = "categories";
  t.columns = {{"category", true}, {"count"}, {"total_ms"}, {"note"}};
  t.rows = std::move(rows);
  return t;
}

TEST(Compare, JoinsRowsOnKeysWithDiffAndPct) {
  Table a = small_table({{std::string("GEMM"), int64_t{10}, 4.0, std::string("a")},
                         {std::string("memcpy"), int64_t{2}, 0.0, std::string("a")},
                         {std::string("only_a"), int64_t{1}, 1.0, std::string("a")}});
  Table b = small_table({{std::string("memcpy"), int64_t{3}, 0.5, std::string("b")},
                         {std::string("GEMM"), int64_t{12}, 3.0, std::string("b")},
                         {std::string("only_b"), int64_t{5}, 2.0, std::string("b")}});
  Table c = compare_tables(a, b);
  std::vector<std::string> names;
  for (const Column& col : c.columns) names.push_back(col.name);
  EXPECT_EQ(names, (std::vector<std::string>{"category", "count_a", "count_b", "count_diff",
                                             "count_pct", "total_ms_a", "total_ms_b",
                                             "total_ms_diff", "total_ms_pct", "note"}));
  ASSERT_EQ(c.rows.size(), 4u);
  // GEMM: 10 -> 12 (+2, +20%), 4 -> 3 ms (-1, -25%).
  EXPECT_EQ(std::get<std::string>(c.rows[0][0]), "GEMM");
  EXPECT_DOUBLE_EQ(std::get<double>(c.rows[0][3]), 2);
  EXPECT_DOUBLE_EQ(std::get<double>(c.rows[0][4]), 20);
  EXPECT_DOUBLE_EQ(std::get<double>(c.rows[0][7]), -1);
  EXPECT_DOUBLE_EQ(std::get<double>(c.rows[0][8]), -25);
  EXPECT_EQ(std::get<std::string>(c.rows[0][9]), "a");
  // memcpy: a = 0 ms -> no percentage.
  EXPECT_TRUE(std::holds_alternative<std::monostate>(c.rows[1][8]));
  // Rows present on one side only keep the other side empty.
  EXPECT_EQ(std::get<std::string>(c.rows[2][0]), "only_a");
  EXPECT_TRUE(std::holds_alternative<std::monostate>(c.rows[2][2]));
  EXPECT_EQ(std::get<std::string>(c.rows[3][0]), "only_b");
  EXPECT_TRUE(std::holds_alternative<std::monostate>(c.rows[3][1]));
  EXPECT_EQ(std::get<std::string>(c.rows[3][9]), "b");
}

TEST(Ranks, RankIdsFromFileNames) {
  EXPECT_EQ(rank_from_filename("rank-3.json"), 3);
  EXPECT_EQ(rank_from_filename("ddp_rank_12.pt.trace.json.gz"), 12);
  EXPECT_EQ(rank_from_filename("RANK7.json"), 7);
  EXPECT_FALSE(rank_from_filename("ranking.json").has_value());
  EXPECT_FALSE(rank_from_filename("trace.json").has_value());
}

// Three ranks, two all-reduces each (µs):
//   occurrence 0 starts r0 100, r1 130, r2 110; lasts 50, 20, 40 -> skew 30, last r1,
//     waits r0 30, r2 20 (50 caused by r1), spread 30
//   occurrence 1 starts r0 300, r1 305, r2 340; lasts 60, 55, 20 -> skew 40, last r2,
//     waits r0 40, r1 35 (75 caused by r2), spread 40
// rank 2 also runs an all-gather nobody else does: unmatched, reported.
json allreduce_args(int group_size) {
  return {{"Collective name", "allreduce"}, {"In msg nelems", 1000}, {"Out msg nelems", 1000},
          {"Group size", group_size},       {"dtype", "BFloat16"},   {"Process Group Name", "0"}};
}

void write_rank_traces(const std::filesystem::path& dir) {
  const double starts[3][2] = {{100, 300}, {130, 305}, {110, 340}};
  const double durs[3][2] = {{50, 60}, {20, 55}, {40, 20}};
  const char* files[3] = {"rank-0.json", "rank_1.json", "worker.json"};
  for (int r = 0; r < 3; ++r) {
    TraceBuilder b(dir);
    b.kernel("nvjet_x", 0, 90);
    for (int k = 0; k < 2; ++k) {
      b.kernel("ncclDevKernel_AllReduce_Sum_bf16", starts[r][k], durs[r][k], allreduce_args(3), 0,
               20);
    }
    if (r == 2) {
      b.kernel("ncclDevKernel_AllGather", 500, 5, {}, 0, 20);
      b.member("distributedInfo", {{"rank", 2}, {"world_size", 3}});  // no rank in its name
    }
    b.write(files[r]);
  }
}

double num(const Table& t, size_t row, const char* column) {
  const Cell& c = t.rows[row][t.column(column)];
  if (auto* i = std::get_if<int64_t>(&c)) return static_cast<double>(*i);
  return std::get<double>(c);
}

TEST(Ranks, SkewAndStragglers) {
  const auto dir = test_dir();
  write_rank_traces(dir);
  Report r = ranks_report(dir.string(), false);
  const Table* skew = r.find("collective_skew");
  ASSERT_EQ(skew->rows.size(), 2u);
  // Largest skew first.
  EXPECT_DOUBLE_EQ(num(*skew, 0, "start_skew_us"), 40);
  EXPECT_DOUBLE_EQ(num(*skew, 0, "dur_spread_us"), 40);
  EXPECT_EQ(num(*skew, 0, "last_rank"), 2);
  EXPECT_EQ(num(*skew, 0, "first_rank"), 0);
  EXPECT_EQ(num(*skew, 0, "bytes"), 2000);
  EXPECT_DOUBLE_EQ(num(*skew, 1, "start_skew_us"), 30);
  EXPECT_EQ(num(*skew, 1, "last_rank"), 1);
  EXPECT_DOUBLE_EQ(num(*skew, 1, "first_start_ms"), 0);

  const Table* st = r.find("stragglers");
  ASSERT_EQ(st->rows.size(), 3u);
  EXPECT_EQ(num(*st, 0, "times_last"), 0);
  EXPECT_EQ(num(*st, 1, "times_last"), 1);
  EXPECT_EQ(num(*st, 2, "times_last"), 1);
  EXPECT_DOUBLE_EQ(num(*st, 1, "caused_wait_ms"), 0.050);
  EXPECT_DOUBLE_EQ(num(*st, 2, "caused_wait_ms"), 0.075);
  EXPECT_DOUBLE_EQ(num(*st, 0, "waited_ms"), 0.070);
  EXPECT_DOUBLE_EQ(num(*st, 1, "waited_ms"), 0.035);
  EXPECT_DOUBLE_EQ(num(*st, 2, "waited_ms"), 0.020);

  const Table* summary = r.find("skew_summary");
  ASSERT_EQ(summary->rows.size(), 1u);
  EXPECT_DOUBLE_EQ(num(*summary, 0, "mean_skew_us"), 35);
  EXPECT_DOUBLE_EQ(num(*summary, 0, "max_skew_us"), 40);
  EXPECT_DOUBLE_EQ(num(*summary, 0, "total_wait_ms"), 0.125);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("1 collective kernels could not be matched"), std::string::npos);
}

// With a "seq" arg on every collective, occurrences match by seq, not by their count: rank 1's
// extra all-reduce (seq 0) is unmatched instead of shifting every later pair.
TEST(Ranks, SeqIdsMatchOccurrencesAcrossRanks) {
  const auto dir = test_dir();
  const std::vector<std::vector<std::pair<int, double>>> seq_starts = {
      {{1, 100}, {2, 300}}, {{0, 50}, {1, 110}, {2, 320}}};
  for (int r = 0; r < 2; ++r) {
    TraceBuilder b(dir);
    for (const auto& [seq, start] : seq_starts[r]) {
      json args = allreduce_args(2);
      args["seq"] = seq;
      b.kernel("ncclDevKernel_AllReduce_Sum_bf16", start, 10, args, 0, 20);
    }
    b.write("rank-" + std::to_string(r) + ".json");
  }
  const Report r = ranks_report(dir.string(), false);
  const Table* skew = r.find("collective_skew");
  ASSERT_EQ(skew->rows.size(), 2u);
  EXPECT_EQ(num(*skew, 0, "index"), 2);
  EXPECT_DOUBLE_EQ(num(*skew, 0, "start_skew_us"), 20);
  EXPECT_EQ(num(*skew, 1, "index"), 1);
  EXPECT_DOUBLE_EQ(num(*skew, 1, "start_skew_us"), 10);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("1 collective kernels could not be matched"), std::string::npos);
}

// Four ranks as Tessera's recorder names their groups: two tensor-parallel pairs, "tp:0"
// (ranks 0, 1) and "tp:2" (ranks 2, 3), each with its own sequence numbers, then one all-reduce
// over the world. Each occurrence matches within its group's ranks, none is unmatched, and the
// waits name who waited for whom (µs):
//   tp:0 seq 0: r0 100, r1 130 -> r0 waited 30 for r1;   tp:2 seq 0: r2 100, r3 110 -> r2 10 for r3
//   world seq 0: r0 500, r1 520, r2 560, r3 540 -> r0 60, r1 40, r3 20 for r2
TEST(Ranks, SubGroupsMatchWithinTheirRanksAndWaitsNameWhoWaitedForWhom) {
  const auto dir = test_dir();
  const double tp_start[4] = {100, 130, 100, 110}, world_start[4] = {500, 520, 560, 540};
  for (int r = 0; r < 4; ++r) {
    TraceBuilder b(dir);
    const std::string tp = r < 2 ? "tp:0" : "tp:2";
    b.kernel("ncclDevKernel_AllReduce_Sum_bf16", tp_start[r], 10,
             {{"collective", "all_reduce"}, {"process_group", tp}, {"group_size", 2},
              {"seq", 0}, {"bytes", 4096}, {"dtype", "bf16"}},
             0, 20);
    b.kernel("ncclDevKernel_AllReduce_Sum_f32", world_start[r], 10,
             {{"collective", "all_reduce"}, {"process_group", "world"}, {"group_size", 4},
              {"seq", 0}, {"bytes", 8192}, {"dtype", "fp32"}},
             0, 20);
    b.write("rank-" + std::to_string(r) + ".json");
  }
  const Report r = ranks_report(dir.string(), false);
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  const Table* skew = r.find("collective_skew");
  ASSERT_EQ(skew->rows.size(), 3u);
  EXPECT_DOUBLE_EQ(num(*skew, 0, "start_skew_us"), 60);  // the world's
  EXPECT_EQ(num(*skew, 0, "ranks"), 4);
  EXPECT_DOUBLE_EQ(num(*skew, 1, "start_skew_us"), 30);  // tp:0
  EXPECT_EQ(num(*skew, 1, "ranks"), 2);
  EXPECT_EQ(num(*skew, 1, "last_rank"), 1);

  const Table* waits = r.find("waits");
  ASSERT_NE(waits, nullptr);
  std::vector<std::tuple<int, int, int, double>> got;  // rank, waited_for, times, wait_ms
  for (size_t i = 0; i < waits->rows.size(); ++i)
    got.emplace_back(num(*waits, i, "rank"), num(*waits, i, "waited_for"),
                     num(*waits, i, "times"), num(*waits, i, "wait_ms"));
  const std::vector<std::tuple<int, int, int, double>> want = {
      {0, 2, 1, 0.060}, {1, 2, 1, 0.040}, {0, 1, 1, 0.030}, {3, 2, 1, 0.020}, {2, 3, 1, 0.010}};
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(std::get<0>(got[i]), std::get<0>(want[i])) << i;
    EXPECT_EQ(std::get<1>(got[i]), std::get<1>(want[i])) << i;
    EXPECT_EQ(std::get<2>(got[i]), std::get<2>(want[i])) << i;
    EXPECT_NEAR(std::get<3>(got[i]), std::get<3>(want[i]), 1e-9) << i;
  }
  bool named = false;
  for (const auto& [key, value] : r.info)
    named = named || (key == "longest wait" &&
                      value == "rank 0 waited 0.060 ms for rank 2 over 1 collectives");
  EXPECT_TRUE(named);
}

// Kernels of a non-blocking NCCL communicator may be launched outside the span of the op that
// asked for them, so they carry no args: the k-th collective op of a rank ("nccl:all_reduce"
// with a group and sequence number) describes its k-th communication kernel in launch order.
TEST(Ranks, CollectiveOpsDescribeTheirUnlinkedKernelsInLaunchOrder) {
  const auto dir = test_dir();
  const double starts[2][2] = {{100, 300}, {130, 310}};
  for (int r = 0; r < 2; ++r) {
    TraceBuilder b(dir);
    b.cpu_op("nccl:all_reduce", 90, 2,
             {{"External id", 1}, {"collective", "all_reduce"}, {"process_group", "tp:0"},
              {"group_size", 2}, {"seq", 0}, {"bytes", 4096}, {"dtype", "bf16"}});
    b.cpu_op("nccl:all_gather", 95, 2,
             {{"External id", 2}, {"collective", "all_gather"}, {"process_group", "tp:0"},
              {"group_size", 2}, {"seq", 1}, {"bytes", 8192}, {"dtype", "bf16"}});
    // Launched in op order; the all-gather's stream runs it later.
    b.kernel("ncclDevKernel_AllReduce_Sum_bf16", starts[r][0], 10, {{"correlation", 7}}, 0, 20);
    b.kernel("ncclDevKernel_AllGather_RING_LL", starts[r][1], 10, {{"correlation", 8}}, 0, 21);
    b.write("rank-" + std::to_string(r) + ".json");
  }
  const Report r = ranks_report(dir.string(), false);
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  const Table* skew = r.find("collective_skew");
  ASSERT_EQ(skew->rows.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(std::get<std::string>(skew->rows[i][skew->column("process_group")]), "tp:0");
  EXPECT_DOUBLE_EQ(num(*skew, 0, "start_skew_us"), 30);  // the all-reduce
  EXPECT_EQ(num(*skew, 0, "bytes"), 4096);
  EXPECT_EQ(num(*skew, 1, "index"), 1);  // matched by sequence number
}

TEST(Ranks, FilesWithoutRankIdAreDataErrors) {
  const auto dir = test_dir();
  TraceBuilder(dir).kernel("k", 0, 1).write("anonymous.json");
  EXPECT_THROW(ranks_report(dir.string(), false), DataError);
  EXPECT_THROW(ranks_report((dir / "nope").string(), false), DataError);
}

json read_json(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files too
  std::string text;
  char buf[4096];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) text.append(buf, n);
  gzclose(f);
  return json::parse(text);
}

TEST(TraceMerge, RemapsPidsAndFlowIdsPerRank) {
  const auto dir = test_dir();
  std::filesystem::create_directories(dir / "in");
  for (int r = 0; r < 2; ++r) {
    TraceBuilder b(dir / "in");
    b.add({{"name", "process_name"},
           {"ph", "M"},
           {"pid", 0},
           {"tid", 0},
           {"args", {{"name", "python"}}}})
        .add({{"name", "process_sort_index"},
              {"ph", "M"},
              {"pid", 0},
              {"tid", 0},
              {"args", {{"sort_index", 5}}}})
        .kernel("k", 10 + r, 5)    // pid 0 on both ranks
        .cpu_op("aten::mm", 1, 2)  // pid 100 on both ranks
        .add({{"ph", "s"}, {"id", 7}, {"pid", 100}, {"tid", 100}, {"ts", 1}, {"cat", "ac2g"}})
        .add({{"ph", "f"}, {"id", 7}, {"pid", 0}, {"tid", 7}, {"ts", 10}, {"cat", "ac2g"}})
        .add({{"ph", "i"}, {"name", "mark"}, {"pid", "Traces"}, {"tid", "x"}, {"ts", 3}});
    b.write("rank-" + std::to_string(r) + ".json");
  }
  for (const char* out : {"merged.json", "merged.json.gz"}) {
    const std::string path = (dir / out).string();
    auto inputs = resolve_merge_inputs({(dir / "in").string()});
    ASSERT_EQ(inputs.size(), 2u);
    MergeStats stats = merge_traces(inputs, path, false);
    EXPECT_EQ(stats.events, 10u);  // 5 per rank; the inputs' process metadata replaced
    json j = read_json(path);
    std::map<int, std::set<int64_t>> pids_by_name_rank;
    std::map<int64_t, std::string> names;
    std::set<int64_t> flow_ids;
    int kernels = 0;
    for (const json& e : j["traceEvents"]) {
      ASSERT_TRUE(e["pid"].is_number_integer()) << e;
      if (e["ph"] == "M" && e["name"] == "process_name") {
        names[e["pid"]] = e["args"]["name"];
      }
      if (e["ph"] == "s" || e["ph"] == "f") flow_ids.insert(e["id"].get<int64_t>());
      if (e.value("cat", "") == "kernel") ++kernels;
    }
    EXPECT_EQ(kernels, 2);
    ASSERT_EQ(names.size(), 6u);  // (2 ranks) x (GPU pid 0, CPU pid 100, "Traces")
    int rank0 = 0, rank1 = 0;
    for (const auto& [pid, name] : names) {
      rank0 += name.rfind("rank 0", 0) == 0;
      rank1 += name.rfind("rank 1", 0) == 0;
    }
    EXPECT_EQ(rank0, 3);
    EXPECT_EQ(rank1, 3);
    EXPECT_EQ(names.begin()->second, "rank 0 python");
    EXPECT_EQ(flow_ids, (std::set<int64_t>{14, 15}));  // 7 * 2 ranks + rank
  }
}

TEST(TraceMerge, DuplicateRanksAndMissingInputsAreDataErrors) {
  const auto dir = test_dir();
  TraceBuilder(dir).kernel("k", 0, 1).write("a_rank-1.json");
  TraceBuilder(dir).kernel("k", 0, 1).write("b_rank-1.json");
  EXPECT_THROW(resolve_merge_inputs({dir.string()}), DataError);
  EXPECT_THROW(resolve_merge_inputs({(dir / "missing.json").string()}), DataError);
}

}  // namespace
}  // namespace tessera::analysis
