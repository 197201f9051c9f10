#include "tessera/analysis/ranks.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "tessera/analysis/collectives.h"
#include "tessera/analysis/timeline.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

namespace fs = std::filesystem;

struct Occurrence {
  std::string kind, group;
  int64_t seq, bytes, start_ns, dur_ns;
};

struct RankTrace {
  int rank;
  std::string file;
  TimelineBreakdown timeline;
  std::vector<Occurrence> collectives;  // in start order
};

// A rank's communication kernels in launch (correlation) order.
std::vector<GpuActivity> launch_order(const TraceData& data) {
  std::vector<GpuActivity> kernels;
  for (const GpuActivity& g : data.gpu)
    if (g.category == Category::kCommunication) kernels.push_back(g);
  std::stable_sort(kernels.begin(), kernels.end(), [](const auto& a, const auto& b) {
    return a.correlation < b.correlation;
  });
  return kernels;
}

// The args of the host ops that describe collectives ("nccl:all_reduce" with a process group
// or sequence number) whose kernels the trace does not link to them, in the order the ops ran.
// A non-blocking NCCL communicator may launch its kernels after the call returns, outside the
// op's span; each collective launches one kernel, so the k-th such op is the k-th kernel
// without args. Empty when their counts differ (then nothing is paired).
std::vector<const CollectiveArgs*> unlinked_collective_args(const TraceData& data) {
  std::vector<const CollectiveArgs*> args;
  std::vector<bool> linked(data.op_details.size(), false);
  size_t unlinked_kernels = 0;
  for (const GpuActivity& g : data.gpu) {
    if (g.category != Category::kCommunication) continue;
    const OpRef* op = data.launching_op(g);
    if (g.collective < 0 && op && op->detail >= 0) linked[static_cast<size_t>(op->detail)] = true;
    const CollectiveInfo c = collective_info(data, g);
    if (c.process_group.empty() && c.seq < 0) ++unlinked_kernels;
  }
  for (const OpRef& op : data.ops) {  // sorted by External id: the order they began
    if (op.detail < 0 || linked[static_cast<size_t>(op.detail)]) continue;
    const OpDetail& d = data.op_details[static_cast<size_t>(op.detail)];
    if (d.collective < 0) continue;
    const CollectiveArgs& a = data.collectives[static_cast<size_t>(d.collective)];
    if (a.process_group != StringTable::kEmpty || a.seq >= 0) args.push_back(&a);
  }
  if (args.size() != unlinked_kernels) args.clear();
  return args;
}

RankTrace summarize(const std::string& file, bool progress,
                    const std::function<void(const TraceInfo&)>& on_loaded) {
  TraceData data = TraceData::load(file, progress);
  if (on_loaded) on_loaded(data.info);
  RankTrace r;
  r.file = file;
  auto name_rank = rank_from_filename(fs::path(file).filename().string());
  if (name_rank) {
    r.rank = *name_rank;
  } else if (data.info.rank) {
    r.rank = *data.info.rank;
  } else {
    throw DataError(
        fmt::format("{}: no rank id: expected 'rank-N', 'rank_N' or 'rankN' in the file name or "
                    "distributedInfo.rank in the trace",
                    file));
  }
  // A rank's trace may list other GPUs' (empty) tracks; its own GPU is the busiest one.
  for (const TimelineBreakdown& b : gpu_timeline(data)) {
    if (b.busy > r.timeline.busy) r.timeline = b;
  }
  const std::vector<const CollectiveArgs*> host_args = unlinked_collective_args(data);
  size_t next_host = 0;
  for (const GpuActivity& g : launch_order(data)) {
    CollectiveInfo c = collective_info(data, g);
    if (c.process_group.empty() && c.seq < 0 && next_host < host_args.size())
      c = collective_info(data, g, host_args[next_host++]);
    r.collectives.push_back({c.kind, c.process_group, c.seq, c.bytes, g.start_ns, g.dur_ns});
  }
  std::sort(r.collectives.begin(), r.collectives.end(),
            [](const Occurrence& a, const Occurrence& b) { return a.start_ns < b.start_ns; });
  return r;
}

