// What a run does to the files around it, through the real binary: output locations are
// checked before any work (exit 2 naming the key), experiment and save directories are locked
// (a second run exits 2 naming the holder; a dead run's lock is taken over), a save directory
// holding another run's checkpoints is refused, a rerun moves the previous run's files aside
// and gets its own run id, a second SIGTERM ends the process at once, a SIGTERM during set-up
// gives a message and flushed logs, killed runs' temporary files are removed at the next
// start, and a resume at the end trains nothing and says so. Last, runs killed at random
// points and inside saves: the newest complete checkpoint always loads and resumes bitwise.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string_view>
#include <thread>

#include <nlohmann/json.hpp>

#include "ckpt/ckpt_test_util.h"
#include "common/tiny_run.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/viz/run_data.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

// (iteration -> loss) of a metrics file's training records.
std::map<int64_t, double> losses(const fs::path& file) {
  std::map<int64_t, double> out;
  for (const auto& j : metrics_lines(file))
    if (j.contains("lm_loss")) out[j["iteration"].get<int64_t>()] = j["lm_loss"].get<double>();
  return out;
}

// Starts tessera with `args` (or the whole `command`, when given) in the background, its
// output in `log`.
pid_t spawn(const std::string& args, const fs::path& log, const std::string& command = "") {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string run = command.empty() ? std::string(TESSERA_BINARY) + " " + args : command;
    const std::string cmd = "exec " + run + " > " + log.string() + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

TEST(RunOutputs, UnwritableLocationsFailBeforeAnyWork) {
  ScratchDir dir;
  const fs::path file = dir / "a_file";
  std::ofstream(file) << "x";
  RunResult r = run_tessera(tiny_args(file / "ws", "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "'workspace'")) << r.output;
  EXPECT_TRUE(contains(r.output, "is a regular file") || contains(r.output, "Not a directory"))
      << r.output;

  r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2 --save " +
                  (file / "ckpt").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "'save'")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "e" / "metrics.jsonl")) << "it trained first";

  r = run_tessera(tiny_args(dir.path(), std::string(300, 'n')) + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "'exp_name'")) << r.output;
  EXPECT_TRUE(contains(r.output, "at most 255 bytes")) << r.output;
}

TEST(RunOutputs, AReadOnlyWorkspaceFailsBeforeAnyWork) {
  if (::geteuid() == 0) GTEST_SKIP() << "skipped: a read-only directory does not stop root";
  ScratchDir dir;
  fs::create_directories(dir / "ro");
  fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  const RunResult r = run_tessera(tiny_args(dir / "ro", "e") + " --train_iters 2");
  fs::permissions(dir / "ro", fs::perms::owner_all);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "Permission denied")) << r.output;
}

TEST(RunLocks, ASecondRunExitsNamingTheHolderAndADeadRunsLockIsTakenOver) {
  ScratchDir dir;
  const fs::path root = dir / "g" / "u" / "e";
  fs::create_directories(root);
  {  // This test process holds the experiment directory, as a running trainer would.
    const int fd = ::open((root / ".tessera.lock").c_str(), O_RDWR | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    const std::string me = "PID " + std::to_string(::getpid()) + " (tessera train --holder)";
    ASSERT_EQ(::write(fd, me.data(), me.size()), static_cast<ssize_t>(me.size()));
    const RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2");
    ::close(fd);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "PID " + std::to_string(::getpid()))) << r.output;
    EXPECT_TRUE(contains(r.output, "tessera train --holder")) << r.output;
    EXPECT_FALSE(fs::exists(root / "metrics.jsonl"));
  }
  // The lock file still names the holder, which has let go (as after a kill -9).
  const RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "took over a lock left by PID " + std::to_string(::getpid())))
      << r.output;
  EXPECT_EQ(read_file(root / ".tessera.lock"), "") << "a finished run leaves an empty lock file";
}

