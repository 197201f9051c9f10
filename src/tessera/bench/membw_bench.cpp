#include "tessera/bench/membw_bench.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/core/error.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::bench {
namespace {

constexpr int64_t kSmallCount = 1'000'003;  // floats: an odd size, not a multiple of a vector

struct CopyPair {
  DeviceBuffer src_buffer, dst_buffer;
  Tensor src, dst;
};

CopyPair allocate(Backend& b, int64_t count, uint64_t seed) {
  CopyPair p;
  p.src_buffer = DeviceBuffer(b, count * sizeof(float), "membw source");
  p.dst_buffer = DeviceBuffer(b, count * sizeof(float), "membw destination");
  p.src = p.src_buffer.tensor(DType::F32, {count});
  p.dst = p.dst_buffer.tensor(DType::F32, {count});
  b.init_normal(p.src, seed, 0, 0.0f, 1.0f);
  b.fill(p.dst, std::nanf(""));  // poisoned: an element the copy misses cannot pass
  return p;
}

// dst equals src bit for bit after one copy.
bool copies_exactly(Backend& b, const CopyPair& p) {
  b.copy(p.dst, p.src);
  std::vector<float> src(p.src.numel()), dst(p.dst.numel());
  b.download(src.data(), p.src);
  b.download(dst.data(), p.dst);
  return std::memcmp(src.data(), dst.data(), src.size() * sizeof(float)) == 0;
}

// Checks the copy (small against the reference, then full size bit for bit) and times it.
void check_and_time(BenchContext& ctx, size_t bytes, CopyResult& r) {
  {
    const CopyPair d = allocate(*ctx.device, kSmallCount, 7),
                   h = allocate(*ctx.reference, kSmallCount, 7);
    ctx.device->copy(d.dst, d.src);
    ctx.reference->copy(h.dst, h.src);
    std::vector<float> got(kSmallCount), want(kSmallCount);
    ctx.device->download(got.data(), d.dst);
    ctx.reference->download(want.data(), h.dst);
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
      r.failure = "small copy differs from the CPU reference's";
      return;
    }
  }
  const int64_t count = static_cast<int64_t>(bytes / sizeof(float));
  r.sets = rotation_sets(2 * bytes, ctx.cache_bytes, ctx.budget_bytes);
  std::vector<CopyPair> pairs;
  for (int s = 0; s < r.sets; ++s) pairs.push_back(allocate(*ctx.device, count, 100 + s));
  if (!copies_exactly(*ctx.device, pairs.front())) {
    r.failure = fmt::format("a copy of {} bytes does not reproduce its source", bytes);
    return;
  }
  r.timing = measure(
      *ctx.device,
      [&](int i) {
        const CopyPair& p = pairs[i % r.sets];
        ctx.device->copy(p.dst, p.src);
      },
      ctx.warmup, ctx.iters);
  r.gbps = 2.0 * count * sizeof(float) / (r.timing.median_ms * 1e-3) / 1e9;
  r.ok = true;
}

}  // namespace

CopyResult run_copy(BenchContext& ctx, size_t bytes) {
  CopyResult r;
  try {
    check_and_time(ctx, bytes, r);
  } catch (const Error& e) {
    r.ok = false;
    r.failure = e.what();
  }
  return r;
}

int membw_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera bench membw [--sizes_mib 16,64,256,1024,4096] [--device auto|cpu|cuda]\n"
        "                           [--gpu NAME] [--warmup 5] [--iters 20] [-o DIR]\n\n"
        "Device-to-device copy bandwidth through the op API (cudaMemcpyAsync on GPUs): GB/s\n"
        "counts bytes read + bytes written; % of the datasheet HBM bandwidth of --gpu (default:\n"
        "the visible GPU). Copies are rotated over buffers beyond twice the L2 and checked bit\n"
        "for bit before timing. -o DIR writes bench_membw.csv and .md.\n");
    return 0;
  }
  std::set<std::string> valued = kCommonOptions;
  valued.insert("sizes_mib");
  const CommandArgs a(args, valued, {}, false);
  BenchContext ctx = make_context(context_options(a));
  const std::vector<int64_t> sizes = a.get_int_list("sizes_mib", {16, 64, 256, 1024, 4096});
  const double peak_gbps = ctx.spec ? ctx.spec->hbm_tbps * 1000 : 0;

  analysis::Table t;
  t.name = "bench_membw";
  t.title = fmt::format("Device-to-device copy on {}", ctx.description);
  t.note = fmt::format(
      "median of {} samples after {} warm-up copies; GB/s = (read + written "
      "bytes) / time; {}.",
      ctx.iters, ctx.warmup, peak_note(ctx, peak_gbps, "HBM bandwidth", "GB/s"));
  t.columns = {{"size_mib", true}, {"bytes"},       {"buffers"}, {"median_ms"},
               {"gbps"},           {"pct_of_peak"}, {"status"}};
  analysis::StatusLine status(static_cast<int>(sizes.size()));
  int failures = 0;
  double best = 0;
  for (int64_t mib : sizes) {
    status.step(fmt::format("copy {} MiB", mib));
    const size_t bytes = static_cast<size_t>(mib) << 20;
    const CopyResult r = run_copy(ctx, bytes);
    if (!r.ok) {
      ++failures;
      t.rows.push_back({mib, static_cast<int64_t>(bytes), analysis::Cell{}, analysis::Cell{},
                        analysis::Cell{}, analysis::Cell{}, "FAILED: " + r.failure});
      continue;
    }
    best = std::max(best, r.gbps);
    t.rows.push_back({mib, static_cast<int64_t>(bytes), static_cast<int64_t>(r.sets),
                      r.timing.median_ms, r.gbps,
                      analysis::cell_or_empty(percent_of(r.gbps, peak_gbps)), std::string("ok")});
  }
  const double seconds = status.finish();
  std::string md = analysis::markdown_table(t);
  md += fmt::format("\n{} copy sizes checked and timed in {:.1f} s; best {:.0f} GB/s{}.\n",
                    sizes.size(), seconds, best,
                    failures ? fmt::format("; {} FAILED their check", failures) : "");
  analysis::print_and_write(a.get("output", ""), {t}, "bench_membw.md", md);
  return failures ? kExitRuntimeFailure : 0;
}

}  // namespace tessera::bench
