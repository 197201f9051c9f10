// tessera train: load and validate the experiment, then create its directory, logs and
// metrics and run the trainer. Nothing touches the disk until the configuration is valid.
#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/cli/commands.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/config/megatron_keys.h"
#include "tessera/config/validate.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/env.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/distributed/rendezvous.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/metrics.h"
#include "tessera/train/run_directories.h"
#include "tessera/train/stop_signal.h"
#include "tessera/train/grpo_generation.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// "items: a, b, c" wrapped at 100 columns, continuation lines indented by `indent`.
std::string wrapped(std::string line, const std::vector<std::string>& items, size_t indent) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string item = items[i] + (i + 1 < items.size() ? "," : "");
    if (line.size() + 1 + item.size() > 100) {
      out += line + "\n";
      line = std::string(indent, ' ') + item;
    } else {
      line += (line.ends_with(' ') ? "" : " ") + item;
    }
  }
  return out + line + "\n";
}

void print_train_help() {
  fmt::print(
      "usage: tessera train [--config EXPERIMENT] [--nproc_per_node N]\n"
      "                     [--key value | --key=value ...]\n\n"
      "Without --config, runs the shipped default experiment (a small Llama on the Brown "
      "corpus).\nShipped experiments and model presets can be named without a path, e.g.\n"
      "  tessera train --config llama3.1_8B-pretrain --num_layers 4 --train_iters 20\n\n"
      "  --config EXPERIMENT  a shipped experiment's name or a YAML file (Tessera's or Primus's\n"
      "                       layout); default: default (configs/experiments/default.yaml)\n"
      "  --nproc_per_node N   with --device cpu, N ranks as threads of this process (data\n"
      "                       parallel, ZeRO-1, FSDP exactly as on N GPUs); default: 1. On GPUs,\n"
      "                       one process per GPU: tessera launch --nproc_per_node N train\n\n"
      "{}\n{}\n"
      "Outputs go to {{workspace}}/{{work_group}}/{{user_name}}/{{exp_name}}/: config.yaml, "
      "metrics.jsonl,\nlogs/pre_trainer/rank-N/{{debug,info,warning,error}}.log.\n\n"
      "Keys are spelled --key value or --key=value, with underscores or dashes (--lr-warmup-iters "
      "10);\na boolean key alone means true, --no-<key> false. The defaults shown are the built-in "
      "ones:\nthe model preset and the experiment set their own over them, and the run's "
      "config.yaml\nrecords every value it used.\n\nkeys:\n",
      wrapped("experiments (--config):", shipped_config_names("experiments"), 2),
      wrapped("model presets (--model):", shipped_config_names("models"), 2));
  static const Experiment defaults;
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section != section) {
      section = k.section;
      fmt::print("\n  [{}]\n", section);
    }
    fmt::print("  --{:<38} {} ({}; default: {})\n", k.name, k.help, describe_type(k),
               k.get(defaults));
  }
  fmt::print("\n  [Megatron and Primus]\n");
  std::vector<std::string> accepted;
  for (const auto& k : megatron_keys()) {
    if (k.set)
      fmt::print("  --{:<38} {}\n", k.name, k.effect);
    else
      accepted.emplace_back(k.name);
  }
  fmt::print(
      "  Accepted without effect where the value agrees with Tessera (the run's log lists them;\n"
      "  docs/configuration.md says what each means here):\n{}",
      wrapped("  ", accepted, 2));
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

struct TrainArgs {
  LoadOptions load;
  int local_ranks = 1;  // --nproc_per_node on the CPU: ranks as threads of this process
};

// --config and --nproc_per_node are train's own; every other argument is a configuration key
// for the loader, which reads them in the same conventions (core/command_line.h).
TrainArgs parse_train_args(const Args& args) {
  TrainArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto option = parse_command_line_option(args[i]);
    const std::string name = option ? option->name : "";
    auto value = [&]() -> std::string {
      if (option->value) return *option->value;
      if (i + 1 >= args.size())
        throw ConfigError("command line", name, "", "a value after --" + name);
      return args[++i];
    };
    if (name == "config" || name == "exp") {
      a.load.config_path = value();
    } else if (name == "nproc_per_node") {
      const std::string v = value();
      try {
        a.local_ranks = std::stoi(v);
      } catch (...) {
        a.local_ranks = 0;
      }
      if (a.local_ranks < 1 || std::to_string(a.local_ranks) != v)
        throw ConfigError("command line", "nproc_per_node", v, "a positive integer");
    } else {
      a.load.cli_overrides.push_back(args[i]);
    }
  }
  return a;
}