TEST(RunSaves, AnotherRunsCheckpointsAreNeverPrunedOrMixedWith) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  RunResult r = run_tessera(tiny_args(dir.path(), "a") +
                            " --train_iters 3 --save_interval 1 "
                            "--ckpt_keep_last 2 --save " +
                            save);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto before = saved_checkpoints(save);
  ASSERT_EQ(before.size(), 2u);
  ASSERT_TRUE(before[0].run_id && !before[0].run_id->empty());

  r = run_tessera(tiny_args(dir.path(), "b") +
                  " --train_iters 3 --save_interval 1 "
                  "--ckpt_keep_last 1 --save " +
                  save);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "'save'") && contains(r.output, "--load " + save)) << r.output;
  const auto after = saved_checkpoints(save);
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(after[1].iteration, 3);

  // Resuming that run there is what the directory is for; its checkpoints keep its id.
  r = run_tessera(tiny_args(dir.path(), "a") +
                  " --train_iters 5 --save_interval 1 "
                  "--ckpt_keep_last 2 --save " +
                  save + " --load " + save);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto resumed = saved_checkpoints(save);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[1].iteration, 5);
  EXPECT_EQ(resumed[1].run_id, before[0].run_id);
}

TEST(RunReruns, APreviousRunMovesAsideAndEveryLineCarriesItsRunId) {
  ScratchDir dir;
  const fs::path root = dir / "g" / "u" / "e";
  ASSERT_EQ(run_tessera(tiny_args(dir.path(), "e") + " --train_iters 6").exit_code, 0);
  const std::string first_id = metrics_lines(root / "metrics.jsonl").back()["run_id"];
  const RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "previous_runs/" + first_id)) << r.output;
  const fs::path archived = root / "previous_runs" / first_id;
  EXPECT_EQ(losses(archived / "metrics.jsonl").size(), 6u);
  EXPECT_TRUE(fs::exists(archived / "config.yaml"));
  EXPECT_TRUE(fs::exists(archived / "logs" / "pre_trainer" / "rank-0" / "info.log"));
  const auto lines = metrics_lines(root / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& j : lines) EXPECT_NE(j["run_id"], first_id);
  EXPECT_EQ(viz::load_run(root).iterations.size(), 3u);

  // TensorBoard files under the experiment root go with their run; the fresh run's file is
  // the only one left for TensorBoard to draw.
  const auto event_files = [](const fs::path& d) {
    std::vector<fs::path> files;
    if (fs::exists(d))
      for (const auto& entry : fs::directory_iterator(d))
        if (entry.path().filename().string().find("tfevents") != std::string::npos)
          files.push_back(entry.path());
    return files;
  };
  const std::string tb = " --tensorboard_dir tb --tensorboard_log_interval 1";
  ASSERT_EQ(run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2" + tb).exit_code, 0);
  const std::string tb_id = metrics_lines(root / "metrics.jsonl").back()["run_id"];
  ASSERT_EQ(event_files(root / "tb").size(), 1u);
  const RunResult tb_rerun = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 2" + tb);
  ASSERT_EQ(tb_rerun.exit_code, 0) << tb_rerun.output;
  EXPECT_TRUE(contains(tb_rerun.output, "TensorBoard events")) << tb_rerun.output;
  EXPECT_EQ(event_files(root / "tb").size(), 1u);
  EXPECT_EQ(event_files(root / "previous_runs" / tb_id / "tb").size(), 1u);

  // A file two runs appended to before runs had ids: plot reads the last one.
  const fs::path legacy = dir / "legacy";
  fs::create_directories(legacy);
  std::ofstream out(legacy / "metrics.jsonl");
  for (int run = 0; run < 2; ++run)
    for (int it = 1; it <= (run == 0 ? 6 : 3); ++it)
      out << nlohmann::json{{"iteration", it}, {"lm_loss", 10.0 - run - 0.1 * it}}.dump() << "\n";
  out.close();
  const viz::RunData legacy_run = viz::load_run(legacy);
  EXPECT_TRUE(legacy_run.earlier_runs_left_out);
  ASSERT_EQ(legacy_run.iterations.size(), 3u);
  EXPECT_DOUBLE_EQ(legacy_run.iterations[0].lm_loss, 9.0 - 0.1);
}

