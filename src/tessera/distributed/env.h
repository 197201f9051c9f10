#pragma once
// Where this process sits in a distributed job, read from the environment the way torchrun
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and Slurm's srun
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE,
// SLURM_NODELIST) set it. torchrun's variables win when both are present, so `tessera launch`
// inside an allocation behaves as outside one.
#include <functional>
#include <string>
#include <vector>

namespace tessera::dist {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the GPU index on this node
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single process";  // "torchrun environment", "Slurm (srun)", ...

  bool distributed() const { return world_size > 1; }
};

// Reads a variable; null when unset. Tests pass a map instead of the process environment.
using GetEnv = std::function<const char*(const char*)>;
// Expands a Slurm node list to host names (`scontrol show hostnames`); empty on failure.
using ExpandHosts = std::function<std::vector<std::string>(const std::string& nodelist)>;

// Throws ConfigError naming the variable when a value is malformed or inconsistent (rank
// outside the world, local rank outside the node).
DistEnv parse_dist_env(const GetEnv& getenv, const ExpandHosts& expand_hosts);
// The process environment, host names from scontrol when it exists, else parsed here.
DistEnv dist_env_from_process();

// The GPU of this rank: its local rank, or 0 when the job gives each process one visible
// GPU (srun --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES per task). Returns the local rank
// otherwise, so that a missing GPU is reported by the backend naming the index.
int device_for_local_rank(const DistEnv& env, int visible_devices);

// First host of a Slurm node list: "gpu[003-005,9],cpu1" -> "gpu003". Handles the common
// compressed forms without scontrol.
std::string first_slurm_host(const std::string& nodelist);
// Tasks on the node of `node_index` from SLURM_TASKS_PER_NODE ("4(x2),2" -> 4, 4, 2).
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index);

}  // namespace tessera::dist
