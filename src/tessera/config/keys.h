#pragma once
// The registry of configuration keys: one entry per key with its section, type, help text
// and accessors. Loading, CLI overrides, validation messages, `tessera train --help`,
// the effective-config dump and docs/configuration.md all read this one table.
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

enum class KeyType { Int, Float, Bool, String, Choice };

struct KeySpec {
  std::string_view name;
  std::string_view section;  // experiment, model, training, data, logging
  KeyType type;
  std::string_view help;
  std::vector<std::string_view> choices;  // for KeyType::Choice
  // Parses `text` (a YAML scalar) into the experiment; returns an empty string on success or
  // a description of what was expected.
  std::function<std::string(Experiment&, const std::string& text)> set;
  std::function<std::string(const Experiment&)> get;  // the value as YAML scalar text
  // A YAML list is also accepted and read as its flow text ("[1, 0, 1]"): keys whose value
  // Megatron writes as a Python list (moe_layer_freq).
  bool accepts_list = false;
  // Megatron's nargs: on the command line the key takes every word up to the next option,
  // joined by this (data_path's blend words by " ", profile_ranks' ids by ","); empty: one.
  std::string_view words_joined_by = "";
};

std::span<const KeySpec> config_keys();
const KeySpec* find_key(std::string_view name);
// Closest known key by edit distance, or "" if nothing is reasonably close.
std::string suggest_key(std::string_view unknown);
// The names closest to `word` by edit distance, ignoring case (a typo, or the wrong case of a
// preset name: lama3_8B, llama3.1_8b), nearest first, at most `limit`; empty when none is
// reasonably close.
std::vector<std::string> nearest_names(std::string_view word, std::span<const std::string> names,
                                       size_t limit = 3);
// Human-readable type, e.g. "an integer", "one of: cosine, linear, constant".
std::string describe_type(const KeySpec& key);

// The device and attention_backend keys' values, parsed by the keys themselves, for commands
// that take them as options outside an experiment (generate, the benchmarks). Throw
// ConfigError naming the values the key accepts.
DeviceChoice parse_device_choice(std::string_view text);
AttentionBackend parse_attention_backend(std::string_view text);

}  // namespace tessera