// The Megatron/Primus keys the experiment set that change nothing here: one line naming them,
// each one's meaning in the debug log.
void log_megatron_keys(const Experiment& exp, Logger& log) {
  std::vector<std::string> names;
  for (const AcceptedMegatronKey& k : exp.megatron_keys) {
    const MegatronKey& m = *find_megatron_key(k.key);
    names.push_back(k.key);
    log.debug("{}: {} ({}): accepted without effect: {}", k.key, k.value, k.origin, m.effect);
  }
  if (!names.empty())
    log.info("Megatron/Primus keys accepted without effect (docs/configuration.md): {}",
             joined(names));
}

// One rank's run: its logs and (rank 0) metrics, then the trainer. A rank of a job of
// processes (`env` distributed) makes its communicator through `rendezvous`; a thread rank is
// handed `thread_comm`; a single process has neither. `dirs`: what rank 0 prepared (null on
// other ranks). `tokenizer`: one the run's checks loaded already, or null.
void train_rank(const Experiment& exp, std::unique_ptr<Backend> backend, int rank,
                dist::Communicator* thread_comm, const dist::DistEnv& env,
                dist::Rendezvous* rendezvous, const RunDirectories* dirs,
                std::unique_ptr<Tokenizer> tokenizer = nullptr) {
  const std::filesystem::path root = exp.experiment_root();
  const bool rank0 = rank == 0;
  Logger log((root / "logs" / "pre_trainer" / fmt::format("rank-{}", rank)).string(), rank, rank0,
             rank0 && exp.logging.log_progress);
  const std::string run_id = dirs ? dirs->run_id : "";
  std::optional<MetricsWriter> metrics;
  if (rank0) metrics.emplace((root / "metrics.jsonl").string(), run_id);
  log.info("experiment {} from {}{}", root.string(), exp.source_file,
           run_id.empty() ? "" : "; run " + run_id);
  if (dirs)
    for (const std::string& note : dirs->notes) log.warning("{}", note);
  log_megatron_keys(exp, log);
  log.debug("effective configuration:\n{}", experiment_to_yaml(exp));
  try {
    std::unique_ptr<dist::Communicator> process_comm;
    if (rendezvous) {
      log.info("rank {} of {} (local rank {} of {}, from the {}); rendezvous {}:{}", env.rank,
               env.world_size, env.local_rank, env.local_world_size, env.source, env.master_addr,
               env.master_port);
      process_comm =
          make_communicator(*backend, *rendezvous, exp.training.dist_timeout_minutes * 60.0, log);
    }
    dist::Communicator* comm = thread_comm ? thread_comm : process_comm.get();
    // GRPO's split placement: the last grpo_generation_gpus ranks only generate, the others
    // train over a communicator of their own (train/grpo_generation.h).
    const std::optional<GrpoSplitJob> split = comm ? split_grpo_job(*comm, exp.training) : std::nullopt;
    if (split && split->generates(rank)) {
      serve_grpo_generation(exp, *backend, log, split->link,
                            tokenizer ? *tokenizer : *make_tokenizer(exp.data, exp.model_config.vocab_size));
    } else {
      Trainer trainer(exp, std::move(backend), log, metrics ? &*metrics : nullptr,
                      split ? split->training.get() : comm, run_id, std::move(tokenizer),
                      split ? &split->link : nullptr);
      try {
        trainer.train();
      } catch (const TrainingAborted& e) {
        // With `save`, a signal stops every rank after the same iteration, once the checkpoint
        // is published (Trainer::stop_signal_after_iteration): say goodbye, so that ranks still
        // on their way out do not take this exit for a crash and end with code 3.
        if (rendezvous && !exp.checkpoint.save.empty() && e.exit_code() > 128) rendezvous->close();
        throw;
      }
    }
    if (process_comm) process_comm->finalize();
    if (rendezvous) rendezvous->close();
  } catch (const Error& e) {
    // main() prints the message; the logs keep it too.
    log.clear_progress();
    log.record(LogLevel::Error, e.what());
    log.flush();
    throw;
  } catch (const std::filesystem::filesystem_error& e) {
    log.clear_progress();
    log.record(LogLevel::Error, e.what());
    log.flush();
    throw;
  }
  log.info("outputs: {}", root.string());
}

