#include "tessera/train/run_directories.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/ckpt/checkpoint.h"
#include "tessera/config/blend.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLockFile = ".tessera.lock";
// A lock note, "PID 123 (tessera train ...)", is one command line long.
constexpr off_t kMaxLockNoteBytes = 1 << 16;
// A run's own files in the experiment root, moved aside when another run starts there.
constexpr const char* kRunFiles[] = {"metrics.jsonl", "config.yaml", "logs", "traces"};

std::string origin_of(const Experiment& e, const std::string& key) {
  const auto it = e.origin.find(key);
  return it == e.origin.end() ? "default" : it->second;
}

// Checks that `dir` can be created and written (core/output_path.h), before any work: a run
// must not find out at its first save, after its training time, that it cannot write. Only
// looks. Throws ConfigError naming `key`.
void require_writable_directory(const fs::path& dir, const std::string& key,
                                const std::string& value, const std::string& origin) {
  if (const std::optional<std::string> problem = output_directory_problem(dir))
    throw ConfigError(origin, key, value,
                      "a directory that can be created and written (" + *problem + ")");
}

// The experiment root comes from four keys; name the one whose part of the path is at fault.
void require_experiment_root(const Experiment& e) {
  for (const auto& [key, value] : {std::pair<std::string, std::string>{"exp_name", e.exp_name},
                                   {"user_name", e.user_name},
                                   {"work_group", e.work_group}})
    if (value.size() > 255)
      throw ConfigError(
          origin_of(e, key), key, value.substr(0, 40) + "...",
          fmt::format("a directory name of at most 255 bytes (it has {})", value.size()));
  require_writable_directory(e.experiment_root(), "workspace", e.workspace,
                             origin_of(e, "workspace"));
}

// Removes directories a refused run created, deepest first, each only while empty: what was
// there before the run, or appeared since, stays.
void remove_created_directories(const std::vector<fs::path>& created) {
  for (auto it = created.rbegin(); it != created.rend(); ++it) {
    std::error_code ec;
    if (fs::is_empty(*it, ec) && !ec) fs::remove(*it, ec);
  }
}

// Creates `dir` and the missing directories above it; returns those it created, deepest
// last, so that a run refused afterwards can remove them again.
std::vector<fs::path> create_directories_noting(const fs::path& dir, const std::string& key,
                                                const std::string& value,
                                                const std::string& origin) {
  std::vector<fs::path> missing;
  std::error_code ec;
  fs::path target = fs::absolute(dir, ec).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();  // "a/b/"
  for (fs::path p = target; !p.empty() && !fs::exists(fs::symlink_status(p, ec));
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::reverse(missing.begin(), missing.end());
  std::vector<fs::path> created;
  for (const fs::path& p : missing) {
    if (!fs::create_directory(p, ec) && ec) {
      remove_created_directories(created);
      throw ConfigError(origin, key, value,
                        fmt::format("a directory that can be created and written ({}: {})",
                                    p.string(), ec.message()));
    }
    created.push_back(p);
  }
  return created;
}

// What DirectoryLock writes into its file: nothing (released) or "PID <n> (<command line>)".
bool is_lock_note(const std::string& text) {
  static const std::regex kNote(R"(PID [0-9]+ \([^\n]*\))");
  return text.empty() || std::regex_match(text, kNote);
}

bool process_alive(long pid) {
  return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
}

std::string this_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : raw)
    if (c == '\0') c = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

// The run id of the last line of `metrics` that has one; empty when none has.
std::string last_run_id(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string id;
  for (std::string line; std::getline(in, line);) {
    try {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("run_id") && j["run_id"].is_string()) id = j["run_id"].get<std::string>();
    } catch (const nlohmann::json::exception&) {
      // A line cut by a killed run: the lines before it still tell the run.
    }
  }
  return id;
}

// The TensorBoard event files in `tensorboard_dir` when that directory lies inside the
// experiment root: they belong to this experiment's runs, and TensorBoard would draw a fresh
// run's curves on top of the previous run's. A directory outside the root may be shared by
// other experiments, so its files are left alone (as Megatron does).
std::vector<fs::path> event_files_of_root(const fs::path& root,
                                          const std::string& tensorboard_dir) {
  std::vector<fs::path> files;
  if (tensorboard_dir.empty()) return files;
  const fs::path dir = fs::weakly_canonical(tensorboard_dir);
  const fs::path relative = dir.lexically_relative(fs::weakly_canonical(root));
  if (relative.empty() || *relative.begin() == "..") return files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.is_regular_file() &&
        entry.path().filename().string().find("tfevents") != std::string::npos)
      files.push_back(entry.path());
  return files;
}

