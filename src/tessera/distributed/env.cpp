#include "tessera/distributed/env.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
namespace {

int env_int(const GetEnv& getenv, const char* name, int fallback, int min) {
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  int out = 0;
  const char* end = v + std::char_traits<char>::length(v);
  auto [p, ec] = std::from_chars(v, end, out);
  if (ec != std::errc() || p != end || out < min)
    throw ConfigError("environment", name, v, fmt::format("an integer >= {}", min));
  return out;
}

std::string env_string(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  return v ? std::string(v) : std::string();
}

std::vector<std::string> scontrol_hostnames(const std::string& nodelist) {
  std::vector<std::string> hosts;
  // Node lists are Slurm's own output; quoting keeps brackets away from the shell.
  const std::string cmd = "scontrol show hostnames '" + nodelist + "' 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return hosts;
  char line[512];
  while (std::fgets(line, sizeof line, p)) {
    std::string h(line);
    while (!h.empty() && (h.back() == '\n' || h.back() == '\r' || h.back() == ' ')) h.pop_back();
    if (!h.empty()) hosts.push_back(h);
  }
  pclose(p);
  return hosts;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  // "gpu[003-005,9]" -> prefix "gpu" + the first number of the range list, zero padding kept.
  const std::string prefix = first.substr(0, open);
  const std::string ranges = first.substr(open + 1);
  const size_t stop = ranges.find_first_of("-,]");
  return prefix + ranges.substr(0, stop);
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index) {
  // "4(x2),2": two nodes with 4 tasks, then one with 2.
  int node = 0;
  size_t pos = 0;
  while (pos < tasks_per_node.size()) {
    size_t comma = tasks_per_node.find(',', pos);
    if (comma == std::string::npos) comma = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(pos, comma - pos);
    int tasks = 0, repeat = 1;
    const size_t paren = item.find("(x");
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), tasks);
    if (ec != std::errc() || tasks < 1)
      throw ConfigError("environment", "SLURM_TASKS_PER_NODE", tasks_per_node,
                        "a Slurm task count list such as 4(x2),2");
    if (paren != std::string::npos) {
      auto [q, ec2] = std::from_chars(item.data() + paren + 2, item.data() + item.size(), repeat);
      if (ec2 != std::errc() || repeat < 1)
        throw ConfigError("environment", "SLURM_TASKS_PER_NODE", tasks_per_node,
                          "a Slurm task count list such as 4(x2),2");
    }
    if (node_index < node + repeat) return tasks;
    node += repeat;
    pos = comma + 1;
  }
  throw ConfigError("environment", "SLURM_TASKS_PER_NODE", tasks_per_node,
                    fmt::format("an entry for node {} (SLURM_NODEID)", node_index));
}

DistEnv parse_dist_env(const GetEnv& getenv, const ExpandHosts& expand_hosts) {
  DistEnv e;
  const bool torchrun = getenv("RANK") || getenv("WORLD_SIZE");
  const bool slurm = !torchrun && getenv("SLURM_PROCID") && getenv("SLURM_NTASKS");
  if (torchrun) {
    e.source = "torchrun environment";
    e.world_size = env_int(getenv, "WORLD_SIZE", 1, 1);
    e.rank = env_int(getenv, "RANK", 0, 0);
    e.local_rank = env_int(getenv, "LOCAL_RANK", e.rank, 0);
    e.local_world_size = env_int(getenv, "LOCAL_WORLD_SIZE", e.world_size, 1);
  } else if (slurm) {
    e.source = "Slurm (srun)";
    e.world_size = env_int(getenv, "SLURM_NTASKS", 1, 1);
    e.rank = env_int(getenv, "SLURM_PROCID", 0, 0);
    e.local_rank = env_int(getenv, "SLURM_LOCALID", 0, 0);
    const std::string per_node = env_string(getenv, "SLURM_NTASKS_PER_NODE");
    if (!per_node.empty() && per_node.find_first_of("(,") == std::string::npos) {
      e.local_world_size = env_int(getenv, "SLURM_NTASKS_PER_NODE", 1, 1);
    } else {
      const std::string tasks = env_string(getenv, "SLURM_TASKS_PER_NODE");
      e.local_world_size = tasks.empty()
                               ? e.world_size
                               : slurm_tasks_on_node(tasks, env_int(getenv, "SLURM_NODEID", 0, 0));
    }
  } else {
    return e;
  }
  if (e.rank >= e.world_size)
    throw ConfigError("environment", torchrun ? "RANK" : "SLURM_PROCID", std::to_string(e.rank),
                      fmt::format("a rank below the world size {}", e.world_size));
  if (e.local_rank >= e.local_world_size)
    throw ConfigError(
        "environment", torchrun ? "LOCAL_RANK" : "SLURM_LOCALID", std::to_string(e.local_rank),
        fmt::format("a local rank below the {} processes on this node", e.local_world_size));

  const std::string addr = env_string(getenv, "MASTER_ADDR");
  if (!addr.empty()) {
    e.master_addr = addr;
  } else if (slurm) {
    const std::string nodes = !env_string(getenv, "SLURM_JOB_NODELIST").empty()
                                  ? env_string(getenv, "SLURM_JOB_NODELIST")
                                  : env_string(getenv, "SLURM_NODELIST");
    if (!nodes.empty()) {
      const std::vector<std::string> hosts = expand_hosts(nodes);
      e.master_addr = hosts.empty() ? first_slurm_host(nodes) : hosts.front();
    }
  }
  if (getenv("MASTER_PORT")) {
    e.master_port = env_int(getenv, "MASTER_PORT", 29500, 1);
  } else if (slurm && getenv("SLURM_JOB_ID")) {
    // Every task of a job derives the same port; concurrent jobs on a node rarely collide.
    e.master_port = 20000 + env_int(getenv, "SLURM_JOB_ID", 0, 0) % 20000;
  }
  if (e.master_port > 65535)
    throw ConfigError("environment", "MASTER_PORT", std::to_string(e.master_port),
                      "a TCP port (1-65535)");
  return e;
}

int device_for_local_rank(const DistEnv& env, int visible_devices) {
  return visible_devices == 1 && env.local_rank > 0 ? 0 : env.local_rank;
}

DistEnv dist_env_from_process() {
  return parse_dist_env([](const char* n) { return static_cast<const char*>(std::getenv(n)); },
                        scontrol_hostnames);
}

}  // namespace tessera::dist
