#include "tessera/analysis/report.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/analysis/bandwidth.h"
#include "tessera/analysis/collectives.h"
#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/progress.h"
#include "tessera/analysis/shapes.h"
#include "tessera/analysis/timeline.h"

namespace tessera::analysis {
namespace {

std::optional<GpuSpec> choose_gpu(const TraceData& data, const ReportOptions& options) {
  if (!options.gpu.empty()) return require_gpu_spec(options.gpu);
  for (const std::string& device : data.info.devices) {
    if (auto spec = find_gpu_spec(device)) return spec;
  }
  return std::nullopt;
}

std::string shorten(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(0, n - 3) + "...";
}

// The GPU with the most busy time (a trace of one process may record several).
const TimelineBreakdown* busiest(const std::vector<TimelineBreakdown>& timeline) {
  auto it = std::max_element(timeline.begin(), timeline.end(),
                             [](const auto& a, const auto& b) { return a.busy < b.busy; });
  return it == timeline.end() ? nullptr : &*it;
}

using Headline = std::vector<std::pair<std::string, std::string>>;

void step_and_busy(const TraceInfo& info, const std::vector<TimelineBreakdown>& timeline,
                   Headline& h) {
  if (!info.step_ns.empty()) {
    double total = 0;
    for (int64_t ns : info.step_ns) total += static_cast<double>(ns);
    h.push_back({"step time", fmt::format("{:.3f} ms (mean of {} ProfilerStep# ranges)",
                                          total / 1e6 / static_cast<double>(info.step_ns.size()),
                                          info.step_ns.size())});
  }
  const TimelineBreakdown* t = busiest(timeline);
  if (!t || t->total <= 0) return;
  auto pct = [&](int64_t part) { return 100.0 * static_cast<double>(part) / t->total; };
  h.push_back(
      {"GPU busy", fmt::format("{:.1f}% of {:.3f} ms{}: computation {:.1f}%, exposed communication "
                               "{:.1f}%, exposed memcpy {:.1f}%, idle {:.1f}%",
                               pct(t->busy), t->total / 1e6,
                               timeline.size() > 1 ? fmt::format(" on GPU {}", t->device) : "",
                               pct(t->computation), pct(t->exposed_comm), pct(t->exposed_memcpy),
                               pct(t->idle))});
}

void top_categories(const Table& categories, Headline& h) {
  std::string top;
  int shown = 0;
  for (size_t r = 0; r < categories.rows.size() && shown < 3; ++r) {
    const std::string name = categories.text(r, "category");
    if (name == "total") continue;
    top += fmt::format("{}{} {:.1f}%", top.empty() ? "" : ", ", name,
                       categories.number(r, "share_pct").value_or(0));
    ++shown;
  }
  if (!top.empty()) h.push_back({"top categories", top + " of GPU time"});
}

// Time-weighted: all FLOPs over all time of the GEMMs whose shapes are known.
void gemm_rate(const Table& gemm, Headline& h) {
  // % of peak over the rows with a peak: their FLOPs over what the peak does in their time.
  double all_ms = 0, known_ms = 0, flops = 0, rated_flops = 0, peak_flops = 0;
  int64_t calls = 0;
  for (size_t r = 0; r < gemm.rows.size(); ++r) {
    const double ms = gemm.number(r, "total_ms").value_or(0);
    const double count = gemm.number(r, "count").value_or(0);
    all_ms += ms;
    calls += static_cast<int64_t>(count);
    const auto gflop = gemm.number(r, "gflop");
    if (!gflop) continue;
    known_ms += ms;
    flops += *gflop * 1e9 * count;
    if (const auto peak = gemm.number(r, "peak_tflops")) {
      rated_flops += *gflop * 1e9 * count;
      peak_flops += *peak * 1e12 * ms / 1e3;
    }
  }
  if (all_ms <= 0) return;
  if (known_ms <= 0) {
    h.push_back(
        {"GEMM", fmt::format("no shapes in the trace ({} calls, {:.3f} ms)", calls, all_ms)});
    return;
  }
  std::string rate = fmt::format("{:.1f} TFLOP/s", flops / (known_ms / 1e3) / 1e12);
  if (peak_flops > 0) rate += fmt::format(", {:.1f}% of peak", 100 * rated_flops / peak_flops);
  h.push_back({"GEMM", fmt::format("{} ({} calls, {:.3f} ms; shapes for {:.0f}% of that time)",
                                   rate, calls, all_ms, 100 * known_ms / all_ms)});
}

void bandwidth_rate(const Table& bw, const std::optional<GpuSpec>& gpu, Headline& h) {
  double all_ms = 0, known_ms = 0, bytes = 0;
  int64_t calls = 0;
  std::vector<size_t> worst;
  for (size_t r = 0; r < bw.rows.size(); ++r) {
    const double ms = bw.number(r, "total_ms").value_or(0);
    all_ms += ms;
    calls += static_cast<int64_t>(bw.number(r, "count").value_or(0));
    const auto mbytes = bw.number(r, "mbytes");
    if (!mbytes || bw.text(r, "memory") != "HBM") continue;
    known_ms += ms;
    bytes += *mbytes * 1e6 * bw.number(r, "count").value_or(0);
    if (bw.number(r, "excess_ms").value_or(0) > 0) worst.push_back(r);
  }
  if (all_ms <= 0) return;
  std::string rate = "bytes not derived for any call";
  if (known_ms > 0) {
    const double bps = bytes / (known_ms / 1e3);
    rate = fmt::format("{:.2f} TB/s", bps / 1e12);
    if (gpu) {
      rate += fmt::format(", {:.1f}% of {} HBM", 100 * bps / (gpu->hbm_tbps * 1e12), gpu->name);
    }
  }
  h.push_back(
      {"bandwidth", fmt::format("{} ({} calls, {:.3f} ms of elementwise, reduction, normalization, "
                                "optimizer and copy work; bytes for {:.0f}% of that time)",
                                rate, calls, all_ms, 100 * known_ms / all_ms)});
  std::sort(worst.begin(), worst.end(), [&](size_t a, size_t b) {
    return bw.number(a, "excess_ms").value_or(0) > bw.number(b, "excess_ms").value_or(0);
  });
  for (size_t i = 0; i < worst.size() && i < 3; ++i) {
    const size_t r = worst[i];
    // The op and its shapes: PyTorch's input dims, else Tessera's op args.
    std::string shapes = bw.text(r, "input_dims");
    if (shapes.empty()) shapes = bw.text(r, "args");
    const std::string what = bw.text(r, "op") + (shapes.empty() ? "" : " " + shapes);
    h.push_back({"worst bandwidth",
                 fmt::format("{}: {:.0f} GB/s, {:.1f}% of HBM ({} calls, {:.3f} ms above "
                             "the bandwidth floor)",
                             shorten(what, 90), bw.number(r, "gbps").value_or(0),
                             bw.number(r, "hbm_pct").value_or(0),
                             static_cast<int64_t>(bw.number(r, "count").value_or(0)),
                             bw.number(r, "excess_ms").value_or(0))});
  }
}

}  // namespace

Report build_report(const TraceData& data, const ReportOptions& options) {
  const std::optional<GpuSpec> gpu = choose_gpu(data, options);
  const TraceInfo& info = data.info;
  Report r;
  r.title = "Trace report: " + std::filesystem::path(info.path).filename().string();
  r.info = {
      {"trace", info.path},
      {"read", read_summary(info.read.events, info.read.json_bytes, info.read.seconds,
                            info.read.file_bytes)},
      {"gpu activities", std::to_string(info.gpu_events)},
      {"cpu ops", std::to_string(info.cpu_ops)},
      {"runtime calls", std::to_string(info.runtime_calls)},
      {"devices in trace", info.devices.empty() ? "(none listed)" : info.devices.front()},
      {"peak figures",
       gpu ? fmt::format("{}: bf16 {} / fp8 {} / fp32 {} TFLOP/s, {} GB at {} TB/s ({})", gpu->name,
                         gpu->bf16_tflops, gpu->fp8_tflops, gpu->fp32_tflops, gpu->hbm_gb,
                         gpu->hbm_tbps, gpu->source)
           : std::string("none (pass --gpu NAME for % of peak and roofline)")},
  };
  if (info.rank) {
    r.info.push_back({"rank", fmt::format("{} of {}", *info.rank, info.world_size)});
  }
  if (info.missing_fields > 0) {
    r.warnings.push_back(
        fmt::format("{} complete events lack ts or dur and were skipped (first: {})",
                    info.missing_fields, info.first_missing));
  }
  if (info.bad_times > 0) {
    r.warnings.push_back(fmt::format(
        "{} complete events have a negative duration or a time beyond any clock and were "
        "skipped (first: {})",
        info.bad_times, info.first_bad_time));
  }
  if (data.gpu.empty()) {
    r.warnings.push_back(
        "no GPU activity (kernel, gpu_memcpy, gpu_memset events) in this trace: the GPU "
        "sheets are empty; the ops sheet still covers CPU ops");
  }
  const std::vector<TimelineBreakdown> timeline = gpu_timeline(data);
  r.tables.push_back(gpu_timeline_table(timeline));
  r.tables.push_back(categories_table(data));
  Table kernels = kernels_table(data);
  r.tables.push_back(top_kernels_table(kernels, options.top_k));
  r.tables.push_back(gemm_table(data, gpu));
  r.tables.push_back(attention_table(data, gpu));
  r.tables.push_back(bandwidth_table(data, gpu));
  r.tables.push_back(collectives_table(data));
  r.tables.push_back(short_kernels_table(data));
  Table unclassified = unclassified_table(data);
  if (!unclassified.rows.empty()) {
    r.warnings.push_back(
        fmt::format("{} kernel names matched no category rule; see the unclassified sheet",
                    unclassified.rows.size()));
  }
  r.tables.push_back(std::move(unclassified));
  r.tables.push_back(std::move(kernels));
  r.tables.push_back(ops_table(data));
  r.tables.push_back(ops_unique_args_table(data));
  step_and_busy(info, timeline, r.headline);
  top_categories(*r.find("categories"), r.headline);
  gemm_rate(*r.find("gemm"), r.headline);
  bandwidth_rate(*r.find("bandwidth"), gpu, r.headline);
  return r;
}

}  // namespace tessera::analysis
