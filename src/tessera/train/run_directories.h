#pragma once
// The directories a training run writes, claimed and prepared before any work starts, so that
// a run fails early and clearly instead of after its training time, and never loses or
// deletes another run's files:
//   - the experiment root and the save directory must be creatable and writable (ConfigError,
//     exit 2, naming the key, the path and the reason), checked before anything is made;
//   - each is locked for the life of the run; a second run there exits 2 naming the holder's
//     PID and command; a lock left by a dead process is taken over;
//   - a save directory holding another run's checkpoints is refused unless the run resumes
//     from it (its pruning would delete them);
//   - a previous run's metrics, config, logs (and TensorBoard event files, when tensorboard_dir
//     lies inside the experiment root) move to previous_runs/<its run id>/ unless this run
//     continues it (resumes its checkpoint);
//   - temporary files left by killed runs (unfinished checkpoints, .tmp-PID files of dead
//     processes) are removed.
// Every run has an id, written into each metrics.jsonl line and each checkpoint; a resumed
// run keeps its checkpoint's.
#include <memory>
#include <string>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

// Under an experiment root: where a previous run's files go when another run starts there.
inline constexpr const char* kPreviousRunsDir = "previous_runs";

// An exclusive claim on a directory: DIR/.tessera.lock holds this process's PID and command
// line and is flock()ed, so that the claim ends when the process does, however it ends. The
// lock file is never followed through a symbolic link, and a file the lock did not make (a
// link to another file, anything but an empty file or a lock note) is refused, never written.
class DirectoryLock {
 public:
  // `what` names the directory in messages ("an experiment directory"); `key`
  // and `origin` the configuration key that chose it. Throws ConfigError when a live process
  // holds the lock or the lock file is not one Tessera made.
  DirectoryLock(const std::string& dir, const std::string& what, const std::string& key,
                const std::string& origin);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  // "PID 123 (tessera train ...)" of a dead process whose lock was taken over; else empty.
  const std::string& stale_holder() const { return stale_holder_; }
  // For a run refused after locking: deletes the lock file when this lock created it, and
  // releases the lock.
  void remove_if_created();

 private:
  std::string path_;
  int fd_ = -1;
  bool created_ = false;
  std::string stale_holder_;
};

struct RunDirectories {
  std::string run_id;
  std::vector<std::string> notes;  // what preparing did, for the run's log
  std::vector<std::unique_ptr<DirectoryLock>> locks;
};

// Every rank, before any work: the experiment root and the save directory can be created and
// written. Only looks. Throws ConfigError naming the key.
void check_run_outputs(const Experiment& e);

// For the process that writes a run's shared files (rank 0), after check_run_outputs:
// creates and locks the directories, then moves a previous run aside. A run refused here
// (another run's lock or checkpoints) leaves nothing behind: the directories and lock files it
// made are removed again. `resume_dir` is the checkpoint the run resumes
// (checkpoint_to_resume), empty for a fresh start.
RunDirectories prepare_run_directories(const Experiment& e, const std::string& resume_dir);

// "20261124-013512-3f9c": when the run started, and a random tail for runs started within
// the same second.
std::string new_run_id();

}  // namespace tessera
