#pragma once
// Reads a trace with the analyser's streaming reader (analysis/trace_reader.h) into plain
// structs, for assertions about what the recorder wrote. Shared by tests/profiler and
// tests/gpu/gpu_profiler_test.cpp.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/analysis/trace_reader.h"

namespace tessera::profiler_test {

struct Event {
  char ph = 0;
  std::string name, cat, dtype, meta_name;
  int64_t ts = 0, dur = 0, pid = 0;
  bool has_dur = false;
  int64_t external_id = -1, correlation = -1;
  int64_t m = -1, n = -1, k = -1, b = -1, h = -1, kv = -1, t = -1, s = -1, d = -1, window = -1;
  int causal = -1;
  int64_t end() const { return ts + dur; }
  bool contains(const Event& o) const { return ts <= o.ts && o.end() <= end(); }
};

struct Trace {
  std::vector<Event> events;
  std::map<std::string, std::string> members;  // top-level key -> raw JSON text

  // Complete events of category `cat` (and name `name`, when given).
  std::vector<const Event*> spans(std::string_view cat, std::string_view name = {}) const {
    std::vector<const Event*> out;
    for (const Event& e : events)
      if (e.ph == 'X' && e.cat == cat && (name.empty() || e.name == name)) out.push_back(&e);
    return out;
  }
  // The events of `list` that contain `e` in time (on any track).
  static std::vector<const Event*> enclosing(const std::vector<const Event*>& list,
                                             const Event& e) {
    std::vector<const Event*> out;
    for (const Event* x : list)
      if (x != &e && x->contains(e)) out.push_back(x);
    return out;
  }
};

inline Trace read_events(const std::string& path) {
  Trace trace;
  analysis::read_trace(
      path,
      [&](std::string_view key, std::string_view value) {
        trace.members[std::string(key)] = std::string(value);
      },
      [&](const analysis::TraceEvent& e) {
        Event x;
        x.ph = e.ph;
        x.name = e.name;
        x.cat = e.cat;
        x.ts = e.ts_ns;
        x.dur = e.dur_ns;
        x.has_dur = e.has_dur;
        x.pid = e.pid;
        const analysis::EventArgs& a = e.args;
        x.external_id = a.external_id;
        x.correlation = a.correlation;
        x.dtype = a.dtype;
        x.meta_name = a.meta_name;
        x.m = a.m, x.n = a.n, x.k = a.k, x.b = a.b, x.h = a.h, x.kv = a.kv, x.t = a.t;
        x.s = a.s, x.d = a.d, x.window = a.window, x.causal = a.causal;
        trace.events.push_back(std::move(x));
      },
      /*progress=*/false);
  return trace;
}

// True when the complete events of `pid` nest: any two either are disjoint or one holds
// the other (what Perfetto needs on one thread track). `why` names the first pair that
// overlaps partially.
inline bool spans_nest(const Trace& trace, int64_t pid, std::string* why) {
  std::vector<const Event*> v;
  for (const Event& e : trace.events)
    if (e.ph == 'X' && e.pid == pid) v.push_back(&e);
  std::sort(v.begin(), v.end(), [](const Event* a, const Event* b) {
    return a->ts != b->ts ? a->ts < b->ts : a->dur > b->dur;
  });
  std::vector<const Event*> stack;
  for (const Event* e : v) {
    while (!stack.empty() && stack.back()->end() <= e->ts) stack.pop_back();
    if (!stack.empty() && e->end() > stack.back()->end()) {
      *why = stack.back()->name + " [" + std::to_string(stack.back()->ts) + ", " +
             std::to_string(stack.back()->end()) + ") and " + e->name + " [" +
             std::to_string(e->ts) + ", " + std::to_string(e->end()) + ")";
      return false;
    }
    stack.push_back(e);
  }
  return true;
}

}  // namespace tessera::profiler_test