// The ranks' traces in rank order. Throws DataError when two files claim one rank.
std::vector<RankTrace> load_ranks(const std::string& dir, bool progress,
                                  const std::function<void(const TraceInfo&)>& on_loaded) {
  std::vector<RankTrace> ranks;
  for (const std::string& f : trace_files_in(dir)) {
    ranks.push_back(summarize(f, progress, on_loaded));
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  for (size_t i = 1; i < ranks.size(); ++i) {
    if (ranks[i].rank == ranks[i - 1].rank) {
      throw DataError(fmt::format("{} and {}: both are rank {}", ranks[i - 1].file, ranks[i].file,
                                  ranks[i].rank));
    }
  }
  return ranks;
}

Table per_rank_table(const std::vector<RankTrace>& ranks) {
  Table per_rank;
  per_rank.name = "ranks";
  per_rank.title = "Per-rank GPU timeline";
  per_rank.note = "The busiest GPU track of each rank's trace (TraceLens definitions).";
  per_rank.columns = {{"rank", true}, {"file"},           {"total_ms"},
                      {"busy_ms"},    {"computation_ms"}, {"exposed_comm_ms"},
                      {"idle_ms"},    {"collectives"},    {"comm_total_ms"}};
  for (const RankTrace& t : ranks) {
    per_rank.rows.push_back({int64_t{t.rank}, fs::path(t.file).filename().string(),
                             t.timeline.total / 1e6, t.timeline.busy / 1e6,
                             t.timeline.computation / 1e6, t.timeline.exposed_comm / 1e6,
                             t.timeline.idle / 1e6, static_cast<int64_t>(t.collectives.size()),
                             t.timeline.total_comm / 1e6});
  }
  return per_rank;
}

using OccurrenceKey = std::tuple<std::string, std::string, int64_t>;  // group, kind, index or seq
// One occurrence of a collective on the ranks that ran it: (index into ranks, occurrence).
using RankOccurrences = std::vector<std::pair<size_t, const Occurrence*>>;

// Match occurrences: key (group, kind) and the k-th occurrence, or seq when all ranks have it.
std::map<OccurrenceKey, RankOccurrences> match_occurrences(const std::vector<RankTrace>& ranks) {
  bool all_seq = true;
  for (const RankTrace& t : ranks) {
    for (const Occurrence& o : t.collectives) all_seq = all_seq && o.seq >= 0;
  }
  std::map<OccurrenceKey, RankOccurrences> matched;
  for (size_t ri = 0; ri < ranks.size(); ++ri) {
    std::map<std::pair<std::string, std::string>, int64_t> counter;
    for (const Occurrence& o : ranks[ri].collectives) {
      int64_t index = all_seq ? o.seq : counter[{o.group, o.kind}]++;
      matched[{o.group, o.kind, index}].emplace_back(ri, &o);
    }
  }
  return matched;
}

Table skew_table() {
  Table skew;
  skew.name = "collective_skew";
  skew.title = "Collective skew (largest first)";
  skew.note =
      "Per occurrence of a collective on all ranks: start skew = latest - earliest start; "
      "spread = longest - shortest kernel; last_rank arrived last (everyone waited for it).";
  skew.columns = {{"collective", true},
                  {"process_group", true},
                  {"index", true},
                  {"bytes"},
                  {"ranks"},
                  {"first_start_ms"},
                  {"start_skew_us"},
                  {"dur_min_us"},
                  {"dur_max_us"},
                  {"dur_spread_us"},
                  {"first_rank"},
                  {"last_rank"}};
  return skew;
}

struct Straggle {
  int64_t last = 0, caused_ns = 0, waited_ns = 0;
};

// One rank's waiting for another: occurrences where the other arrived last, and the time.
struct Wait {
  int64_t times = 0, ns = 0;
};

struct KindSummary {
  int64_t count = 0, skew_total = 0, skew_max = 0, spread_total = 0, wait_total = 0;
};

// The skew of every occurrence matched on all ranks, and its sums per rank and per collective.
struct SkewTally {
  Table skew = skew_table();
  std::vector<Straggle> straggle;                                    // per rank
  std::vector<std::vector<Wait>> waited_for;  // [waiting rank][rank that arrived last]
  std::map<std::pair<std::string, std::string>, KindSummary> kinds;  // (kind, group)
  uint64_t unmatched = 0;  // collective kernels not found on every rank
};

void add_occurrence(SkewTally& tally, const std::vector<RankTrace>& ranks, const OccurrenceKey& key,
                    const RankOccurrences& occ, int64_t origin) {
  auto [first, last] = std::minmax_element(occ.begin(), occ.end(), [](auto& a, auto& b) {
    return a.second->start_ns < b.second->start_ns;
  });
  auto [shortest, longest] = std::minmax_element(
      occ.begin(), occ.end(), [](auto& a, auto& b) { return a.second->dur_ns < b.second->dur_ns; });
  const int64_t latest = last->second->start_ns;
  const int64_t s = latest - first->second->start_ns;
  const int64_t spread = longest->second->dur_ns - shortest->second->dur_ns;
  int64_t caused = 0;
  for (const auto& [ri, o] : occ) {
    tally.straggle[ri].waited_ns += latest - o->start_ns;
    caused += latest - o->start_ns;
    if (ri != last->first) {
      Wait& w = tally.waited_for[ri][last->first];
      ++w.times;
      w.ns += latest - o->start_ns;
    }
  }
  ++tally.straggle[last->first].last;
  tally.straggle[last->first].caused_ns += caused;
  KindSummary& k = tally.kinds[{std::get<1>(key), std::get<0>(key)}];
  ++k.count;
  k.skew_total += s;
  k.skew_max = std::max(k.skew_max, s);
  k.spread_total += spread;
  k.wait_total += caused;
  tally.skew.rows.push_back(
      {std::get<1>(key), std::get<0>(key), std::get<2>(key),
       cell_or_empty(occ.front().second->bytes), static_cast<int64_t>(occ.size()),
       (first->second->start_ns - origin) / 1e6, s / 1e3, shortest->second->dur_ns / 1e3,
       longest->second->dur_ns / 1e3, spread / 1e3, int64_t{ranks[first->first].rank},
       int64_t{ranks[last->first].rank}});
}

// How many of the traced ranks run collectives in each process group: a group's name
// (PyTorch's "Process Group Name", Tessera's "tp:2") names one group, whose members are the
// ranks whose traces use it; a collective without a name is taken to span every rank.
std::map<std::string, size_t> group_sizes(const std::vector<RankTrace>& ranks) {
  std::map<std::string, std::set<size_t>> members;
  for (size_t ri = 0; ri < ranks.size(); ++ri) {
    for (const Occurrence& o : ranks[ri].collectives) members[o.group].insert(ri);
  }
  std::map<std::string, size_t> sizes;
  for (const auto& [group, m] : members) sizes[group] = group.empty() ? ranks.size() : m.size();
  return sizes;
}

SkewTally tally_skew(const std::vector<RankTrace>& ranks) {
  SkewTally tally;
  tally.straggle.resize(ranks.size());
  tally.waited_for.assign(ranks.size(), std::vector<Wait>(ranks.size()));
  int64_t origin = INT64_MAX;
  for (const RankTrace& t : ranks) {
    if (!t.collectives.empty()) origin = std::min(origin, t.collectives.front().start_ns);
  }
  const std::map<std::string, size_t> sizes = group_sizes(ranks);
  for (const auto& [key, occ] : match_occurrences(ranks)) {
    if (occ.size() != sizes.at(std::get<0>(key))) {
      tally.unmatched += occ.size();
      continue;
    }
    add_occurrence(tally, ranks, key, occ, origin);
  }
  std::stable_sort(
      tally.skew.rows.begin(), tally.skew.rows.end(),
      [](const auto& a, const auto& b) { return std::get<double>(a[6]) > std::get<double>(b[6]); });
  return tally;
}

Table skew_summary_table(const SkewTally& tally) {
  Table summary;
  summary.name = "skew_summary";
  summary.title = "Skew by collective";
  summary.note =
      "total_wait: summed over ranks and occurrences, time spent waiting for the last rank.";
  summary.columns = {{"collective", true}, {"process_group", true}, {"count"},
                     {"mean_skew_us"},     {"max_skew_us"},         {"mean_spread_us"},
                     {"total_wait_ms"}};
  for (const auto& [key, k] : tally.kinds) {
    summary.rows.push_back({key.first, key.second, k.count, k.skew_total / 1e3 / k.count,
                            k.skew_max / 1e3, k.spread_total / 1e3 / k.count, k.wait_total / 1e6});
  }
  return summary;
}

Table stragglers_table(const std::vector<RankTrace>& ranks, const SkewTally& tally) {
  Table stragglers;
  stragglers.name = "stragglers";
  stragglers.title = "Stragglers";
  stragglers.note =
      "times_last: occurrences where this rank started last; caused_wait: the others' waiting "
      "in those; waited: this rank's own waiting for later ranks.";
  stragglers.columns = {
      {"rank", true}, {"times_last"}, {"last_pct"}, {"caused_wait_ms"}, {"waited_ms"}};
  const int64_t occurrences = static_cast<int64_t>(tally.skew.rows.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    const Straggle& s = tally.straggle[i];
    stragglers.rows.push_back({int64_t{ranks[i].rank}, s.last,
                               occurrences ? 100.0 * s.last / occurrences : 0.0, s.caused_ns / 1e6,
                               s.waited_ns / 1e6});
  }
  return stragglers;
}

// Who waited for whom: one row per (waiting rank, rank that arrived last) pair that waited,
// the longest waits first.
Table waits_table(const std::vector<RankTrace>& ranks, const SkewTally& tally) {
  Table waits;
  waits.name = "waits";
  waits.title = "Who waited for whom";
  waits.note =
      "rank waited wait_ms in total, over `times` collectives, for waited_for, the rank that "
      "arrived last in them.";
  waits.columns = {{"rank", true}, {"waited_for", true}, {"times"}, {"wait_ms"}, {"mean_wait_us"}};
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = 0; j < ranks.size(); ++j) {
      const Wait& w = tally.waited_for[i][j];
      if (w.times == 0) continue;
      waits.rows.push_back({int64_t{ranks[i].rank}, int64_t{ranks[j].rank}, w.times, w.ns / 1e6,
                            w.ns / 1e3 / static_cast<double>(w.times)});
    }
  }
  std::stable_sort(waits.rows.begin(), waits.rows.end(), [](const auto& a, const auto& b) {
    return std::get<double>(a[3]) > std::get<double>(b[3]);
  });
  return waits;
}

