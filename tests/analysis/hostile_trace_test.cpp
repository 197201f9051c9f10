// `tessera report` on hostile traces, through the real binary: gzip bombs (one event of
// gigabytes; more events than the host can keep) end with exit 3 and a message, never an abort;
// durations that are negative or beyond any clock are left out with a warning instead of
// turning the timeline's sums negative; a --categories pattern that backtracks exponentially
// stops at PCRE2's limit with exit 2 naming the rule. No report file is written in any case
// that fails.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::test_dir;
using testing::write_file;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct CliRun {
  int code;
  std::string output;
  double seconds;
};

// Runs `command` (a shell command line) in `cwd`.
CliRun run(const std::string& command, const fs::path& cwd) {
  const std::string log = (cwd / "cli.log").string();
  const auto start = Clock::now();
  const int status =
      std::system(("cd '" + cwd.string() + "' && " + command + " > '" + log + "' 2>&1").c_str());
  std::stringstream text;
  text << std::ifstream(log).rdbuf();
  return {WEXITSTATUS(status), text.str(),
          std::chrono::duration<double>(Clock::now() - start).count()};
}

std::string tessera() {
  return std::string("'") + TESSERA_BINARY + "'";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A gzip file of `head`, then `repeat` times `body`, then `tail`: a small file that inflates to
// as much as the test needs.
void write_gzip(const fs::path& path, const std::string& head, const std::string& body,
                size_t repeat, const std::string& tail) {
  gzFile f = gzopen(path.c_str(), "wb1");
  ASSERT_NE(f, nullptr);
  gzwrite(f, head.data(), static_cast<unsigned>(head.size()));
  for (size_t i = 0; i < repeat; ++i) gzwrite(f, body.data(), static_cast<unsigned>(body.size()));
  gzwrite(f, tail.data(), static_cast<unsigned>(tail.size()));
  gzclose(f);
}

TEST(HostileTraces, OneEventOfHundredsOfMegabytesIsRefusedAtTheBound) {
  const fs::path dir = test_dir();
  // A 320 MB kernel name in a file of about 0.3 MB.
  write_gzip(dir / "bomb.json.gz", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "name": ")",
             std::string(1 << 20, 'a'), 320, R"(", "ts": 0, "dur": 1}]})");
  const CliRun r = run(tessera() + " report bomb.json.gz -o out", dir);
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "bomb.json.gz: invalid trace JSON at byte ")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "the value that starts at byte 17 is longer than 64 MiB; "
                       "expected trace events of at most that size"))
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
  EXPECT_LT(r.seconds, 30.0);
}

// The address space (KiB) `tessera report` has mapped when it opens its trace: its libraries
// (hundreds of MB with the GPU vendor's), their buffers, and what it set up before reading. The
// trace is a FIFO, so the process waits in its open until this end opens, and is then killed.
long address_space_when_reading_kib(const fs::path& dir) {
  const fs::path fifo = dir / "probe.json";
  if (::mkfifo(fifo.c_str(), 0600) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::execl(TESSERA_BINARY, TESSERA_BINARY, "report", fifo.c_str(), "-o",
            (dir / "probe_out").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const int fd = ::open(fifo.c_str(), O_WRONLY);  // returns once the reader has opened it
  long kib = -1;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmSize:", 0) == 0) kib = std::stol(line.substr(7));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  if (fd >= 0) ::close(fd);
  return kib;
}

// Tens of millions of tiny events outgrow a host that leaves the reader 700 MB of address space
// beyond what the binary maps before reading (the events' records alone take 1.1 GB): the
// reader runs out of memory and says so (exit 3), instead of aborting on std::bad_alloc.
TEST(HostileTraces, MoreEventsThanTheHostCanKeepEndWithAMessage) {
  const fs::path dir = test_dir();
  const std::string event = R"({"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}, )";
  std::string block;
  for (int i = 0; i < 1000; ++i) block += event;
  write_gzip(dir / "many.json.gz", R"({"traceEvents": [)", block, 20000,
             R"({"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]})");
  // One BLAS and OpenMP thread: their per-thread buffers, set up when the binary loads, must
  // not take the limited address space (OpenBLAS retries a failed buffer forever).
  const long mapped_kib = address_space_when_reading_kib(dir);
  ASSERT_GT(mapped_kib, 0);
  const CliRun r = run("ulimit -v " + std::to_string(mapped_kib + 700000) +
                           " && OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 timeout 120 " +
                           tessera() + " report many.json.gz -o out --format md",
                       dir);
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "error: many.json.gz: out of host memory after ")) << r.output;
  EXPECT_TRUE(contains(r.output, "bytes per GPU activity")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

TEST(HostileTraces, DurationsThatAreNegativeOrBeyondAnyClockAreLeftOutWithAWarning) {
  const fs::path dir = test_dir();
  testing::TraceBuilder t(dir);
  t.kernel("negative", 0, -5).kernel("real", 10, 5).kernel("real", 20, 5);
  t.kernel("past_every_clock", 9223372036854775.0, 9223372036854775.0);
  t.write("t.json");
  const CliRun r = run(tessera() + " report t.json -o out --format md", dir);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "warning: 2 complete events have a negative duration or a time "
                       "beyond any clock and were skipped (first: 'negative' at byte "))
      << r.output;
  EXPECT_TRUE(contains(r.output, "with ts 0 µs and dur -5 µs")) << r.output;
  // Only the two real kernels count: 10 µs busy of a 15 µs span.
  const size_t at = r.output.find("GPU busy");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string headline = r.output.substr(at, r.output.find('\n', at) - at);
  EXPECT_TRUE(contains(headline, "66.7% of 0.015 ms")) << headline;
  EXPECT_TRUE(contains(headline, "idle 33.3%")) << headline;
  EXPECT_FALSE(contains(headline, "-")) << "a negative number in the headline: " << headline;
}

TEST(HostileTraces, ABacktrackingCategoriesPatternExitsTwoNamingTheRule) {
  const fs::path dir = test_dir();
  testing::TraceBuilder t(dir);
  t.kernel(std::string(40, 'a') + "!", 0, 5);
  t.write("t.json");
  write_file(dir / "cats.yaml", "rules:\n  - kernel: '(a+)+$'\n    category: other\n");
  const CliRun r = run(tessera() + " report t.json -o out --categories cats.yaml", dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "cats.yaml:2: key 'rules[0].kernel' has value '(a+)+$': "
                       "expected a pattern that matches within PCRE2's limits"))
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
  EXPECT_LT(r.seconds, 30.0);
}

}  // namespace
}  // namespace tessera::analysis
