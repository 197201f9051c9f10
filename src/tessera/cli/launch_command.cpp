// tessera launch: start the ranks of a job on this node (torchrun's options), e.g.
//   tessera launch --nproc_per_node 8 train --config llama3.1_8B-pretrain
//   tessera launch --nproc_per_node 2 bench comm
//   tessera launch --nproc_per_node 2 -- python3 my_script.py   (any program after --)
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/cli/commands.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"
#include "tessera/distributed/launcher.h"

namespace tessera::cli {
namespace {

void print_launch_help() {
  fmt::print(
      "usage: tessera launch --nproc_per_node N [--nnodes M --node_rank R --master_addr HOST\n"
      "                      --master_port PORT] [--grace_s S] <tessera command ...>\n"
      "       tessera launch --nproc_per_node N [...] -- <program> [args ...]\n\n"
      "Starts N ranks of the command on this node with RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does); rank r uses GPU\n"
      "LOCAL_RANK. Output lines are prefixed with [rank r]. When a rank fails the others get\n"
      "SIGTERM, then SIGKILL after --grace_s seconds (default 10), and launch exits with the\n"
      "failed rank's code. For several nodes, run it on every node with the same --nnodes,\n"
      "--master_addr (node 0's address) and --master_port, and each node's --node_rank.\n"
      "Under Slurm, srun can start `tessera train` directly (examples/slurm/pretrain.sbatch).\n"
      "A tessera command needs a GPU per rank: without a visible GPU, launch refuses it before\n"
      "starting any rank (nothing is written); train's ranks run as threads on the CPU instead:\n"
      "tessera train --device cpu --nproc_per_node N. A program after -- runs anywhere.\n"
      "Options are spelled --key value or --key=value, with underscores or dashes\n"
      "(--nproc-per-node 8).\n");
}

}  // namespace

int launch_command(const Args& args) {
  // Launch's own options come first, in the shared conventions (--nproc-per-node=8 is
  // --nproc_per_node 8); the command starts at the first word that is not one of them, and
  // its options are its own (the trainer reads them in the same conventions).
  size_t split = 0;
  const std::set<std::string> valued = {"nproc_per_node", "nnodes", "node_rank", "master_addr",
                                        "master_port", "grace_s"};
  while (split < args.size()) {
    const std::string& a = args[split];
    if (a == "--help" || a == "-h") {
      print_launch_help();
      return 0;
    }
    const auto option = parse_command_line_option(a);
    if (!option || !valued.contains(option->name)) break;
    split += option->value ? 1 : 2;
  }
  if (split > args.size()) throw ConfigError("command line", args.back().substr(2), "", "a value");
  const bench::CommandArgs opts(Args(args.begin(), args.begin() + split), valued, {}, false);
  dist::LaunchOptions o;
  o.nproc_per_node = static_cast<int>(opts.get_int("nproc_per_node", 1));
  o.nnodes = static_cast<int>(opts.get_int("nnodes", 1));
  o.node_rank = static_cast<int>(opts.get_int("node_rank", 0, 0));
  o.master_addr = opts.get("master_addr", "127.0.0.1");
  o.master_port = static_cast<int>(opts.get_int("master_port", 29500));
  o.grace_s = static_cast<double>(opts.get_int("grace_s", 10, 0));
  if (split == args.size()) {
    print_launch_help();
    throw ConfigError("command line", "launch", "", "a command after the options (e.g. train ...)");
  }
  // Tessera's commands under launch (train, bench comm) run one process per GPU over NCCL. On a
  // machine without one every rank would fail on its own, after rank 0 had made the run's
  // directories and logs; refuse before any rank starts, so that nothing is written.
  if (args[split] != "--" && gpu_device_count() == 0)
    throw ConfigError("command line", "launch",
                      fmt::format("{}", fmt::join(args.begin() + split, args.end(), " ")),
                      fmt::format("a GPU per rank, but no GPU is visible ({}). On the CPU, run N "
                                  "ranks as threads of one process: tessera train --device cpu "
                                  "--nproc_per_node N ...",
                                  no_gpu_reason()));
  if (args[split] == "--") {
    o.command.assign(args.begin() + split + 1, args.end());
  } else {
    o.command = {dist::current_executable()};
    o.command.insert(o.command.end(), args.begin() + split, args.end());
  }
  const dist::LaunchResult r = dist::launch(o);
  if (r.failed_rank >= 0)
    fmt::print(stderr, "error: launch: rank {} failed with exit code {}\n", r.failed_rank, r.exit_code);
  return r.exit_code;
}

}  // namespace tessera::cli
