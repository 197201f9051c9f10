// tessera train: load and validate the experiment, then create its directory, logs and
// metrics and run the trainer. Nothing touches the disk until the configuration is valid.
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/cli/commands.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/env.h"
#include "tessera/distributed/rendezvous.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/metrics.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {
namespace {

void print_train_help() {
  fmt::print(
      "usage: tessera train [--config EXPERIMENT.yaml] [--key value | --key=value ...]\n\n"
      "Without --config, runs the shipped default experiment (a small Llama on the Brown "
      "corpus).\nShipped experiments and model presets can be named without a path, e.g.\n"
      "  tessera train --config llama3.1_8B-pretrain --num_layers 4 --train_iters 20\n\n"
      "Outputs go to {{workspace}}/{{work_group}}/{{user_name}}/{{exp_name}}/: config.yaml, "
      "metrics.jsonl,\nlogs/pre_trainer/rank-N/{{debug,info,warning,error}}.log.\n\nkeys:\n");
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section != section) {
      section = k.section;
      fmt::print("\n  [{}]\n", section);
    }
    fmt::print("  --{:<38} {} ({})\n", k.name, k.help, describe_type(k));
  }
}

void write_file_atomically(const std::filesystem::path& path, const std::string& content) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << content;
    if (!out.flush()) throw Error(fmt::format("{}: write failed", tmp.string()));
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace

int train_command(const Args& args) {
  LoadOptions opts;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      print_train_help();
      return 0;
    }
    if (args[i] == "--config" || args[i] == "--exp") {
      if (i + 1 >= args.size()) throw ConfigError("command line", "config", "", "a file after --config");
      opts.config_path = args[++i];
    } else if (args[i].starts_with("--config=") || args[i].starts_with("--exp=")) {
      opts.config_path = args[i].substr(args[i].find('=') + 1);
    } else {
      opts.cli_overrides.push_back(args[i]);
    }
  }
  // Started by `tessera launch`, torchrun or srun: this process is one rank of a job.
  const dist::DistEnv env = dist::dist_env_from_process();
  opts.data_parallel_size = env.world_size;
  const Experiment exp = load_experiment(opts);
  const double timeout_s = exp.training.dist_timeout_minutes * 60.0;
  std::unique_ptr<dist::Rendezvous> rendezvous;
  if (env.distributed()) {
    rendezvous = std::make_unique<dist::Rendezvous>(env, timeout_s);
    std::map<std::string, std::string> config;
    for (const auto& k : config_keys()) config[std::string(k.name)] = k.get(exp);
    rendezvous->check_config(config);
  }
  auto backend = make_backend(exp.training.device, dist::device_for_local_rank(env, gpu_device_count()),
                              backend_options(exp.training));

  const std::filesystem::path root = exp.experiment_root();
  std::filesystem::create_directories(root);
  const bool rank0 = env.rank == 0;
  if (rank0) write_file_atomically(root / "config.yaml", experiment_to_yaml(exp));
  Logger log((root / "logs" / "pre_trainer" / fmt::format("rank-{}", env.rank)).string(), env.rank,
             rank0, rank0 && exp.logging.log_progress);
  std::optional<MetricsWriter> metrics;
  if (rank0) metrics.emplace((root / "metrics.jsonl").string());
  log.info("experiment {} from {}", root.string(), exp.source_file);
  log.debug("effective configuration:\n{}", experiment_to_yaml(exp));
  try {
    std::unique_ptr<dist::Communicator> comm;
    if (env.distributed()) {
      log.info("rank {} of {} (local rank {} of {}, from the {}); rendezvous {}:{}", env.rank,
               env.world_size, env.local_rank, env.local_world_size, env.source, env.master_addr,
               env.master_port);
      comm = make_communicator(*backend, *rendezvous, timeout_s, log);
    }
    Trainer trainer(exp, std::move(backend), log, metrics ? &*metrics : nullptr, comm.get());
    try {
      trainer.train();
    } catch (const TrainingAborted& e) {
      // With `save`, a signal stops every rank after the same iteration, once the checkpoint
      // is published (Trainer::stop_signal_after_iteration): say goodbye, so that ranks still
      // on their way out do not take this exit for a crash and end with code 3.
      if (rendezvous && !exp.checkpoint.save.empty() && e.exit_code() > 128) rendezvous->close();
      throw;
    }
    if (comm) comm->finalize();
    if (rendezvous) rendezvous->close();
  } catch (const Error& e) {
    // main() prints the message; the logs keep it too.
    log.clear_progress();
    log.record(LogLevel::Error, e.what());
    log.flush();
    throw;
  }
  log.info("outputs: {}", root.string());
  return 0;
}

}  // namespace tessera::cli