// The longest wait of one rank for another, for the report's info; needs a wait.
std::string longest_wait(const Table& waits) {
  const auto& top = waits.rows.front();
  return fmt::format("rank {} waited {:.3f} ms for rank {} over {} collectives",
                     std::get<int64_t>(top[0]), std::get<double>(top[3]),
                     std::get<int64_t>(top[1]), std::get<int64_t>(top[2]));
}

// The rank that caused the most waiting, for the report's info; needs an occurrence.
std::string worst_straggler(const std::vector<RankTrace>& ranks, const SkewTally& tally) {
  const int64_t occurrences = static_cast<int64_t>(tally.skew.rows.size());
  auto worst = std::max_element(tally.straggle.begin(), tally.straggle.end(),
                                [](auto& a, auto& b) { return a.caused_ns < b.caused_ns; });
  const size_t wi = static_cast<size_t>(worst - tally.straggle.begin());
  return fmt::format("rank {} arrived last in {} of {} collectives; others waited {:.3f} ms for it",
                     ranks[wi].rank, worst->last, occurrences, worst->caused_ns / 1e6);
}

}  // namespace

std::optional<int> rank_from_filename(std::string_view filename) {
  std::string s(filename);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (size_t pos = s.find("rank"); pos != std::string::npos; pos = s.find("rank", pos + 1)) {
    size_t i = pos + 4;
    if (i < s.size() && (s[i] == '-' || s[i] == '_')) ++i;
    size_t j = i;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    if (j > i) return std::stoi(s.substr(i, j - i));
  }
  return std::nullopt;
}

