#pragma once
// `tessera launch`: torchrun's job on one node. Starts nproc_per_node copies of a command
// with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set,
// forwards their output line by line prefixed with "[rank N] ", and when one of them fails
// stops the others (SIGTERM, then SIGKILL after a grace period) and reports that rank's exit
// status as its own. SIGINT/SIGTERM to the launcher are passed on to every child.
#include <string>
#include <vector>

namespace tessera::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double grace_s = 10.0;             // between SIGTERM and SIGKILL
  std::vector<std::string> command;  // program and arguments of every child
};

struct LaunchResult {
  int exit_code = 0;     // 0, or the first failing rank's code (128 + signal when killed)
  int failed_rank = -1;  // -1 when every rank succeeded
};

// Runs the children to completion. Messages about failures go to stderr. Throws
// ConfigError for inconsistent options and Error when a child cannot be started.
LaunchResult launch(const LaunchOptions& options);

// The running tessera binary's path (/proc/self/exe), for commands that start copies of it.
std::string current_executable();

}  // namespace tessera::dist