TEST(RunSignals, ASecondSigtermEndsTheProcessAtOnce) {
  ScratchDir dir;
  const fs::path log = dir / "out.txt", root = dir / "g" / "u" / "e";
  // Saving at every iteration makes the first signal's clean stop take a while.
  const pid_t pid = spawn(tiny_args(dir.path(), "e") +
                              " --train_iters 1000000 --save_interval 1 "
                              "--save " +
                              (dir / "ckpt").string(),
                          log);
  for (int i = 0; i < 600 && !fs::exists(root / "metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(fs::exists(root / "metrics.jsonl")) << read_file(log);
  kill(pid, SIGTERM);
  kill(pid, SIGTERM);
  int status = 0;
  const auto t0 = Clock::now();
  waitpid(pid, &status, 0);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0);
  // Either the second signal ended it, or the first stop finished before it arrived.
  EXPECT_TRUE(WIFSIGNALED(status) ? WTERMSIG(status) == SIGTERM
                                  : WEXITSTATUS(status) == 128 + SIGTERM)
      << read_file(log);
}

TEST(RunSignals, ASigtermDuringSetUpGivesAMessageAndFlushedLogs) {
  ScratchDir dir;
  const fs::path log = dir / "out.txt", root = dir / "g" / "u" / "e";
  // Set-up on real text in Llama 3 tokens takes a while: the tokenizer and the dataset index.
  // (the default experiment's data: the Brown corpus, preprocessed by scripts/setup.sh).
  const std::string args =
      tiny_args(dir.path(), "e") + " --mock_data false --vocab_size 0 --train_iters 1000000";
  const pid_t pid = spawn(args, log);
  const fs::path info = root / "logs" / "pre_trainer" / "rank-0" / "info.log";
  // The config is loaded and the log opened within milliseconds; the data take longer.
  for (int i = 0; i < 400 && !fs::exists(info); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << read_file(log);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_file(log);
  const std::string logged = read_file(info);
  EXPECT_TRUE(contains(logged, "received SIGTERM: stopped before training"))
      << logged << read_file(log);
  EXPECT_FALSE(fs::exists(root / "metrics.jsonl") &&
               !metrics_lines(root / "metrics.jsonl").empty());
}

TEST(RunStart, KilledRunsTemporaryFilesAreRemovedAndAResumeAtTheEndTrainsNothing) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const std::string args = tiny_args(dir.path(), "e") + " --save " + save + " --load " + save;
  ASSERT_EQ(run_tessera(args + " --train_iters 3").exit_code, 0);
  fs::create_directories(fs::path(save) / "iter_0000009.tmp");  // a save killed midway
  std::ofstream(dir / "g" / "u" / "e" / "metrics.jsonl.tmp-999999999") << "x";  // a dead PID's

  const RunResult r = run_tessera(args + " --train_iters 3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(fs::path(save) / "iter_0000009.tmp"));
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "e" / "metrics.jsonl.tmp-999999999"));
  EXPECT_TRUE(contains(r.output, "iter_0000009.tmp, left by a killed run")) << r.output;
  EXPECT_TRUE(contains(r.output, "nothing to train: the run resumed at iteration 3")) << r.output;
  EXPECT_FALSE(contains(r.output, "TFLOP/s/GPU (excluding")) << r.output;
}

// Blocks until a directory whose name ends in ".tmp" appears in `dir` (an unfinished
// checkpoint, `iter_N.tmp`), as the kernel reports it through inotify; false after 30 s.
bool wait_for_unfinished_checkpoint(const fs::path& dir) {
  const int fd = ::inotify_init1(IN_CLOEXEC);
  if (fd < 0 || ::inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_ONLYDIR) < 0) {
    if (fd >= 0) ::close(fd);
    return false;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  alignas(struct inotify_event) char buffer[4096];
  bool found = false;
  while (!found && Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    for (ssize_t at = 0; at < n;) {
      const auto* e = reinterpret_cast<const struct inotify_event*>(buffer + at);
      if (e->len > 0 && std::string_view(e->name).ends_with(".tmp")) found = true;
      at += static_cast<ssize_t>(sizeof(struct inotify_event) + e->len);
    }
  }
  ::close(fd);
  return found;
}

