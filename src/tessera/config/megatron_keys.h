#pragma once
// Megatron-LM and Primus keys that are not Tessera configuration keys (keys.h) but fill their
// experiment files, model files and command lines, so that those load as written. Each has one
// disposition:
//   - a spelling of a Tessera key: `bf16` and `fp16` set `precision`, `fp8_format` sets `fp8`,
//     `recompute_activations` sets `recompute_granularity`, ... (`sets` names the key);
//   - accepted without effect: at the values that agree with what Tessera does
//     (`swiglu: true`, `hidden_dropout: 0`, `finetune: false`), or at any value where it
//     concerns something Tessera has no part of (`wandb_project`, Primus-Turbo kernels, fusion
//     switches whose result is the same). A value Tessera would not honour exits 2 naming the
//     key and what differs, rather than being dropped in silence, and the run's log lists every
//     key it accepted this way.
// A Tessera key of the same name always wins: implementing one of these is adding its key to
// keys.cpp and removing its entry here (a test keeps the two tables apart, and another that
// docs/configuration.md lists every entry).
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "tessera/config/config.h"

namespace tessera {

struct MegatronKey {
  std::string_view name;
  // A boolean: on the command line, the key alone means true (--swiglu), and --no-<key> false.
  bool flag = false;
  std::string_view effect;  // what it does in Tessera (help, docs, log)
  // Spellings of a Tessera key: sets it from `value`; returns "" or what was expected. The
  // Tessera key's name, for the origin of its value and for messages.
  std::string_view sets;
  std::function<std::string(Experiment&, const std::string& value)> set;
  // Keys without effect: "" when Tessera's run agrees with `value`, else what was expected.
  // Runs once everything is loaded (disable_last_saving depends on `save`).
  std::function<std::string(const Experiment&, const std::string& value)> check;
  // A YAML list is read as its flow text (high_priority_stream_groups: []).
  bool accepts_list = false;
  // Megatron's nargs on the command line, as KeySpec::words_joined_by (test_data_path).
  std::string_view words_joined_by = "";
};

std::span<const MegatronKey> megatron_keys();
const MegatronKey* find_megatron_key(std::string_view name);

}  // namespace tessera