// Moves the previous run's files out of `root`, into previous_runs/<its id> (or, for a run
// from before run ids, the time its metrics were last written). Returns what it did, or "".
std::string archive_previous_run(const fs::path& root, const std::string& previous_id,
                                 const std::string& tensorboard_dir) {
  const std::vector<fs::path> events = event_files_of_root(root, tensorboard_dir);
  bool any = !events.empty();
  for (const char* f : kRunFiles) any = any || fs::exists(root / f);
  if (!any) return "";
  std::string name = previous_id;
  if (name.empty()) {
    std::error_code ec;
    const auto t = fs::last_write_time(root / "metrics.jsonl", ec);
    name = ec ? "unnamed" : fmt::format("before-run-ids-{}", t.time_since_epoch().count());
  }
  fs::path dest = root / kPreviousRunsDir / name;
  for (int n = 2; fs::exists(dest); ++n)
    dest = root / kPreviousRunsDir / fmt::format("{}.{}", name, n);
  fs::create_directories(dest);
  for (const char* f : kRunFiles)
    if (fs::exists(root / f)) fs::rename(root / f, dest / f);
  std::string what = "metrics.jsonl, config.yaml, logs";
  if (!events.empty()) {
    // Under the same relative path, so that `tensorboard --logdir previous_runs` finds them.
    const fs::path events_dest =
        dest / fs::weakly_canonical(tensorboard_dir).lexically_relative(fs::weakly_canonical(root));
    fs::create_directories(events_dest);
    for (const fs::path& f : events) fs::rename(f, events_dest / f.filename());
    what += ", TensorBoard events";
  }
  return fmt::format("the previous run's files ({}) in {} moved to {}", what, root.string(),
                     dest.string());
}

// Files named *.tmp-<PID> whose process is gone, and (in a locked save directory, where no
// live run writes) unfinished iter_*.tmp checkpoint directories. Returns the paths removed.
std::vector<std::string> remove_stale_temporaries(const fs::path& dir, bool locked_save_dir) {
  static const std::regex kPidTemp(R"(.*\.tmp-([0-9]+))");
  static const std::regex kCheckpointTemp(R"(iter_[0-9]+\.tmp)");
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    const bool stale =
        (std::regex_match(name, m, kPidTemp) && !process_alive(std::stol(m[1].str()))) ||
        (locked_save_dir && std::regex_match(name, kCheckpointTemp));
    if (!stale) continue;
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (!rm) removed.push_back(entry.path().string());
  }
  return removed;
}

// The directories the data's index caches are written to: data_cache_path, else beside
// each dataset prefix.
std::vector<fs::path> data_cache_dirs(const Experiment& e) {
  if (!e.data.data_cache_path.empty()) return {e.data.data_cache_path};
  std::vector<fs::path> dirs;
  for (const std::string* blend :
       {&e.data.data_path, &e.data.train_data_path, &e.data.valid_data_path}) {
    if (blend->empty() || is_text_corpus_path(*blend)) continue;
    try {
      for (const BlendEntry& b : parse_blend(*blend, "", ""))
        dirs.push_back(fs::path(b.prefix).parent_path());
    } catch (const ConfigError&) {
      // Validation has already accepted it; nothing to clean where nothing parses.
    }
  }
  return dirs;
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& what,
                             const std::string& key, const std::string& origin) {
  path_ = (fs::path(dir) / kLockFile).string();
  auto refuse = [&](const std::string& why) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    return ConfigError(origin, key, dir, fmt::format("{} Tessera can lock: {}", what, why));
  };
  // Never through a symbolic link, and never into a file some other program made: a lock
  // file is created here (O_EXCL) or is one an earlier run created, which is a regular file
  // of one link holding nothing or a lock note. Anything else is left as it is.
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  created_ = fd_ >= 0;
  if (!created_ && errno == EEXIST)
    fd_ = ::open(path_.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0)
    throw refuse(errno == ELOOP ? fmt::format("{} is a symbolic link; Tessera writes its lock "
                                              "only into a file it made (remove the link)",
                                              path_)
                                : fmt::format("{}: {}", path_, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw refuse(fmt::format("{}: {}", path_, std::strerror(errno)));
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
    throw refuse(
        fmt::format("{} is {}; Tessera writes its lock only into a file it made "
                    "(remove it if no run uses this directory)",
                    path_,
                    S_ISREG(st.st_mode) ? fmt::format("a file with {} hard links", st.st_nlink)
                                        : std::string("not a regular file")));
  std::string previous(static_cast<size_t>(std::min<off_t>(st.st_size, kMaxLockNoteBytes)), '\0');
  const ssize_t got = ::pread(fd_, previous.data(), previous.size(), 0);
  previous.resize(got > 0 ? static_cast<size_t>(got) : 0);
  if (st.st_size > kMaxLockNoteBytes || !is_lock_note(previous))
    throw refuse(
        fmt::format("{} holds {} bytes that are not a Tessera lock note; Tessera writes "
                    "its lock only into a file it made (remove it if no run uses this "
                    "directory)",
                    path_, st.st_size));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    const std::string holder = previous.empty() ? "another process" : previous;
    throw ConfigError(
        origin, key, dir,
        error == EWOULDBLOCK
            ? fmt::format("{} no other run is using: {} holds it (lock file {}); "
                          "wait for it, stop it, or choose another {}",
                          what, holder, path_, key)
            : fmt::format("{} Tessera can lock: {}: {}", what, path_, std::strerror(error)));
  }
  // The lock is ours, so whoever the file names is gone: a killed run's lock.
  if (!previous.empty()) stale_holder_ = previous;
  const std::string me = fmt::format("PID {} ({})", ::getpid(), this_command_line());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note; only the message of a second run gets vaguer.
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ < 0) return;
  // Emptied before release: a lock file with content always names a run that holds it or
  // died holding it.
  if (::ftruncate(fd_, 0) != 0) {
  }
  ::close(fd_);
}

