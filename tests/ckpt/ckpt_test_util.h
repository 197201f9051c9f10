#pragma once
// Helpers shared by the checkpoint tests: a scratch directory per test, tiny experiments,
// reading files, running the tessera binary and python3.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "common/run_command.h"
#include "common/scratch_dir.h"

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/config/config.h"
#include "tessera/obs/logger.h"
#include "tessera/train/trainer.h"

namespace tessera::testing {

namespace fs = std::filesystem;

inline const std::string kMockData =
    "mock_data: true\nvocab_size: 50\nmake_vocab_size_divisible_by: 1\n";

// A 2-layer GQA model, small enough to train in milliseconds, on `data` (mock by default);
// `extra` YAML lines add keys; validated for `world` data-parallel ranks.
inline Experiment tiny_experiment(const fs::path& dir, const std::string& extra = "",
                                  const std::string& data = kMockData, int world = 1) {
  const fs::path p = dir / "experiment.yaml";
  std::ofstream(p) << "model: tiny_llama\nnum_layers: 2\nhidden_size: 32\nffn_hidden_size: 48\n"
                      "num_attention_heads: 4\nnum_query_groups: 2\nseq_length: 16\n"
                      "micro_batch_size: 2\nglobal_batch_size: 4\ntrain_iters: 6\nlr: 0.01\n"
                      "lr_warmup_iters: 2\nweight_decay: 0.1\nclip_grad: 0.5\nlog_progress: false\n"
                   << data << overrides_yaml(extra);
  LoadOptions o;
  o.config_path = p.string();
  o.data_parallel_size = world;
  return load_experiment(o);
}

inline std::unique_ptr<Trainer> make_trainer(const Experiment& e, Logger& log) {
  return std::make_unique<Trainer>(e, make_cpu_backend(), log, nullptr);
}

inline std::vector<float> download(Backend& b, const Tensor& t) {
  std::vector<float> out(t.numel());
  b.download(out.data(), t);
  return out;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// Every path under `dir`: what a refused command must leave unchanged.
inline std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> paths;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    paths.insert(fs::relative(e.path(), dir).string());
  return paths;
}

}  // namespace tessera::testing
