#include "tessera/analysis/kernel_tables.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "tessera/analysis/timeline.h"

namespace tessera::analysis {
namespace {

// count / total / mean / median / min / max over a list of durations.
struct Stats {
  uint64_t count = 0;
  int64_t total_ns = 0, median_ns = 0, min_ns = 0, max_ns = 0;
};

Stats stats_of(std::vector<int64_t>& durations) {
  Stats s;
  s.count = durations.size();
  if (durations.empty()) return s;
  for (int64_t d : durations) s.total_ns += d;
  const size_t mid = durations.size() / 2;
  std::nth_element(durations.begin(), durations.begin() + mid, durations.end());
  int64_t median = durations[mid];
  if (durations.size() % 2 == 0) {
    int64_t lower = *std::max_element(durations.begin(), durations.begin() + mid);
    median = (median + lower) / 2;
  }
  s.median_ns = median;
  auto [lo, hi] = std::minmax_element(durations.begin(), durations.end());
  s.min_ns = *lo;
  s.max_ns = *hi;
  return s;
}

int64_t total_gpu_ns(const TraceData& data) {
  int64_t total = 0;
  for (const GpuActivity& g : data.gpu) total += g.dur_ns;
  return total;
}

double pct(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

std::vector<Cell> stat_cells(const Stats& s, int64_t whole) {
  return {static_cast<int64_t>(s.count),
          s.total_ns / 1e6,
          s.count ? s.total_ns / 1e3 / static_cast<double>(s.count) : 0.0,
          s.median_ns / 1e3,
          s.min_ns / 1e3,
          s.max_ns / 1e3,
          pct(s.total_ns, whole)};
}

const std::vector<Column> kStatColumns = {{"count"},  {"total_ms"}, {"mean_us"},  {"median_us"},
                                          {"min_us"}, {"max_us"},   {"share_pct"}};

}  // namespace

Table categories_table(const TraceData& data) {
  std::vector<std::vector<int64_t>> durations(kNumCategories);
  for (const GpuActivity& g : data.gpu) {
    durations[static_cast<int>(g.category)].push_back(g.dur_ns);
  }
  const int64_t whole = total_gpu_ns(data);
  Table t;
  t.name = "categories";
  t.title = "GPU time by category";
  t.note = "share_pct: share of the summed duration of all GPU activities.";
  t.columns = {{"category", true}};
  t.columns.insert(t.columns.end(), kStatColumns.begin(), kStatColumns.end());
  std::vector<int64_t> all;
  for (int c = 0; c < kNumCategories; ++c) {
    if (durations[c].empty()) continue;
    all.insert(all.end(), durations[c].begin(), durations[c].end());
    std::vector<Cell> row = {std::string(category_name(static_cast<Category>(c)))};
    auto cells = stat_cells(stats_of(durations[c]), whole);
    row.insert(row.end(), cells.begin(), cells.end());
    t.rows.push_back(std::move(row));
  }
  std::sort(t.rows.begin(), t.rows.end(), [](const auto& a, const auto& b) {
    return std::get<double>(a[2]) > std::get<double>(b[2]);
  });
  if (!all.empty()) {
    std::vector<Cell> row = {std::string("total")};
    auto cells = stat_cells(stats_of(all), whole);
    row.insert(row.end(), cells.begin(), cells.end());
    t.rows.push_back(std::move(row));
  }
  return t;
}

Table kernels_table(const TraceData& data) {
  struct PerName {
    std::vector<int64_t> durations;
    Category category;
    int rule;
    std::map<uint32_t, uint64_t> ops;
  };
  std::unordered_map<uint32_t, PerName> by_name;
  for (const GpuActivity& g : data.gpu) {
    PerName& p = by_name[g.name];
    p.durations.push_back(g.dur_ns);
    p.category = g.category;
    p.rule = g.rule;
    const OpRef* op = data.launching_op(g);
    ++p.ops[op ? op->name : StringTable::kEmpty];
  }
  const int64_t whole = total_gpu_ns(data);
  Table t;
  t.name = "kernels";
  t.title = "Kernels";
  t.note = "Every unique GPU activity name; op: the CPU op that launched it most often.";
  t.summary_rows = 0;  // top_kernels is its summary
  t.columns = {{"name", true}, {"category"}};
  t.columns.insert(t.columns.end(), kStatColumns.begin(), kStatColumns.end());
  t.columns.push_back({"op"});
  t.columns.push_back({"rule"});
  for (auto& [name, p] : by_name) {
    std::vector<Cell> row = {data.strings[name], std::string(category_name(p.category))};
    auto cells = stat_cells(stats_of(p.durations), whole);
    row.insert(row.end(), cells.begin(), cells.end());
    auto best = std::max_element(p.ops.begin(), p.ops.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    row.push_back(data.strings[best->first]);
    row.push_back(data.describe_rule(p.rule));
    t.rows.push_back(std::move(row));
  }
  std::sort(t.rows.begin(), t.rows.end(), [](const auto& a, const auto& b) {
    return std::get<double>(a[3]) > std::get<double>(b[3]);
  });
  return t;
}

Table top_kernels_table(const Table& kernels, int k) {
  Table t;
  t.name = "top_kernels";
  t.title = fmt::format("Top {} kernels by total time", k);
  t.note = kernels.note;
  const char* keep[] = {"name", "category", "count", "total_ms", "mean_us", "share_pct", "op"};
  std::vector<int> idx;
  for (const char* c : keep) {
    idx.push_back(kernels.column(c));
    t.columns.push_back(kernels.columns[idx.back()]);
  }
  for (size_t r = 0; r < kernels.rows.size() && static_cast<int>(r) < k; ++r) {
    std::vector<Cell> row;
    for (int i : idx) row.push_back(kernels.rows[r][i]);
    t.rows.push_back(std::move(row));
  }
  return t;
}

Table short_kernels_table(const TraceData& data) {
  constexpr size_t kBuckets = std::size(kShortKernelBucketsUs) + 1;
  uint64_t count[kBuckets] = {};
  int64_t time[kBuckets] = {};
  uint64_t all_count = 0;
  int64_t all_time = 0;
  for (const GpuActivity& g : data.gpu) {
    if (g.kind != GpuKind::kKernel) continue;
    size_t b = 0;
    while (b < std::size(kShortKernelBucketsUs) && g.dur_ns >= kShortKernelBucketsUs[b] * 1e3) ++b;
    ++count[b];
    time[b] += g.dur_ns;
    ++all_count;
    all_time += g.dur_ns;
  }
  Table t;
  t.name = "short_kernels";
  t.title = "Kernel duration histogram";
  t.note =
      "Kernels only (no memcpy/memset). Many short kernels point at launch overhead and "
      "missed fusion.";
  t.columns = {{"bucket", true}, {"count"}, {"count_pct"}, {"total_ms"}, {"time_pct"}};
  for (size_t b = 0; b < kBuckets; ++b) {
    std::string label =
        b == 0 ? fmt::format("<{:g} us", kShortKernelBucketsUs[0])
               : (b + 1 == kBuckets ? fmt::format(">={:g} us", kShortKernelBucketsUs[b - 1])
                                    : fmt::format("{:g}-{:g} us", kShortKernelBucketsUs[b - 1],
                                                  kShortKernelBucketsUs[b]));
    t.rows.push_back({label, static_cast<int64_t>(count[b]),
                      all_count ? 100.0 * count[b] / all_count : 0.0, time[b] / 1e6,
                      pct(time[b], all_time)});
  }
  return t;
}

Table unclassified_table(const TraceData& data) {
  struct Agg {
    uint64_t count = 0;
    int64_t total_ns = 0;
    uint32_t op = 0;
  };
  std::unordered_map<uint32_t, Agg> by_name;
  for (const GpuActivity& g : data.gpu) {
    if (g.category != Category::kUnclassified) continue;
    Agg& a = by_name[g.name];
    ++a.count;
    a.total_ns += g.dur_ns;
    if (const OpRef* op = data.launching_op(g)) a.op = op->name;
  }
  const int64_t whole = total_gpu_ns(data);
  Table t;
  t.name = "unclassified";
  t.title = "Unclassified kernels";
  t.note =
      "Kernels no rule in src/tessera/analysis/kernel_categories.cpp matched; add a rule to "
      "classify them.";
  t.columns = {{"name", true}, {"count"}, {"total_ms"}, {"share_pct"}, {"op"}};
  for (const auto& [name, a] : by_name) {
    t.rows.push_back({data.strings[name], static_cast<int64_t>(a.count), a.total_ns / 1e6,
                      pct(a.total_ns, whole), data.strings[a.op]});
  }
  std::sort(t.rows.begin(), t.rows.end(), [](const auto& a, const auto& b) {
    return std::get<double>(a[2]) > std::get<double>(b[2]);
  });
  return t;
}

Table ops_table(const TraceData& data) {
  struct Gpu {
    uint64_t kernels = 0;
    int64_t total_ns = 0;
  };
  std::unordered_map<uint32_t, Gpu> gpu_by_op;
  for (const GpuActivity& g : data.gpu) {
    if (const OpRef* op = data.launching_op(g)) {
      Gpu& x = gpu_by_op[op->name];
      ++x.kernels;
      x.total_ns += g.dur_ns;
    }
  }
  Table t;
  t.name = "ops";
  t.title = "CPU ops";
  t.note =
      "cpu_*: inclusive wall time of the op on its CPU thread (nested ops count in their "
      "parents too); gpu_*: GPU activities the op launched directly (innermost op).";
  t.summary_rows = 15;
  t.columns = {{"op", true},   {"calls"},      {"cpu_total_ms"}, {"cpu_mean_us"},
               {"cpu_min_us"}, {"cpu_max_us"}, {"gpu_kernels"},  {"gpu_total_ms"}};
  for (const auto& [name, times] : data.op_times) {
    auto it = gpu_by_op.find(name);
    Gpu g = it == gpu_by_op.end() ? Gpu{} : it->second;
    t.rows.push_back({data.strings[name], static_cast<int64_t>(times.count), times.total_ns / 1e6,
                      times.total_ns / 1e3 / static_cast<double>(times.count), times.min_ns / 1e3,
                      times.max_ns / 1e3, static_cast<int64_t>(g.kernels), g.total_ns / 1e6});
  }
  std::sort(t.rows.begin(), t.rows.end(), [](const auto& a, const auto& b) {
    double ga = std::get<double>(a[7]), gb = std::get<double>(b[7]);
    if (ga != gb) return ga > gb;
    return std::get<double>(a[2]) > std::get<double>(b[2]);
  });
  return t;
}

Table ops_unique_args_table(const TraceData& data) {
  // One call: the GPU activities one op instance launched directly.
  struct Call {
    const OpRef* op;
    std::vector<size_t> activities;
  };
  std::vector<Call> calls;
  std::unordered_map<const OpRef*, size_t> call_of;
  for (size_t i = 0; i < data.gpu.size(); ++i) {
    // TraceLens leaves NCCL kernels out of its kernel launchers by default.
    if (data.gpu[i].category == Category::kCommunication) continue;
    const OpRef* op = data.launching_op(data.gpu[i]);
    Call* call = nullptr;
    if (op) {
      auto [it, inserted] = call_of.emplace(op, calls.size());
      if (!inserted) call = &calls[it->second];
    }
    if (!call) call = &calls.emplace_back(Call{op, {}});
    call->activities.push_back(i);
  }

  struct Group {
    std::vector<int64_t> busy_ns;
    uint64_t kernels = 0;
    std::unordered_map<uint32_t, int64_t> kernel_ns;  // by kernel name
    int64_t category_ns[kNumCategories] = {};
    int64_t example_external_id = -1;
  };
  // Groups by (name, thread, input dims, types, strides, concrete inputs, other args) as
  // interned ids; without a launching op, by the kernel's name (the last id set apart).
  using GroupKey = std::array<uint32_t, 8>;
  std::map<GroupKey, Group> groups;
  for (const Call& call : calls) {
    const GpuActivity& first = data.gpu[call.activities.front()];
    GroupKey key{};
    if (call.op) {
      const OpDetail none;
      const OpDetail* d = data.detail(call.op);
      if (!d) d = &none;
      key = {call.op->name,    d->thread,          d->input_dims, d->input_types,
             d->input_strides, d->concrete_inputs, d->other_args, 0};
    } else {
      key[0] = first.name;
      key[7] = 1;
    }
    Group& group = groups[key];
    if (group.busy_ns.empty()) {
      group.example_external_id = call.op ? call.op->external_id : first.external_id;
    }
    std::vector<Interval> intervals;
    for (size_t i : call.activities) {
      const GpuActivity& g = data.gpu[i];
      intervals.emplace_back(g.start_ns, g.start_ns + g.dur_ns);
      group.kernel_ns[g.name] += g.dur_ns;
      group.category_ns[static_cast<int>(g.category)] += g.dur_ns;
    }
    // Busy time, not the sum: kernels of one call on several streams overlap.
    group.busy_ns.push_back(total_length(merge_intervals(std::move(intervals))));
    group.kernels += call.activities.size();
  }

  int64_t whole = 0;
  for (const auto& [key, group] : groups) {
    for (int64_t b : group.busy_ns) whole += b;
  }
  Table t;
  t.name = "ops_unique_args";
  t.title = "Ops by unique arguments";
  t.note =
      "TraceLens's ops_unique_args: ops that launched GPU work (communication left out), one "
      "row per name, thread and arguments; a call's time is the busy time of the kernels it "
      "launched directly. std_us is the sample standard deviation; share_pct of the sum over "
      "all rows.";
  t.columns = {{"name", true},
               {"thread", true},
               {"input_dims", true},
               {"input_type", true},
               {"input_strides", true},
               {"concrete_inputs", true},
               {"other_args", true},
               {"category"},
               {"count"},
               {"kernels_per_call"},
               {"total_ms"},
               {"mean_us"},
               {"median_us"},
               {"std_us"},
               {"min_us"},
               {"max_us"},
               {"share_pct"},
               {"cumulative_pct"},
               {"kernels"},
               {"example_external_id"}};
  struct Sorted {
    const GroupKey* key;
    Group* group;
    Stats stats;
  };
  std::vector<Sorted> sorted;
  for (auto& [key, group] : groups) {
    std::vector<int64_t> busy = group.busy_ns;
    sorted.push_back({&key, &group, stats_of(busy)});
  }
  std::sort(sorted.begin(), sorted.end(), [](const Sorted& a, const Sorted& b) {
    if (a.stats.total_ns != b.stats.total_ns) return a.stats.total_ns > b.stats.total_ns;
    return a.group->example_external_id < b.group->example_external_id;
  });
  double cumulative = 0;
  for (const Sorted& s : sorted) {
    const Group& g = *s.group;
    const double n = static_cast<double>(s.stats.count);
    const double mean_ns = static_cast<double>(s.stats.total_ns) / n;
    double squares = 0;
    for (int64_t b : g.busy_ns) squares += (b - mean_ns) * (b - mean_ns);
    const int category =
        static_cast<int>(std::max_element(std::begin(g.category_ns), std::end(g.category_ns)) -
                         std::begin(g.category_ns));
    std::vector<std::pair<uint32_t, int64_t>> kernels(g.kernel_ns.begin(), g.kernel_ns.end());
    std::sort(kernels.begin(), kernels.end(), [](const auto& a, const auto& b) {
      return a.second != b.second ? a.second > b.second : a.first < b.first;
    });
    std::string kernel_names;
    for (const auto& [name, ns] : kernels) {
      kernel_names += (kernel_names.empty() ? "" : "; ") + data.strings[name];
    }
    const double share = pct(s.stats.total_ns, whole);
    cumulative += share;
    const GroupKey& k = *s.key;
    std::vector<Cell> row;
    if (k[7]) {
      // Without a launching op the kernel stands for itself, as the launch call does in
      // TraceLens.
      row = {"(no op) " + data.strings[k[0]], "", "", "", "", "", ""};
    } else {
      row = {data.strings[k[0]], data.thread_label(k[1]), data.strings[k[2]], data.strings[k[3]],
             data.strings[k[4]], data.strings[k[5]],      data.strings[k[6]]};
    }
    row.push_back(std::string(category_name(static_cast<Category>(category))));
    row.push_back(static_cast<int64_t>(s.stats.count));
    row.push_back(static_cast<double>(g.kernels) / n);
    row.push_back(s.stats.total_ns / 1e6);
    row.push_back(mean_ns / 1e3);
    row.push_back(s.stats.median_ns / 1e3);
    row.push_back(s.stats.count > 1 ? Cell{std::sqrt(squares / (n - 1)) / 1e3} : Cell{});
    row.push_back(s.stats.min_ns / 1e3);
    row.push_back(s.stats.max_ns / 1e3);
    row.push_back(share);
    row.push_back(cumulative);
    row.push_back(kernel_names);
    row.push_back(cell_or_empty(g.example_external_id));
    t.rows.push_back(std::move(row));
  }
  return t;
}

}  // namespace tessera::analysis
