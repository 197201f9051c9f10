#include "tessera/bench/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/measure.h"
#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/env.h"
#include "tessera/distributed/rendezvous.h"
#include "tessera/obs/logger.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;
const std::vector<std::string> kCollectives = {"all_reduce", "all_gather", "reduce_scatter",
                                               "all_to_all", "broadcast"};

struct Buffers {
  Tensor in, out;  // fp32; `in` is the in-place buffer of all_reduce and broadcast
};

// Fills the inputs so that every element of the result is known: rank r's block j holds
// r * n + j + 1 (exact in fp32 for any reasonable n).
void fill_inputs(Backend& b, const std::string& c, const Buffers& buf, int rank, int n) {
  const int64_t block = buf.in.numel() / n;
  for (int j = 0; j < n; ++j)
    b.fill(buf.in.flat_range(j * block, block), static_cast<float>(rank * n + j + 1));
  if (c == "all_gather") b.fill(buf.out, -1.0f);
  if (c == "reduce_scatter" || c == "all_to_all") b.fill(buf.out, -1.0f);
}

// The expected value of result element block j (the result tensor's n blocks, or 1 block).
float expected(const std::string& c, int rank, int n, int j) {
  if (c == "all_reduce") {
    float s = 0;
    for (int r = 0; r < n; ++r) s += static_cast<float>(r * n + j + 1);
    return s;
  }
  if (c == "reduce_scatter") {
    float s = 0;
    for (int r = 0; r < n; ++r) s += static_cast<float>(r * n + rank + 1);
    return s;
  }
  if (c == "all_gather") return static_cast<float>(j * n + 0 + 1);  // rank j's first block
  if (c == "all_to_all") return static_cast<float>(j * n + rank + 1);
  return static_cast<float>(0 * n + j + 1);  // broadcast from rank 0
}

void run(dist::Communicator& comm, const std::string& c, const Buffers& buf) {
  const int64_t per_rank = buf.in.numel() / comm.size();
  if (c == "all_reduce") comm.all_reduce(buf.in, dist::ReduceOp::Sum, dist::Lane::Compute);
  else if (c == "broadcast") comm.broadcast(buf.in, 0, dist::Lane::Compute);
  else if (c == "reduce_scatter") comm.reduce_scatter(buf.out.flat_range(0, per_rank), buf.in, dist::Lane::Compute);
  else if (c == "all_gather") comm.all_gather(buf.out, buf.in.flat_range(0, per_rank), dist::Lane::Compute);
  else comm.all_to_all(buf.out, buf.in, dist::Lane::Compute);
}

// Empty when the result is right, else what is wrong.
std::string check(Backend& b, dist::Communicator& comm, const std::string& c, const Buffers& buf) {
  const int n = comm.size(), rank = comm.rank();
  fill_inputs(b, c, buf, rank, n);
  run(comm, c, buf);
  const bool in_place = c == "all_reduce" || c == "broadcast";
  const Tensor result = in_place ? buf.in : c == "reduce_scatter" ? buf.out.flat_range(0, buf.in.numel() / n) : buf.out;
  std::vector<float> host(static_cast<size_t>(result.numel()));
  b.download(host.data(), result);
  const int blocks = c == "reduce_scatter" ? 1 : n;
  const int64_t block = result.numel() / blocks;
  for (int j = 0; j < blocks; ++j) {
    const float want = expected(c, rank, n, j);
    for (int64_t i = j * block; i < (j + 1) * block; ++i)
      if (host[static_cast<size_t>(i)] != want)
        return fmt::format("rank {}: element {} is {}, expected {}", rank, i, host[static_cast<size_t>(i)], want);
  }
  return "";
}

}  // namespace