std::vector<std::string> trace_files_in(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw DataError(
        fmt::format("{}: not a directory: expected a directory of per-rank traces", dir));
  }
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && (name.ends_with(".json") || name.ends_with(".json.gz"))) {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    throw DataError(fmt::format("{}: no trace files: expected *.json or *.json.gz", dir));
  }
  return files;
}

Report ranks_report(const std::string& dir, bool progress,
                    const std::function<void(const TraceInfo&)>& on_loaded) {
  const std::vector<RankTrace> ranks = load_ranks(dir, progress, on_loaded);
  SkewTally tally = tally_skew(ranks);
  Report r;
  r.title = "Multi-rank report: " + dir;
  r.info = {{"directory", dir}, {"ranks", std::to_string(ranks.size())}};
  if (tally.unmatched > 0) {
    r.warnings.push_back(fmt::format(
        "{} collective kernels could not be matched on every rank of their process group "
        "(different counts per rank: traces of different steps, or unnamed sub-groups)",
        tally.unmatched));
  }
  Table waits = waits_table(ranks, tally);
  if (!tally.skew.rows.empty()) r.info.push_back({"straggler", worst_straggler(ranks, tally)});
  if (!waits.rows.empty()) r.info.push_back({"longest wait", longest_wait(waits)});
  r.tables = {stragglers_table(ranks, tally), std::move(waits), skew_summary_table(tally),
              std::move(tally.skew), per_rank_table(ranks)};
  return r;
}

}  // namespace tessera::analysis
