#include "tessera/analysis/timeline.h"

#include <algorithm>
#include <map>

namespace tessera::analysis {

std::vector<Interval> merge_intervals(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.first <= out.back().second) {
      out.back().second = std::max(out.back().second, i.second);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

std::vector<Interval> subtract_intervals(const std::vector<Interval>& from,
                                         const std::vector<Interval>& remove) {
  std::vector<Interval> out;
  size_t r = 0;
  for (const auto& [start, end] : from) {
    int64_t cur = start;
    while (r < remove.size() && remove[r].second <= cur) ++r;
    for (size_t j = r; j < remove.size() && remove[j].first < end; ++j) {
      if (remove[j].first > cur) out.emplace_back(cur, remove[j].first);
      cur = std::max(cur, remove[j].second);
      if (cur >= end) break;
    }
    if (cur < end) out.emplace_back(cur, end);
  }
  return out;
}

int64_t total_length(const std::vector<Interval>& v) {
  int64_t t = 0;
  for (const auto& [s, e] : v) t += e - s;
  return t;
}

std::vector<TimelineBreakdown> gpu_timeline(const TraceData& data) {
  struct Lists {
    std::vector<Interval> all, comp, comm, memcpy;
  };
  std::map<int, Lists> by_device;
  for (const GpuActivity& g : data.gpu) {
    Lists& l = by_device[g.device];
    Interval i{g.start_ns, g.start_ns + g.dur_ns};
    l.all.push_back(i);
    if (g.category == Category::kCommunication) {
      l.comm.push_back(i);
    } else if (g.category == Category::kMemcpy) {
      l.memcpy.push_back(i);
    } else {
      l.comp.push_back(i);
    }
  }
  std::vector<TimelineBreakdown> out;
  for (auto& [device, l] : by_device) {
    auto all = merge_intervals(std::move(l.all));
    auto comp = merge_intervals(std::move(l.comp));
    auto comm = merge_intervals(std::move(l.comm));
    auto memcpy = merge_intervals(std::move(l.memcpy));
    TimelineBreakdown b;
    b.device = device;
    b.total = all.back().second - all.front().first;
    b.busy = total_length(all);
    b.idle = b.total - b.busy;
    b.computation = total_length(comp);
    b.total_comm = total_length(comm);
    b.exposed_comm = total_length(subtract_intervals(comm, comp));
    b.total_memcpy = total_length(memcpy);
    b.exposed_memcpy = total_length(subtract_intervals(subtract_intervals(memcpy, comp), comm));
    out.push_back(b);
  }
  return out;
}

Table gpu_timeline_table(const std::vector<TimelineBreakdown>& timeline) {
  Table t;
  t.name = "gpu_timeline";
  t.title = "GPU timeline";
  t.note =
      "computation + exposed_comm + exposed_memcpy + idle = total (TraceLens definitions); "
      "exposed = not overlapped by computation (memcpy: nor by communication).";
  t.columns = {{"device", true}, {"type", true}, {"time_ms"}, {"percent"}};
  for (const TimelineBreakdown& b : timeline) {
    const std::pair<const char*, int64_t> rows[] = {
        {"computation", b.computation},
        {"exposed_comm", b.exposed_comm},
        {"exposed_memcpy", b.exposed_memcpy},
        {"busy", b.busy},
        {"idle", b.idle},
        {"total", b.total},
        {"total_comm", b.total_comm},
        {"total_memcpy", b.total_memcpy},
    };
    for (const auto& [type, ns] : rows) {
      double pct =
          b.total > 0 ? 100.0 * static_cast<double>(ns) / static_cast<double>(b.total) : 0.0;
      t.rows.push_back({int64_t{b.device}, std::string(type), ns / 1e6, pct});
    }
  }
  return t;
}

}  // namespace tessera::analysis