double bus_bandwidth_factor(const std::string& collective, int n) {
  if (collective == "all_reduce") return 2.0 * (n - 1) / n;
  if (collective == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

int comm_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera launch --nproc_per_node N bench comm [--min_bytes 1024]\n"
        "         [--max_bytes 1073741824] [--step_factor 4] [--ops all_reduce,all_gather,...]\n"
        "         [--warmup 5] [--iters 20] [-o DIR]\n\n"
        "NCCL all_reduce, all_gather, reduce_scatter, all_to_all and broadcast of fp32 data\n"
        "over a size sweep, one GPU per rank. Each result is checked element by element before\n"
        "timing. time = the slowest rank's median; algbw = size / time; busbw = algbw x\n"
        "nccl-tests' factor (all_reduce 2(n-1)/n, all_gather/reduce_scatter/all_to_all (n-1)/n,\n"
        "broadcast 1), size being the largest buffer a rank holds (nccl-tests' convention).\n"
        "Rank 0 prints the table; -o DIR writes bench_comm.csv and .md.\n");
    return 0;
  }
  const CommandArgs a(args, {"min_bytes", "max_bytes", "step_factor", "ops", "warmup", "iters", "output"},
                      {}, false);
  const int64_t min_bytes = a.get_int("min_bytes", 1024);
  const int64_t max_bytes = a.get_int("max_bytes", int64_t{1} << 30, min_bytes);
  const int64_t step = a.get_int("step_factor", 4, 2);
  const int warmup = static_cast<int>(a.get_int("warmup", 5, 0));
  const int iters = static_cast<int>(a.get_int("iters", 20));
  const std::vector<std::string> ops = a.get_list("ops", kCollectives);
  for (const auto& op : ops)
    if (std::find(kCollectives.begin(), kCollectives.end(), op) == kCollectives.end())
      throw ConfigError("command line", "ops", op, "collectives among all_reduce, all_gather, "
                        "reduce_scatter, all_to_all, broadcast");

  const dist::DistEnv env = dist::dist_env_from_process();
  const double timeout_s = 600;
  dist::Rendezvous rendezvous(env, timeout_s);
  auto backend =
      make_backend(DeviceChoice::Gpu, dist::device_for_local_rank(env, gpu_device_count()));
  Logger log("", env.rank, env.rank == 0, false);
  auto comm = make_communicator(*backend, rendezvous, timeout_s, log);
  const int n = comm->size();

  analysis::Table t;
  t.name = "bench_comm";
  t.title = fmt::format("NCCL collectives on {} ranks ({})", n, backend->description());
  t.note = fmt::format("fp32; median of {} samples after {} warm-up calls, slowest rank; algbw = "
                       "size / time, busbw = algbw x bus factor (nccl-tests).", iters, warmup);
  t.columns = {{"collective", true}, {"size_bytes"}, {"count"}, {"time_us"},
               {"algbw_gbps"},       {"busbw_gbps"}, {"status"}};
  t.summary_rows = 0;
  DeviceBuffer scalar(*backend, sizeof(float), "bench comm time");
  const Tensor slowest = scalar.tensor(DType::F32, {1});
  int failures = 0;
  std::map<std::string, double> best_busbw;
  for (const auto& c : ops) {
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= step) {
      // Whole fp32 elements, divisible into one block per rank.
      const int64_t count = std::max<int64_t>(bytes / 4 / n, 1) * n;
      const size_t size = static_cast<size_t>(count) * 4;
      DeviceBuffer in_buf(*backend, size, "bench comm input");
      DeviceBuffer out_buf(*backend, size, "bench comm output");
      const Buffers buf{in_buf.tensor(DType::F32, {count}), out_buf.tensor(DType::F32, {count})};
      const std::string wrong = check(*backend, *comm, c, buf);
      if (!wrong.empty()) {
        ++failures;
        t.rows.push_back({c, static_cast<int64_t>(size), count, analysis::Cell{}, analysis::Cell{},
                          analysis::Cell{}, "FAILED: " + wrong});
        continue;
      }
      // Every rank must issue the same number of collectives: calls per sample depend on
      // the size only, never on a rank's own clock.
      const int calls = size <= (1u << 20) ? 20 : size <= (64u << 20) ? 5 : 1;
      for (int i = 0; i < warmup; ++i) run(*comm, c, buf);
      backend->synchronize();
      std::vector<double> samples;
      for (int s = 0; s < iters; ++s) {
        const auto t0 = Clock::now();
        for (int i = 0; i < calls; ++i) run(*comm, c, buf);
        backend->synchronize();
        samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / calls);
      }
      std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
      const float median = static_cast<float>(samples[samples.size() / 2]);
      backend->upload(slowest, &median);
      comm->all_reduce(slowest, dist::ReduceOp::Max, dist::Lane::Compute);
      float seconds = 0;
      backend->download(&seconds, slowest);
      const double algbw = static_cast<double>(size) / seconds / 1e9;
      const double busbw = algbw * bus_bandwidth_factor(c, n);
      best_busbw[c] = std::max(best_busbw[c], busbw);
      t.rows.push_back({c, static_cast<int64_t>(size), count, seconds * 1e6, algbw, busbw, std::string("ok")});
    }
  }
  comm->finalize();
  rendezvous.close();
  if (env.rank != 0) return failures ? kExitRuntimeFailure : 0;
  std::string md = analysis::markdown_table(t);
  md += "\npeak busbw (GB/s):";
  for (const auto& c : ops) md += fmt::format(" {} {:.1f};", c, best_busbw[c]);
  md += failures ? fmt::format(" {} size(s) FAILED their check.\n", failures) : "\n";
  analysis::print_and_write(a.get("output", ""), {t}, "bench_comm.md", md);
  return failures ? kExitRuntimeFailure : 0;
}

}  // namespace tessera::bench