// --nproc_per_node N on the CPU: N ranks as threads over a LocalCommunicator, so every
// parallel mode runs on a laptop exactly as on N GPUs (distributed/local_communicator.h).
void train_thread_ranks(const Experiment& exp, int world, const RunDirectories& dirs) {
  const int threads_per_rank = std::max(1, omp_get_max_threads() / world);
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    // The CPU backend's results do not depend on its thread count; the ranks share the cores.
    omp_set_num_threads(threads_per_rank);
    train_rank(exp, make_backend(DeviceChoice::Cpu, 0), rank, &comm, dist::DistEnv{}, nullptr,
               rank == 0 ? &dirs : nullptr);
  });
}

}  // namespace

int train_command(const Args& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      print_train_help();
      return 0;
    }
  // From here a stop signal is noted and acted on at the next clean point (the trainer's set-up
  // steps, then between micro-batches), with the logs flushed.
  install_stop_signal_handlers();
  TrainArgs a = parse_train_args(args);
  // Started by `tessera launch`, torchrun or srun: this process is one rank of a job.
  const dist::DistEnv env = dist::dist_env_from_process();
  if (a.local_ranks > 1 && env.distributed())
    throw ConfigError("command line", "nproc_per_node", std::to_string(a.local_ranks),
                      "1 in a process that " + env.source + " started as one rank of a job");
  a.load.data_parallel_size = a.local_ranks > 1 ? a.local_ranks : env.world_size;
  const Experiment exp = load_experiment(a.load);
  if (a.local_ranks > 1) {
    const bool cpu = exp.training.device == DeviceChoice::Cpu ||
                     (exp.training.device == DeviceChoice::Auto && gpu_device_count() == 0);
    if (!cpu)
      throw ConfigError("command line", "nproc_per_node", std::to_string(a.local_ranks),
                        "1 with GPUs (start one process per GPU: tessera launch --nproc_per_node "
                        "N train ...), or --device cpu for ranks as threads");
  }
  const double timeout_s = exp.training.dist_timeout_minutes * 60.0;
  std::unique_ptr<dist::Rendezvous> rendezvous;
  if (env.distributed()) {
    rendezvous = std::make_unique<dist::Rendezvous>(env, timeout_s);
    std::map<std::string, std::string> config;
    for (const auto& k : config_keys()) config[std::string(k.name)] = k.get(exp);
    rendezvous->check_config(config);
  }
  auto backend =
      a.local_ranks > 1
          ? nullptr
          : make_backend(exp.training.device, dist::device_for_local_rank(env, gpu_device_count()),
                         backend_options(exp.training));

  // Everything that can refuse the run before any directory is touched: a refused run writes
  // nothing and moves no earlier run aside.
  const int world = a.local_ranks > 1 ? a.local_ranks : env.world_size;
  // GRPO's generation ranks (split placement) are not among the ranks the run trains on.
  const int training_world = grpo_training_ranks(exp.training, world);
  RunStart start = check_run_can_start(
      exp, backend ? *backend : *make_backend(DeviceChoice::Cpu, 0), training_world,
      env.rank < training_world ? env.rank : 0);
  check_run_outputs(exp);
  std::optional<RunDirectories> dirs;
  if (env.rank == 0) {
    dirs.emplace(prepare_run_directories(exp, start.resume_dir));
    write_file_atomically(std::filesystem::path(exp.experiment_root()) / "config.yaml",
                          experiment_to_yaml(exp));
  }
  // The other ranks create their log directories only once rank 0 has moved the previous
  // run's files aside: one created before would be taken for the previous run's and moved.
  if (rendezvous) rendezvous->broadcast(dirs ? dirs->run_id : std::string());
  if (a.local_ranks > 1) {
    train_thread_ranks(exp, a.local_ranks, *dirs);
    return 0;
  }
  train_rank(exp, std::move(backend), env.rank, nullptr, env, rendezvous.get(),
             dirs ? &*dirs : nullptr, std::move(start.tokenizer));
  return 0;
}

}  // namespace tessera::cli
