#include "tessera/analysis/step_breakdown.h"

#include <algorithm>
#include <array>
#include <unordered_map>

#include <fmt/format.h>

#include "tessera/analysis/kernel_categories.h"
#include "tessera/analysis/timeline.h"
#include "tessera/analysis/trace_reader.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

// Parts in the order an instant is given to them; idle comes last, outside this list.
enum Part { kRecompute, kGemm, kAttention, kCasts, kOptimizer, kOther, kCommunication, kParts };
constexpr std::array<const char*, kParts> kPartNames = {
    "recompute", "gemm", "attention", "casts", "optimizer", "other", "communication"};

struct Op {
  std::string name;
  int64_t ts_ns = 0;
};

struct Activity {
  int64_t start_ns, end_ns;
  std::string name;
  int64_t external_id, correlation;
  bool kernel;
};

bool is_cast_op(std::string_view op) {
  return op == "fp8_cast_transpose" || op == "fp8_update_scales" || op == "convert";
}

bool is_optimizer_op(std::string_view op) {
  return op == "adamw_step" || op == "sum_squares";
}

}  // namespace

StepBreakdown step_breakdown(const std::string& path) {
  std::vector<std::pair<std::string, Interval>> steps;
  std::vector<Interval> recompute;
  std::unordered_map<int64_t, Op> ops;                 // by External id
  std::unordered_map<int64_t, int64_t> runtime_links;  // correlation -> External id
  std::vector<Activity> gpu;
  read_trace(
      path, [](std::string_view, std::string_view) {},
      [&](const TraceEvent& e) {
        if (e.ph != 'X' || !e.has_ts) return;
        const std::string_view cat = e.cat;
        const Interval span{e.ts_ns, e.ts_ns + e.dur_ns};
        if (e.name.starts_with("ProfilerStep#") &&
            (cat == "user_annotation" || cat == "cpu_op" || cat.empty())) {
          steps.emplace_back(std::string(e.name), span);
        } else if (cat == "user_annotation" && e.name == "recompute") {
          recompute.push_back(span);
        } else if ((cat == "cpu_op" || cat.empty()) && e.args.external_id >= 0) {
          ops.emplace(e.args.external_id, Op{std::string(e.name), e.ts_ns});
        } else if ((cat == "cuda_runtime" || cat == "cuda_driver") && e.args.correlation >= 0 &&
                   e.args.external_id >= 0) {
          runtime_links.emplace(e.args.correlation, e.args.external_id);
        } else if (cat == "kernel" || cat == "gpu_memcpy" || cat == "gpu_memset") {
          gpu.push_back({span.first, span.second, std::string(e.name), e.args.external_id,
                         e.args.correlation, cat == "kernel"});
        }
      },
      /*progress=*/false);
  if (steps.empty())
    throw DataError(fmt::format(
        "{}: no ProfilerStep# range; expected a trace of training steps (Tessera's, or a "
        "PyTorch profiler's with its step ranges)",
        path));
  std::sort(steps.begin(), steps.end(),
            [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
  const auto& [step_name, window] = steps.front();
  recompute = merge_intervals(recompute);

  auto launching_op = [&](const Activity& a) -> const Op* {
    int64_t id = a.external_id;
    if (id < 0) {
      const auto link = runtime_links.find(a.correlation);
      if (link != runtime_links.end()) id = link->second;
    }
    const auto it = ops.find(id);
    return it == ops.end() ? nullptr : &it->second;
  };
  auto inside_recompute = [&](int64_t ts) {
    const auto it = std::upper_bound(recompute.begin(), recompute.end(), Interval{ts, INT64_MAX});
    return it != recompute.begin() && ts < std::prev(it)->second;
  };

  StepBreakdown b;
  b.step = step_name;
  b.step_ns = window.second - window.first;
  std::array<std::vector<Interval>, kParts> busy;
  for (const Activity& a : gpu) {
    const int64_t start = std::max(a.start_ns, window.first);
    const int64_t end = std::min(a.end_ns, window.second);
    if (start >= end) continue;
    ++b.kernels;
    const Op* op = launching_op(a);
    const std::string_view op_name = op ? std::string_view(op->name) : std::string_view();
    Part part = kOther;
    if (op && inside_recompute(op->ts_ns)) {
      part = kRecompute;
    } else if (!a.kernel) {
      part = kOther;  // copies and fills
    } else {
      const Category c = classify_kernel(a.name, op_name).category;
      if (c == Category::kGemm) {
        part = kGemm;
      } else if (c == Category::kAttentionFwd || c == Category::kAttentionBwd) {
        part = kAttention;
      } else if (is_cast_op(op_name)) {
        part = kCasts;
      } else if (is_optimizer_op(op_name) || c == Category::kOptimizer) {
        part = kOptimizer;
      } else if (c == Category::kCommunication) {
        part = kCommunication;
      }
    }
    busy[part].push_back({start, end});
  }
  std::vector<Interval> taken;
  for (int p = 0; p < kParts; ++p) {
    const std::vector<Interval> mine = merge_intervals(busy[p]);
    const std::vector<Interval> own = subtract_intervals(mine, taken);
    b.parts.push_back({kPartNames[p], total_length(own)});
    taken.insert(taken.end(), own.begin(), own.end());
    taken = merge_intervals(std::move(taken));
  }
  b.parts.push_back({"idle", b.step_ns - total_length(taken)});
  return b;
}

}  // namespace tessera::analysis
