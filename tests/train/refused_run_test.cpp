// Runs refused before they start, through the real binary: each exits with its code and a
// message naming the key and what was expected, and leaves the disk as it found it. No
// experiment or save directory is created, no lock file is left, no earlier run is moved to
// previous_runs/, and no file a lock path points at is written.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <map>

#include "ckpt/ckpt_test_util.h"
#include "common/tiny_run.h"
#include "tessera/backend/backend_factory.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Every file and directory under `dir` with its content (a link with its target): what a
// refused run must leave as it was.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  if (!fs::exists(fs::symlink_status(dir))) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    out[rel] = e.is_symlink()        ? "-> " + fs::read_symlink(e.path()).string()
               : e.is_regular_file() ? read_file(e.path())
                                     : std::string("<dir>");
  }
  return out;
}

// tiny_args without `--device cpu`: the default device, which is the CPU on a machine without
// a GPU (where bf16 and FP8 cannot run).
std::string default_device_args(const fs::path& workspace, const std::string& exp) {
  std::string args = tiny_args(workspace, exp);
  args.erase(args.find("--device cpu "), std::string("--device cpu ").size());
  return args;
}

TEST(RefusedRuns, ALockFileThatIsALinkOrAnotherProgramsFileIsNeverWritten) {
  ScratchDir dir;
  const fs::path victim = dir / "victim.txt", root = dir / "g" / "u" / "e";
  const std::string precious = "precious first line\nsecond line\n";
  write_file(victim, precious);
  fs::create_directories(root);
  fs::create_symlink(victim, root / ".tessera.lock");
  RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'exp_name'")) << r.output;
  EXPECT_TRUE(contains(r.output, (root / ".tessera.lock").string() + " is a symbolic link"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "precious")) << "the link's target leaked into the output";
  EXPECT_EQ(read_file(victim), precious);
  EXPECT_EQ(snapshot(root).size(), 1u) << "a refused run wrote into the experiment directory";

  // The same for the save directory's lock; the experiment directory it would have made is
  // not left behind.
  const fs::path save = dir / "ckpt";
  fs::create_directories(save);
  fs::create_symlink(victim, save / ".tessera.lock");
  r = run_tessera(tiny_args(dir.path(), "s") + " --train_iters 2 --save " + save.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'save'")) << r.output;
  EXPECT_TRUE(contains(r.output, "is a symbolic link")) << r.output;
  EXPECT_EQ(read_file(victim), precious);
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "s"));
  EXPECT_EQ(snapshot(save).size(), 1u);

  // A hard link to another file, and a file another program wrote, are refused too.
  fs::remove(root / ".tessera.lock");
  fs::create_hard_link(victim, root / ".tessera.lock");
  r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "is a file with 2 hard links")) << r.output;
  EXPECT_EQ(read_file(victim), precious);
  fs::remove(root / ".tessera.lock");
  write_file(root / ".tessera.lock", precious);
  r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "holds " + std::to_string(precious.size()) +
                                     " bytes that are not a Tessera lock note"))
      << r.output;
  EXPECT_EQ(read_file(root / ".tessera.lock"), precious);
  EXPECT_EQ(snapshot(root).size(), 1u);
}