void DirectoryLock::remove_if_created() {
  if (fd_ < 0 || !created_) return;
  // Unlinked while still held: no other run can have taken this file's lock meanwhile.
  ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

std::string new_run_id() {
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::random_device rd;
  return fmt::format("{:04d}{:02d}{:02d}-{:02d}{:02d}{:02d}-{:04x}", utc.tm_year + 1900,
                     utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                     rd() & 0xffff);
}

void check_run_outputs(const Experiment& e) {
  require_experiment_root(e);
  if (!e.checkpoint.save.empty())
    require_writable_directory(e.checkpoint.save, "save", e.checkpoint.save, origin_of(e, "save"));
}

RunDirectories prepare_run_directories(const Experiment& e, const std::string& resume_dir) {
  RunDirectories d;
  const fs::path root = e.experiment_root();
  const CheckpointConfig& c = e.checkpoint;
  // What refuses the run is decided before anything is made; what only the directories
  // themselves can tell (a lock another run holds) is undone when it refuses.
  std::string resumed_id;
  if (!resume_dir.empty()) resumed_id = Checkpoint(resume_dir).state().run_id;
  d.run_id = resumed_id.empty() ? new_run_id() : resumed_id;
  if (!c.save.empty()) {
    std::error_code ec;
    const auto saved = saved_checkpoints(c.save);
    const bool resumes_from_save =
        !resume_dir.empty() && fs::equivalent(fs::path(resume_dir).parent_path(), c.save, ec);
    if (!saved.empty() && !resumes_from_save)
      throw ConfigError(
          origin_of(e, "save"), "save", c.save,
          fmt::format("a save directory without another run's checkpoints: it "
                      "holds {} (iterations {} to {}), which this run's "
                      "ckpt_keep_last would delete; resume that run with --load "
                      "{}, or choose another save directory",
                      saved.size(), saved.front().iteration, saved.back().iteration, c.save));
  }
  std::vector<fs::path> created;
  try {
    created = create_directories_noting(root, "workspace", e.workspace, origin_of(e, "workspace"));
    d.locks.push_back(std::make_unique<DirectoryLock>(root.string(), "an experiment directory",
                                                      "exp_name", origin_of(e, "exp_name")));
    if (!c.save.empty()) {
      for (fs::path& p : create_directories_noting(c.save, "save", c.save, origin_of(e, "save")))
        created.push_back(std::move(p));
      std::error_code ec;
      if (!fs::equivalent(c.save, root, ec))
        d.locks.push_back(std::make_unique<DirectoryLock>(c.save, "a save directory", "save",
                                                          origin_of(e, "save")));
    }
  } catch (...) {
    for (const auto& lock : d.locks) lock->remove_if_created();
    d.locks.clear();
    remove_created_directories(created);
    throw;
  }
  if (!c.save.empty())
    for (const std::string& f : remove_stale_temporaries(c.save, /*locked_save_dir=*/true))
      d.notes.push_back("removed " + f + ", left by a killed run");
  for (const auto& lock : d.locks)
    if (!lock->stale_holder().empty())
      d.notes.push_back("took over a lock left by " + lock->stale_holder() + ", which has ended");

  const std::string previous = last_run_id(root / "metrics.jsonl");
  const bool continues = !resumed_id.empty() && previous == resumed_id;
  if (!continues)
    if (std::string moved = archive_previous_run(root, previous, e.tensorboard_directory());
        !moved.empty())
      d.notes.push_back(moved);
  for (const fs::path& dir : {root, root / "traces"})
    for (const std::string& f : remove_stale_temporaries(dir, false))
      d.notes.push_back("removed " + f + ", left by a killed run");
  for (const fs::path& dir : data_cache_dirs(e))
    for (const std::string& f : remove_stale_temporaries(dir, false))
      d.notes.push_back("removed " + f + ", left by a killed run");
  return d;
}

}  // namespace tessera