// Runs killed (SIGKILL) at random points, each then resumed with the same command: the
// newest complete checkpoint always loads, and the resumed run's losses are the
// uninterrupted run's, bit for bit. 20 kills land a random 0-8 ms after a random iteration
// was logged: inside the next iteration or its checkpoint save, wherever that is on a machine
// of any speed; 8 more aim inside a save: the run is stopped when a save creates its
// iter_N.tmp directory and killed while that is still unfinished (else let go to its next
// save; on a heavily loaded machine a few saves still finish first). A kill counts as mid-save
// when it leaves that unfinished directory behind (which the resumed run removes).
TEST(RunFaults, RandomKillsAlwaysLeaveALoadableCheckpointThatResumesBitwise) {
  ScratchDir dir;
  constexpr int kIters = 20, kRandomKills = 20, kSaveKills = 8;
  // One OpenMP thread: on a loaded machine spinning thread teams slow tiny runs a hundredfold.
  const std::string env = "env OMP_NUM_THREADS=1 ";
  const std::string common =
      " --save_interval 1 --ckpt_keep_last 2 --train_iters " + std::to_string(kIters);
  ASSERT_EQ(run_command(env + TESSERA_BINARY + " " + tiny_args(dir.path(), "reference") + common)
                .exit_code,
            0);
  const auto reference = losses(dir / "g" / "u" / "reference" / "metrics.jsonl");
  ASSERT_EQ(reference.size(), static_cast<size_t>(kIters));

  std::mt19937 rng(2026);
  // From iteration 2 on, the checkpoint of the one before is complete (a line is logged
  // before its iteration saves, so a kill a few ms after a line lands in that save). Twelve or
  // more iterations stay after the kill: a fast machine runs one with its save in a few ms, a
  // loaded one slower, so the kills land inside the runs either way.
  std::uniform_int_distribution<int> after_iteration(2, kIters - 12), extra_ms(0, 8);
  int killed_mid_run = 0, killed_mid_save = 0, save_kills_mid_save = 0;
  for (int attempt = 0; attempt < kRandomKills + kSaveKills; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    const bool at_save = attempt >= kRandomKills;
    const std::string name = "try" + std::to_string(attempt);
    const fs::path save = dir / (name + "_ckpt");
    const std::string args = tiny_args(dir.path(), name) + common + " --save " + save.string() +
                             " --load " + save.string();
    const fs::path metrics = dir / "g" / "u" / name / "metrics.jsonl";
    fs::create_directories(save);
    const size_t k = static_cast<size_t>(after_iteration(rng));
    const int extra = extra_ms(rng);
    const pid_t pid = spawn("", dir / (name + ".txt"), env + TESSERA_BINARY + " " + args);
    for (int i = 0; i < 30000 && (!fs::exists(metrics) || losses(metrics).size() < k); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (at_save) {
      // A tiny model's save takes milliseconds, less than a loaded machine may take to deliver
      // a signal after the directory appears: the run is stopped first, and killed only if its
      // save is still unfinished; otherwise it goes on to its next save.
      bool inside = false;
      for (int save_try = 0; !inside && save_try < 10; ++save_try) {
        if (!wait_for_unfinished_checkpoint(save)) break;
        kill(pid, SIGSTOP);
        int status = 0;
        waitpid(pid, &status, WUNTRACED);
        for (const auto& entry : fs::directory_iterator(save))
          inside = inside || entry.path().extension() == ".tmp";
        if (!inside) kill(pid, SIGCONT);
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(extra));
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    bool unfinished = false;
    for (const auto& entry : fs::directory_iterator(save))
      unfinished = unfinished || entry.path().extension() == ".tmp";
    killed_mid_save += unfinished;
    save_kills_mid_save += at_save && unfinished;
    // What a failure below needs to be understood: the killed run's output and what it left.
    std::string left = "killed " + std::to_string(extra) + " ms after iteration " +
                       std::to_string(k) + "; " + save.string() + " holds:";
    for (const auto& entry : fs::directory_iterator(save))
      left += " " + entry.path().filename().string();
    left += "\nits output:\n" + read_file(dir / (name + ".txt"));
    const std::string latest = find_latest_checkpoint(save.string());
    ASSERT_FALSE(latest.empty()) << left;
    try {
      const Checkpoint c(latest);  // opens and checks every file and tensor
      if (c.state().iteration < kIters) ++killed_mid_run;
    } catch (const std::exception& e) {
      FAIL() << latest << ": " << e.what() << "\n" << left;
    }
    const RunResult r = run_command(env + TESSERA_BINARY + " " + args);
    ASSERT_EQ(r.exit_code, 0) << r.output << "\n" << left;
    const auto resumed = losses(metrics);
    ASSERT_EQ(resumed.size(), static_cast<size_t>(kIters)) << read_file(metrics) << "\n" << left;
    for (const auto& [it, loss] : resumed) EXPECT_EQ(loss, reference.at(it)) << "iteration " << it;
  }
  std::printf(
      "%d kills (%d at a save's start), %d inside a run, %d inside a save; every run "
      "resumed bitwise\n",
      kRandomKills + kSaveKills, kSaveKills, killed_mid_run, killed_mid_save);
  EXPECT_GT(killed_mid_run, 20) << "the kills must land inside runs";
  EXPECT_GE(save_kills_mid_save, kSaveKills / 2) << "the kills at a save must land inside it";
}

}  // namespace
}  // namespace tessera::testing
