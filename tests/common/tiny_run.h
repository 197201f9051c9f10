#pragma once
// What tests of whole training runs share: a tiny CPU run's command line and its
// metrics.jsonl read back.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/run_command.h"

namespace tessera::testing {

// `tessera train` of a tiny CPU model (~10 ms per iteration) into
// workspace/g/u/<exp_name>; append more options to it.
inline std::string tiny_args(const std::filesystem::path& workspace, const std::string& exp_name) {
  return "train --device cpu --model tiny_llama --mock_data true --num_layers 2 --hidden_size 32 "
         "--ffn_hidden_size 48 --vocab_size 64 --seq_length 16 --micro_batch_size 2 "
         "--global_batch_size 4 --lr_warmup_iters 1 --eval_interval 0 --log_interval 1 "
         "--log_progress false --workspace " +
         workspace.string() + " --work_group g --user_name u --exp_name " + exp_name;
}

// Every complete line of a metrics.jsonl, parsed. A run may be writing the file: a last line
// without its newline is still being written (or was cut by a kill) and is left out.
inline std::vector<nlohmann::json> metrics_lines(const std::filesystem::path& file) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(file, std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  // Complete lines only (a running writer's last one may be partial); a line a killed run left
  // unfinished is skipped, as tessera plot skips it.
  for (size_t begin = 0, end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1) {
    if (end == begin) continue;
    nlohmann::json j = nlohmann::json::parse(text.substr(begin, end - begin), nullptr, false);
    if (!j.is_discarded()) lines.push_back(std::move(j));
  }
  return lines;
}

}  // namespace tessera::testing
