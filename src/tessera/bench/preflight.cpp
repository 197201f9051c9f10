#include "tessera/bench/preflight.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/bench/gemm_bench.h"
#include "tessera/bench/gpu_info.h"
#include "tessera/bench/membw_bench.h"
#include "tessera/distributed/launcher.h"

namespace tessera::bench {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "13.0" -> 13000, as CUDA encodes versions, so that driver and runtime compare.
int version_code(const std::string& dotted) {
  const size_t dot = dotted.find('.');
  if (dot == std::string::npos) return 0;
  return std::stoi(dotted.substr(0, dot)) * 1000 + std::stoi(dotted.substr(dot + 1)) * 10;
}

class Checks {
 public:
  explicit Checks(analysis::Table& t) : t_(t) {}
  void add(const std::string& check, const std::string& value, const char* verdict,
           const std::string& detail) {
    t_.rows.push_back({check, value, std::string(verdict), detail});
    if (std::string_view(verdict) == "warn") ++warnings_;
  }
  // pass when `ok`, warn otherwise.
  void expect(bool ok, const std::string& check, const std::string& value,
              const std::string& detail) {
    add(check, value, ok ? "pass" : "warn", detail);
  }
  int warnings() const { return warnings_; }

 private:
  analysis::Table& t_;
  int warnings_ = 0;
};

// A 256 MiB fp32 all-reduce over every GPU of this machine: `tessera bench comm` under
// `tessera launch` (one process per GPU, as training runs), which checks the result before
// timing it. Returns the bus bandwidth in GB/s, or nullopt with *why set.
std::optional<double> all_reduce_busbw(int gpus, std::string* why) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("tessera_preflight_comm_{}", ::getpid());
  dist::LaunchOptions o;
  o.nproc_per_node = gpus;
  o.master_port = 29500 + static_cast<int>(::getpid() % 2000);
  o.command = {dist::current_executable(), "bench", "comm", "--ops", "all_reduce",
               "--min_bytes", "268435456", "--max_bytes", "268435456", "--warmup", "3",
               "--iters", "10", "-o", dir.string()};
  const dist::LaunchResult r = dist::launch(o);
  std::optional<double> busbw;
  std::ifstream csv(dir / "bench_comm.csv");
  std::string line;
  std::getline(csv, line);  // collective,size_bytes,count,time_us,algbw_gbps,busbw_gbps,status
  if (r.exit_code != 0) {
    *why = fmt::format("bench comm failed on rank {} (exit code {})", r.failed_rank, r.exit_code);
  } else if (std::getline(csv, line)) {
    std::vector<std::string> cells;
    std::stringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
    if (cells.size() == 7 && cells[6] == "ok") busbw = std::stod(cells[5]);
    else *why = "unexpected result row: " + line;
  } else {
    *why = "bench comm wrote no result";
  }
  fs::remove_all(dir);
  return busbw;
}

}  // namespace

