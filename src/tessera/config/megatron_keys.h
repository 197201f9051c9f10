#pragma once
// Megatron-LM and Primus keys that are not Tessera configuration keys (keys.h) but fill their
// experiment files and command lines, so that those load as written:
//   - other spellings of a Tessera key: `bf16` and `fp16` set `precision`,
//     `distributed_timeout_minutes` sets `dist_timeout_minutes`;
//   - keys accepted without effect. Each is accepted at the values that agree with what Tessera
//     does (`tensor_model_parallel_size: 1`, `finetune: false`), or at any value where it
//     concerns something Tessera has no part of (`wandb_project`, Primus-Turbo kernels). A value
//     Tessera would not honour exits 2 rather than being dropped in silence, and the run's log
//     lists every key it accepted this way. A few values Tessera accepts although its run
//     differs from Megatron's (`eod_mask_loss: true`) are logged as warnings.
// A Tessera key of the same name always wins: implementing one of these is adding its key to
// keys.cpp and removing its entry here (a test keeps the two tables apart).
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "tessera/config/config.h"

namespace tessera {

struct MegatronKey {
  std::string_view name;
  // A boolean: on the command line, the key alone means true (--bf16, --no-load-optim).
  bool flag = false;
  std::string_view effect;  // what it does in Tessera (help, docs, log)
  // Spellings of a Tessera key: sets it from `value`; returns "" or what was expected. The
  // Tessera key's name, for the origin of its value and for messages.
  std::string_view sets;
  std::function<std::string(Experiment&, const std::string& value)> set;
  // Keys without effect: "" when Tessera's run agrees with `value`, else what was expected.
  // Runs once everything is loaded (disable_last_saving depends on `save`).
  std::function<std::string(const Experiment&, const std::string& value)> check;
  // Accepted values that give a different run from Megatron's: logged as a warning.
  std::function<bool(const std::string& value)> warns;
};

std::span<const MegatronKey> megatron_keys();
const MegatronKey* find_megatron_key(std::string_view name);

}  // namespace tessera