TEST(RefusedRuns, ARunTheDeviceCannotRunLeavesAFinishedRunsDirectoryAsItWas) {
  if (gpu_device_count() > 0) GTEST_SKIP() << "skipped: this machine has a GPU";
  ScratchDir dir;
  const fs::path root = dir / "g" / "u" / "e";
  ASSERT_EQ(run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2").exit_code, 0);
  const auto before = snapshot(root);
  ASSERT_TRUE(before.count("metrics.jsonl") && before.count("config.yaml"));
  struct Case {
    std::string flags, says;
  } cases[] = {
      {"--fp8 hybrid", "key 'fp8' has value 'hybrid': expected null on cpu"},
      {"--precision bf16",
       "key 'precision' has value 'bf16': expected fp32 or auto on cpu (OpenBLAS"},
      {"--bf16", "key 'precision' has value 'bf16': expected fp32 or auto on cpu"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    RunResult r = run_tessera(default_device_args(dir.path(), "e") + " --train_iters 2 " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, c.says)) << r.output;
    EXPECT_EQ(snapshot(root), before) << "the finished run's files changed";
    EXPECT_FALSE(fs::exists(root / "previous_runs"));
    // Into a fresh directory: not even the directory.
    r = run_tessera(default_device_args(dir.path(), "fresh") + " --train_iters 2 " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_FALSE(fs::exists(dir / "g" / "u" / "fresh"));
  }
  // generate refuses bf16 on the CPU the same way, before it reads the checkpoint.
  const RunResult r = run_tessera("generate --from " + (dir / "nowhere").string() +
                                  " --prompt_ids 1 --precision bf16");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'precision' has value 'bf16': expected auto or fp32 on cpu"))
      << r.output;
}

TEST(RefusedRuns, AnUnusableSaveDirectoryLeavesNoDirectoryBehind) {
  ScratchDir dir;
  const fs::path ws = dir / "ws";
  write_file(dir / "a_file", "x");
  RunResult r = run_tessera(tiny_args(ws, "e") + " --train_iters 2 --save " +
                            (dir / "a_file" / "ck").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'save'") && contains(r.output, "is a regular file"))
      << r.output;
  EXPECT_FALSE(fs::exists(ws)) << "the experiment directory was made for a refused run";

  // An immutable directory refuses even root (where the file system supports the flag).
  fs::create_directories(dir / "frozen");
  if (run_command("chattr +i " + (dir / "frozen").string()).exit_code == 0) {
    r = run_tessera(tiny_args(ws, "e") + " --train_iters 2 --save " +
                    (dir / "frozen" / "ck").string());
    run_command("chattr -i " + (dir / "frozen").string());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "key 'save'")) << r.output;
    EXPECT_FALSE(fs::exists(ws));
  }

  // Another run holds the save directory: this process, as a running trainer would.
  const fs::path held = dir / "held";
  fs::create_directories(held);
  {
    const int fd = ::open((held / ".tessera.lock").c_str(), O_RDWR | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    const std::string me = "PID " + std::to_string(::getpid()) + " (tessera train --holder)";
    ASSERT_EQ(::write(fd, me.data(), me.size()), static_cast<ssize_t>(me.size()));
    r = run_tessera(tiny_args(ws, "e") + " --train_iters 2 --save " + held.string());
    ::close(fd);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "tessera train --holder")) << r.output;
    EXPECT_FALSE(fs::exists(ws));
    EXPECT_EQ(read_file(held / ".tessera.lock"), me);
  }

  // The save directory holds another run's checkpoints: refused before anything is made.
  const fs::path ck = dir / "ck";
  ASSERT_EQ(run_tessera(tiny_args(dir / "other", "a") + " --train_iters 2 --save " + ck.string())
                .exit_code,
            0);
  const auto checkpoints = snapshot(ck);
  r = run_tessera(tiny_args(ws, "b") + " --train_iters 2 --save " + ck.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "a save directory without another run's checkpoints")) << r.output;
  EXPECT_FALSE(fs::exists(ws));
  EXPECT_EQ(snapshot(ck), checkpoints);
}

TEST(RefusedRuns, OverlongPathsAreNamedByTheirKeyBeforeAnythingIsWritten) {
  ScratchDir dir;
  const fs::path ws = dir / "ws";
  RunResult r = run_tessera(tiny_args(ws, "e") + " --train_iters 2 --save " +
                            (dir / std::string(300, 's')).string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'save'")) << r.output;
  EXPECT_TRUE(contains(r.output, "a path component of 300 bytes; names are at most 255 bytes"))
      << r.output;
  EXPECT_FALSE(fs::exists(ws));

  std::string deep = dir.path().string();
  while (deep.size() < 5000) deep += "/" + std::string(200, 'd');
  r = run_tessera(tiny_args(ws, "e") + " --train_iters 2 --save " + deep);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'save'")) << r.output;
  EXPECT_TRUE(contains(r.output, "paths are at most 4095 bytes")) << r.output;
  EXPECT_FALSE(fs::exists(ws));

  r = run_tessera(tiny_args(dir / std::string(300, 'w'), "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'workspace'")) << r.output;
  EXPECT_TRUE(contains(r.output, "names are at most 255 bytes")) << r.output;
}

// A micro-batch no host holds is planned, not allocated: exit 3 at once with the breakdown,
// before anything is written (4294967296 used to abort in an allocation, 33554432 to allocate
// for minutes).
TEST(RefusedRuns, AMicroBatchThatCannotFitIsRefusedWithTheBreakdownBeforeAllocating) {
  ScratchDir dir;
  for (const std::string mbs : {"4294967296", "33554432"}) {
    SCOPED_TRACE(mbs);
    const auto start = Clock::now();
    const RunResult r =
        run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2 --seq_length 16 " +
                    "--micro_batch_size " + mbs + " --global_batch_size " + mbs);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_TRUE(contains(r.output, "error: not enough memory on cpu: the run needs")) << r.output;
    EXPECT_TRUE(contains(r.output, "Breakdown: weights")) << r.output;
    EXPECT_TRUE(contains(r.output, "(micro_batch_size " + mbs + ", seq_length 16")) << r.output;
    EXPECT_TRUE(contains(r.output, "the host batch")) << r.output;
    EXPECT_TRUE(contains(r.output, "To fit: lower micro_batch_size")) << r.output;
    EXPECT_LT(seconds, 10.0);
    EXPECT_FALSE(fs::exists(dir / "g")) << "a refused run wrote its directory";
  }
}

}  // namespace
}  // namespace tessera::testing