PreflightReport run_preflight(const PreflightOptions& o) {
  PreflightReport r;
  analysis::Table& t = r.checks;
  t.name = "preflight";
  t.title = "Tessera preflight";
  t.note = fmt::format(
      "pass/warn per line; measurements against configs/gpus.yaml datasheet values: GEMM "
      "(bf16 {0}^3, NT) >= {1:.0f}% of the dense bf16 peak, copy ({2} MiB device to device, "
      "read + write bytes) >= {3:.0f}% of the HBM bandwidth.",
      o.gemm_size, 100 * kGemmPassFraction, o.copy_mib, 100 * kCopyPassFraction);
  t.columns = {{"check", true}, {"value"}, {"verdict"}, {"detail"}};
  Checks c(t);
  const Platform* platform = gpu_platform();
  c.add("tessera", TESSERA_VERSION, "info",
        platform ? fmt::format("built with the {} backend", platform->name())
                 : std::string("built without a GPU backend"));

  const int gpus = gpu_device_count();
  const std::optional<DeviceInfo> g = gpu_info(0);
  if (!g) {
    c.add("GPU", "none", "warn", no_gpu_reason());
    c.add("GEMM", "not run", "warn", "no GPU");
    c.add("copy bandwidth", "not run", "warn", "no GPU");
    // What this machine can still do.
    const auto cpu = make_cpu_backend();
    const MemoryStats m = cpu->memory_stats();
    c.add("CPU backend", "available", "info",
          fmt::format("{}, {:.1f} GiB of memory: tessera train --device cpu (fp32, "
                      "--nproc_per_node N thread ranks), tessera memory --gpu NAME (any GPU's "
                      "plan), bench on the CPU, report, plot, convert, generate",
                      cpu->description(), m.device_total_bytes / (1024.0 * 1024.0 * 1024.0)));
  } else {
    for (int i = 0; i < gpus; ++i) {
      const DeviceInfo d = i == 0 ? *g : *gpu_info(i);
      c.add(fmt::format("GPU {}", i), d.name, "info",
            fmt::format("compute capability {}, {} SMs, {:.0f} MiB L2", d.compute_capability,
                        d.multiprocessors, d.l2_bytes / (1024.0 * 1024.0)));
    }
    const std::string driver = fmt::format("{} driver", platform->name());
    c.expect(version_code(g->driver) >= version_code(g->runtime), driver, g->driver,
             fmt::format("supports {} {}; the runtime tessera is built with needs {}",
                         platform->name(), g->driver, g->runtime));
    c.add(fmt::format("{} runtime", platform->name()), g->runtime, "info",
          "linked statically into tessera");
    c.add(g->blas.substr(0, g->blas.find(' ')), g->blas.substr(g->blas.find(' ') + 1), "info",
          "GEMMs");
    for (const RuntimeLibrary& lib : platform->runtime_libraries())
      c.expect(lib.found(), lib.name, lib.found() ? lib.version : "not found",
               lib.found() ? lib.used_for : lib.version + "; " + lib.when_missing);

    const std::optional<analysis::GpuSpec> spec = resolve_gpu_spec(o.gpu);
    if (!spec) {
      c.add("spec", "unknown", "warn",
            "no configs/gpus.yaml entry matches '" + g->name +
                "' (try --gpu NAME): no "
                "datasheet to compare with");
    } else {
      c.add("spec", spec->name, "info", spec->source);
      c.expect(g->total_bytes >= kCapacityPassFraction * spec->hbm_gb * kGiB, "GPU memory",
               fmt::format("{:.1f} GiB", g->total_bytes / kGiB),
               fmt::format("datasheet {:.0f} GB; much less means a MIG slice or another SKU",
                           spec->hbm_gb));
    }
    c.expect(g->free_bytes >= kFreeMemoryPassFraction * g->total_bytes, "free memory",
             fmt::format("{:.1f} GiB", g->free_bytes / kGiB),
             fmt::format("{:.0f}% of the total; less means other processes hold GPU memory",
                         100.0 * g->free_bytes / g->total_bytes));

    analysis::StatusLine status(2);
    ContextOptions co;
    co.device = DeviceChoice::Gpu;
    co.gpu = spec ? spec->name : "";
    co.warmup = 3;
    co.iters = 10;
    BenchContext ctx = make_context(co);
    status.step(fmt::format("GEMM bf16 {}^3", o.gemm_size));
    const GemmProblem p{
        fmt::format("{}^3", o.gemm_size), o.gemm_size, o.gemm_size, o.gemm_size, false, true};
    const GemmResult gemm = run_gemm(ctx, p);
    const double gemm_peak = spec ? spec->bf16_tflops : 0;
    if (!gemm.check.ok) {
      c.add("GEMM", "FAILED", "warn", "wrong result: " + gemm.check.failure);
    } else {
      c.expect(gemm_peak > 0 && gemm.tflops >= kGemmPassFraction * gemm_peak, "GEMM",
               fmt::format("{:.0f} TFLOP/s", gemm.tflops),
               gemm_peak > 0 ? fmt::format("{:.0f}% of the {:.0f} TFLOP/s bf16 datasheet peak",
                                           100 * gemm.tflops / gemm_peak, gemm_peak)
                             : std::string("no datasheet peak to compare with"));
    }
    status.step(fmt::format("copy {} MiB", o.copy_mib));
    const CopyResult copy = run_copy(ctx, static_cast<size_t>(o.copy_mib) << 20);
    const double copy_peak = spec ? spec->hbm_tbps * 1000 : 0;
    if (!copy.ok) {
      c.add("copy bandwidth", "FAILED", "warn", "wrong result: " + copy.failure);
    } else {
      c.expect(copy_peak > 0 && copy.gbps >= kCopyPassFraction * copy_peak, "copy bandwidth",
               fmt::format("{:.0f} GB/s", copy.gbps),
               copy_peak > 0 ? fmt::format("{:.0f}% of the {:.0f} GB/s HBM datasheet bandwidth",
                                           100 * copy.gbps / copy_peak, copy_peak)
                             : std::string("no datasheet bandwidth to compare with"));
    }
    status.finish();
  }
  if (gpus > 1) {
    std::string why;
    const std::optional<double> busbw = all_reduce_busbw(gpus, &why);
    c.expect(busbw.has_value(), "all-reduce",
             busbw ? fmt::format("{:.0f} GB/s busbw", *busbw) : std::string("FAILED"),
             busbw ? fmt::format("NCCL, {} GPUs, 256 MiB fp32, result checked; busbw as "
                                 "nccl-tests defines it",
                                 gpus)
                   : why);
  } else {
    c.add("all-reduce", "skipped", "info", "needs two or more GPUs");
  }

  r.warnings = c.warnings();
  r.markdown =
      analysis::markdown_table(t) +
      (r.warnings == 0 ? std::string("\nverdict: PASS (every check passed)\n")
                       : fmt::format("\nverdict: WARN ({} line(s) to look at)\n", r.warnings));
  return r;
}

}  // namespace tessera::bench
