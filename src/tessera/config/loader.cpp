// Experiment loading: YAML files (Tessera's layout or Primus's modules.pre_trainer) with
// `extends:` inheritance and ${VAR:default} substitution, a Primus module configuration, a
// model preset, and command-line overrides, merged in that order of precedence into one typed
// Experiment.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "tessera/config/config.h"
#include "tessera/config/embedded_configs.h"
#include "tessera/config/keys.h"
#include "tessera/config/megatron_keys.h"
#include "tessera/config/validate.h"
#include "tessera/core/command_line.h"
#include "tessera/core/data_root.h"
#include "tessera/core/error.h"

namespace tessera {
namespace fs = std::filesystem;

namespace {

constexpr const char* kDefaultExperiment = "experiments/default.yaml";
constexpr const char* kEmbeddedPrefix = "<shipped>/";

struct Setting {
  std::string key;
  std::string value;
  std::string origin;  // "file.yaml:LINE" or "command line"
};

// A YAML document found on disk or among the shipped configs.
struct ConfigDoc {
  std::string text;
  std::string display;  // path for messages
  std::string dir;      // directory on disk, or "<shipped>/models" for embedded files
};

const char* find_embedded(const std::string& rel) {
  for (const auto& c : embedded_configs())
    if (c.path == rel) return c.content.data();
  return nullptr;
}

bool read_file(const fs::path& p, std::string* out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

std::string with_yaml_suffix(const std::string& ref) {
  return ref.ends_with(".yaml") || ref.ends_with(".yml") ? ref : ref + ".yaml";
}

// Resolves `ref` as written in `referrer` (for messages) at `key`. Paths are tried on disk
// relative to the referring file, then the working directory; names (and paths inside a
// shipped file) resolve among the shipped configs, under `shipped_folder` when given.
ConfigDoc resolve(const std::string& ref, const std::string& referrer_dir,
                  const std::string& referrer, const std::string& key,
                  const std::string& shipped_folder) {
  ConfigDoc doc;
  std::vector<std::string> tried;
  const bool referrer_shipped = referrer_dir.starts_with(kEmbeddedPrefix);
  if (!referrer_shipped) {
    std::vector<fs::path> candidates;
    if (fs::path(ref).is_absolute()) {
      candidates.push_back(ref);
    } else {
      if (!referrer_dir.empty()) candidates.push_back(fs::path(referrer_dir) / ref);
      candidates.push_back(fs::path(ref));
    }
    for (const auto& c : candidates) {
      tried.push_back(c.string());
      // A name the file system refuses (over 255 bytes) is no file: tried like any other.
      std::error_code ec;
      if (fs::is_regular_file(c, ec) && read_file(c, &doc.text)) {
        doc.display = c.lexically_normal().string();
        doc.dir = c.parent_path().string();
        return doc;
      }
    }
  }
  std::vector<std::string> shipped;
  const std::string name = with_yaml_suffix(ref);
  if (referrer_shipped) {
    const std::string folder = referrer_dir.substr(std::string(kEmbeddedPrefix).size());
    shipped.push_back(folder.empty() ? name : folder + "/" + name);
  }
  if (!shipped_folder.empty()) shipped.push_back(shipped_folder + "/" + name);
  shipped.push_back(name);
  for (const auto& rel : shipped) {
    tried.push_back(kEmbeddedPrefix + rel);
    if (const char* text = find_embedded(rel)) {
      doc.text = text;
      doc.display = kEmbeddedPrefix + rel;
      const auto slash = rel.rfind('/');
      doc.dir = kEmbeddedPrefix + (slash == std::string::npos ? "" : rel.substr(0, slash));
      return doc;
    }
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  std::string hint;
  // A name (not a path) of a preset or experiment that does not exist is most likely a typo or
  // the wrong case (lama3_8B, llama3.1_8b): name the nearest shipped ones.
  if (!shipped_folder.empty() && ref.find('/') == std::string::npos) {
    const std::vector<std::string> names = shipped_config_names(shipped_folder);
    std::string stem = ref;
    if (stem.ends_with(".yaml")) stem.resize(stem.size() - 5);
    const std::vector<std::string> near = nearest_names(stem, names);
    const std::vector<std::string>& shown = near.empty() ? names : near;
    std::string joined;
    for (const auto& n : shown) joined += (joined.empty() ? "" : ", ") + n;
    hint = near.empty() ? "; the shipped ones are " + joined : "; did you mean " + joined + "?";
  }
  throw ConfigError(referrer, key, ref, "an existing YAML file (looked for " + list + ")" + hint);
}

// Variables every experiment file may use without setting them, from Tessera's data root
// (core/data_root.h), so that the shipped experiments read their data from an install as from a
// checkout. The environment's value, when set, wins (as for any variable).
std::string builtin_variable(const std::string& name) {
  if (name == "TESSERA_ROOT") return data_root().dir;
  if (name == "TESSERA_DATA_DIR") return data_root().dataset_dir();
  return {};
}

// Replaces ${VAR} and ${VAR:default} with the environment's value (or the default).
std::string substitute(const std::string& text, const std::string& origin, const std::string& key) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t start = text.find("${", i);
    if (start == std::string::npos) {
      out += text.substr(i);
      break;
    }
    out += text.substr(i, start - i);
    const size_t end = text.find('}', start);
    if (end == std::string::npos)
      throw ConfigError(origin, key, text,
                        "a closing '}' for '${' (syntax ${VAR} or ${VAR:default})");
    const std::string body = text.substr(start + 2, end - start - 2);
    const size_t colon = body.find(':');
    const std::string var = body.substr(0, colon);
    if (var.empty()) throw ConfigError(origin, key, text, "a variable name inside ${...}");
    const char* env = std::getenv(var.c_str());
    if (env) {
      out += env;
    } else if (colon != std::string::npos) {
      out += body.substr(colon + 1);
    } else if (std::string b = builtin_variable(var); !b.empty()) {
      out += b;
    } else {
      throw ConfigError(
          origin, key, text,
          "environment variable " + var + " to be set, or a default: ${" + var + ":value}");
    }
    i = end + 1;
  }
  return out;
}

std::string where(const ConfigDoc& doc, const YAML::Node& node) {
  const auto mark = node.Mark();
  return mark.line >= 0 ? doc.display + ":" + std::to_string(mark.line + 1) : doc.display;
}

void append_scalar(const ConfigDoc& doc, const std::string& key, const YAML::Node& value,
                   std::vector<Setting>* out) {
  const KeySpec* spec = find_key(key);
  const MegatronKey* megatron = spec ? nullptr : find_megatron_key(key);
  const bool list = value.IsSequence() && ((spec != nullptr && spec->accepts_list) ||
                                           (megatron != nullptr && megatron->accepts_list));
  if (!value.IsScalar() && !value.IsNull() && !list)
    throw ConfigError(where(doc, value), key, YAML::Dump(value),
                      "a single value, not a list or map");
  const std::string origin = where(doc, value);
  std::string raw = value.IsNull() ? "null" : list ? std::string() : value.Scalar();
  if (list) {
    YAML::Emitter flow;
    flow << YAML::Flow << value;
    raw = flow.c_str();
  }
  out->push_back({key, substitute(raw, origin, key), origin});
}

void append_map(const ConfigDoc& doc, const YAML::Node& map, std::vector<Setting>* out) {
  for (const auto& kv : map) append_scalar(doc, kv.first.as<std::string>(), kv.second, out);
}

// yaml-cpp accepts a key repeated in one mapping and keeps both entries; which one takes
// effect depends on how the mapping is read, so a repeated key is refused instead.
void check_unique_keys(const ConfigDoc& doc, const YAML::Node& node) {
  if (node.IsSequence())
    for (const auto& item : node) check_unique_keys(doc, item);
  if (!node.IsMap()) return;
  std::map<std::string, int> line_of;
  for (const auto& kv : node) {
    // Every key of a configuration is a name; a `? [..]` or `? {..}` key names nothing.
    if (!kv.first.IsScalar())
      throw ConfigError(where(doc, kv.first), "(key)", YAML::Dump(kv.first).substr(0, 60),
                        "a plain key name (a complex '? ...' key is not a configuration key)");
    const std::string key = kv.first.Scalar();
    const auto [first, inserted] = line_of.emplace(key, kv.first.Mark().line + 1);
    if (!inserted)
      throw ConfigError(where(doc, kv.first), key,
                        kv.second.IsScalar() ? kv.second.Scalar() : YAML::Dump(kv.second),
                        fmt::format("each key once in a mapping, but '{}' is also set at line {}; "
                                    "remove one of the two",
                                    key, first->second));
    check_unique_keys(doc, kv.second);
  }
}

YAML::Node parse(const ConfigDoc& doc) {
  try {
    YAML::Node root = YAML::Load(doc.text);
    if (root.IsNull()) return YAML::Node(YAML::NodeType::Map);
    if (!root.IsMap())
      throw ConfigError(doc.display, "(document)", YAML::Dump(root).substr(0, 60),
                        "a YAML mapping of key: value");
    check_unique_keys(doc, root);
    return root;
  } catch (const YAML::ParserException& e) {
    throw ConfigError(doc.display + ":" + std::to_string(e.mark.line + 1), "(syntax)", e.msg,
                      "valid YAML");
  }
}

// An experiment file and its `extends:` ancestors, flattened.
struct Chain {
  std::vector<Setting> settings;  // in file order, ancestors first, so that later ones win
  // Primus's modules.pre_trainer.config: the module configuration beneath the model preset.
  std::optional<Setting> module_config;
};

// The module configurations of Primus's `modules.<name>.config:` that Tessera ships under
// configs/primus/: the Megatron pre-training module's defaults, for Tessera's keys.
constexpr const char* kPrimusModuleConfigs[] = {"pre_trainer"};

// Primus's experiment layout: `modules: {pre_trainer: {framework, config, model, overrides}}`.
// Tessera pretrains with Megatron's key names, so the module must be Megatron's pre_trainer.
void load_primus_modules(const ConfigDoc& doc, const YAML::Node& modules, Chain* chain) {
  if (!modules.IsMap() || !modules["pre_trainer"] || !modules["pre_trainer"].IsMap())
    throw ConfigError(where(doc, modules), "modules", YAML::Dump(modules),
                      "a mapping with 'pre_trainer:' (Primus's pre-training module)");
  for (const auto& module : modules) {
    const std::string name = module.first.as<std::string>();
    if (name != "pre_trainer")
      throw ConfigError(where(doc, module.first), "modules." + name, YAML::Dump(module.second),
                        "only modules.pre_trainer: Tessera runs Primus's pre-training module");
  }
  for (const auto& m : modules["pre_trainer"]) {
    const std::string sub = m.first.as<std::string>(), key = "modules.pre_trainer." + sub;
    if (sub == "model") {
      append_scalar(doc, "model", m.second, &chain->settings);
    } else if (sub == "overrides") {
      if (!m.second.IsMap() && !m.second.IsNull())
        throw ConfigError(where(doc, m.second), key, YAML::Dump(m.second),
                          "a mapping of key: value");
      if (m.second.IsMap()) append_map(doc, m.second, &chain->settings);
    } else if (sub == "framework") {
      std::vector<Setting> v;
      append_scalar(doc, key, m.second, &v);
      if (v[0].value != "megatron")
        throw ConfigError(
            v[0].origin, key, v[0].value,
            "megatron: Tessera's keys are Megatron's (a " + v[0].value + " module's keys are not)");
    } else if (sub == "config") {
      std::vector<Setting> v;
      append_scalar(doc, key, m.second, &v);
      std::string name = v[0].value;
      if (name.ends_with(".yaml")) name.resize(name.size() - 5);
      if (std::find(std::begin(kPrimusModuleConfigs), std::end(kPrimusModuleConfigs), name) ==
          std::end(kPrimusModuleConfigs))
        throw ConfigError(v[0].origin, key, v[0].value,
                          "pre_trainer.yaml (Primus's pre-training module configuration; Tessera "
                          "ships its defaults as configs/primus/pre_trainer.yaml)");
      chain->module_config = Setting{key, name, v[0].origin};
    } else {
      throw ConfigError(where(doc, m.second), key, YAML::Dump(m.second),
                        "one of framework, config, model, overrides under modules.pre_trainer");
    }
  }
}

// Flattens one YAML file and its `extends:` ancestors (ancestors first, so later settings
// win). Experiment-level structure (overrides:, modules.pre_trainer) is flattened too.
// `stack`: the files being loaded, the first one extended by the second and so on. `loaded`:
// every file flattened so far. A file reached again through another `extends:` (a diamond,
// or the same name listed twice) is not loaded again: its settings are already in, beneath
// everything that extends it, and loading it again would undo the overrides between the two
// and make a chain of n files that each extend the next twice cost 2^n loads.
// `shipped_folder`: where a parent not found on disk is looked for among the shipped configs
// ("models" for a preset's, so that a Primus model file copied alone finds its bases among
// Tessera's presets).
void load_chain(const ConfigDoc& doc, std::vector<std::string>* stack,
                std::set<std::string>* loaded, Chain* chain, const std::string& shipped_folder = "") {
  stack->push_back(doc.display);
  loaded->insert(doc.display);
  const YAML::Node root = parse(doc);
  // Primus's model files name their ancestors `bases:`, its experiments `extends:`.
  const char* parent_key = root["bases"] ? "bases" : "extends";
  if (root["bases"] && root["extends"])
    throw ConfigError(where(doc, root["bases"]), "bases", YAML::Dump(root["bases"]),
                      "either bases: or extends: (the same list of parent files), not both");
  if (const YAML::Node ext = root[parent_key]) {
    std::vector<YAML::Node> parents;
    if (ext.IsSequence()) {
      for (const YAML::Node& p : ext) parents.push_back(p);
    } else {
      parents.push_back(ext);
    }
    for (const auto& p : parents) {
      const std::string origin = where(doc, p);
      if (!p.IsScalar())
        throw ConfigError(origin, parent_key, YAML::Dump(p), "a file name or a list of file names");
      const ConfigDoc parent = resolve(substitute(p.Scalar(), origin, parent_key), doc.dir, origin,
                                       parent_key, shipped_folder);
      // The whole loop, so that the user sees which extends: to drop.
      if (const auto again = std::find(stack->begin(), stack->end(), parent.display);
          again != stack->end()) {
        std::string chain;
        for (auto it = again; it != stack->end(); ++it) chain += *it + " -> ";
        throw ConfigError(origin, parent_key, p.Scalar(),
                          "no cycle of extends: files, but " + chain + parent.display +
                              " loops; remove one extends: of this chain");
      }
      if (!loaded->count(parent.display)) load_chain(parent, stack, loaded, chain, shipped_folder);
    }
  }
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& value = kv.second;
    if (key == "extends" || key == "bases") continue;
    if (key == "overrides") {
      if (!value.IsMap() && !value.IsNull())
        throw ConfigError(where(doc, value), key, YAML::Dump(value), "a mapping of key: value");
      if (value.IsMap()) append_map(doc, value, &chain->settings);
    } else if (key == "modules") {
      load_primus_modules(doc, value, chain);
    } else {
      append_scalar(doc, key, value, &chain->settings);
    }
  }
  stack->pop_back();
}

ConfigError unknown_key(const std::string& origin, const std::string& key,
                        const std::string& value) {
  const std::string hint = suggest_key(key);
  return ConfigError(origin, key, value,
                     hint.empty() ? "a known key (`tessera train --help` lists them)"
                                  : "a known key; did you mean '" + hint + "'?");
}

// What may follow a boolean flag as its value (--use_torch_fsdp2 true, --profile=True).
bool is_boolean_word(const std::string& w) {
  for (const char* b : {"true", "True", "TRUE", "false", "False", "FALSE", "1", "0"})
    if (w == b) return true;
  return false;
}

// Parses "--key value" tokens. A boolean key (or Megatron flag) alone means true and may be
// followed by its value; --no_<key> (Megatron's --no-<flag>) negates it, also with a value
// (--no_fp8_weight_transpose_cache true); a key with Megatron's nargs takes every word up to the
// next option (--data-path 0.7 A 0.3 B).
std::vector<Setting> parse_cli(const std::vector<std::string>& args) {
  std::vector<Setting> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto option = parse_command_line_option(args[i]);
    if (!option)
      throw ConfigError("command line", "(argument)", args[i], "--key value or --key=value");
    std::string key = option->name;
    const auto is_flag = [](const KeySpec* spec, const MegatronKey* megatron) {
      return spec ? spec->type == KeyType::Bool : megatron && megatron->flag;
    };
    bool negated = false;
    if (key.starts_with("no_") && !find_key(key) && !find_megatron_key(key)) {
      const std::string target = key.substr(3);
      const KeySpec* spec = find_key(target);
      if (is_flag(spec, spec ? nullptr : find_megatron_key(target))) key = target, negated = true;
    }
    const std::string spelled = negated ? "no_" + key : key;
    const KeySpec* spec = find_key(key);
    const MegatronKey* megatron = spec ? nullptr : find_megatron_key(key);
    const bool next_is_value = i + 1 < args.size() && !args[i + 1].starts_with("--");
    // Checked before the value: a misspelled flag followed by another flag has none, and
    // "a value after --trian_iters" would hide the misspelling.
    if (!spec && !megatron)
      throw unknown_key("command line", key,
                        !option->value && next_is_value ? args[i + 1] : option->value.value_or(""));
    const bool flag = is_flag(spec, megatron);
    const std::string_view joined = spec ? spec->words_joined_by : megatron->words_joined_by;
    std::string value;
    if (option->value) {
      value = *option->value;
    } else if (flag) {
      // A bare flag, as Megatron's --use-distributed-optimizer, or with its value.
      value = "true";
      if (next_is_value) {
        if (!is_boolean_word(args[i + 1]))
          throw ConfigError("command line", spelled, args[i + 1],
                            "true or false after --" + spelled + " (alone it means true)");
        value = args[++i];
      }
    } else if (next_is_value) {
      value = args[++i];
      while (!joined.empty() && i + 1 < args.size() && !args[i + 1].starts_with("--"))
        value += std::string(joined) + args[++i];
    } else {
      throw ConfigError("command line", key, "", "a value after --" + key);
    }
    if (negated) {
      if (!is_boolean_word(value))
        throw ConfigError("command line", spelled, value,
                          "true or false (--" + spelled + " true sets " + key + " to false)");
      const bool truth = value == "true" || value == "True" || value == "TRUE" || value == "1";
      value = truth ? "false" : "true";
    }
    out.push_back({key, value, "command line"});
  }
  return out;
}

// --config with a model preset's name would fail as a missing file (or, reached through
// models/, load without data or training settings); say what it is and how to use it.
ConfigDoc resolve_experiment(const std::string& ref) {
  std::optional<ConfigDoc> doc;
  try {
    doc = resolve(ref, "", "command line", "config", "experiments");
  } catch (const ConfigError&) {
    if (!find_embedded("models/" + with_yaml_suffix(ref))) throw;
  }
  if (doc && !doc->display.starts_with(std::string(kEmbeddedPrefix) + "models/")) return *doc;
  const std::string file = fs::path(with_yaml_suffix(ref)).filename().string();
  const std::string pretrain = file.substr(0, file.rfind('.')) + "-pretrain";
  throw ConfigError("command line", "config", ref,
                    "an experiment (a name from configs/experiments or a YAML file), but " + ref +
                        " is a model preset: train it with --model " + ref +
                        " (on the shipped default experiment), or add --model " + ref +
                        " to --config EXPERIMENT" +
                        (find_embedded("experiments/" + pretrain + ".yaml")
                             ? "; its shipped experiment is --config " + pretrain
                             : ""));
}

bool is_null(const std::string& v) {
  return v.empty() || v == "null" || v == "~" || v == "None";
}

// Keys that give one quantity in different units (Megatron's iteration- and sample-based
// schedules), or choose between alternatives (the two ways to shard the training state). The
// one set last wins: set in a later file or on the command line, it replaces the others
// (--train_samples over an experiment's train_iters, --use_torch_fsdp2 true over its
// use_distributed_optimizer). Set in the same file, both stay, for validation to refuse.
constexpr std::string_view kAlternativeKeys[][3] = {
    {"train_iters", "train_samples", ""},
    {"use_distributed_optimizer", "use_torch_fsdp2", ""},
    {"lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"},
    {"lr_decay_iters", "lr_decay_samples", ""},
    {"lr_wsd_decay_iters", "lr_wsd_decay_samples", ""},
};

// "file.yaml:12" -> "file.yaml"; "command line" stays.
std::string origin_file(const std::string& origin) {
  const size_t colon = origin.rfind(':');
  return colon == std::string::npos ? origin : origin.substr(0, colon);
}

void replace_alternatives(Experiment& e, const std::string& key, const std::string& origin) {
  static const Experiment kDefaults;
  for (const auto& group : kAlternativeKeys) {
    if (std::find(std::begin(group), std::end(group), key) == std::end(group)) continue;
    const KeySpec& set = *find_key(key);
    if (set.get(e) == set.get(kDefaults)) return;  // unset again: replaces nothing
    for (std::string_view other : group) {
      if (other.empty() || other == key) continue;
      const KeySpec& o = *find_key(other);
      const std::string name(other);
      if (o.get(e) == o.get(kDefaults) || origin_file(e.origin[name]) == origin_file(origin))
        continue;
      o.set(e, o.get(kDefaults));
      e.origin[name] = "default";
    }
  }
}

// Applies settings in order. Megatron/Primus keys without effect are collected in `accepted`
// (each key once, its last setting) and checked once everything is loaded.
void apply_settings(Experiment& e, const std::vector<Setting>& settings,
                    std::vector<Setting>* accepted) {
  static const Experiment kDefaults;
  for (const auto& s : settings) {
    if (const KeySpec* spec = find_key(s.key)) {
      // YAML's null on a number or a boolean is Megatron's None, "not set": the built-in
      // default (Primus writes lr_decay_iters: null), and so on a choice that has no null of
      // its own (Primus's model files write tokenizer_type: null).
      const bool scalar =
          spec->type == KeyType::Int || spec->type == KeyType::Float ||
          spec->type == KeyType::Bool ||
          (spec->type == KeyType::Choice &&
           std::find(spec->choices.begin(), spec->choices.end(), "null") == spec->choices.end());
      const std::string value = scalar && is_null(s.value) ? spec->get(kDefaults) : s.value;
      if (const std::string expected = spec->set(e, value); !expected.empty())
        throw ConfigError(s.origin, s.key, s.value, expected);
      replace_alternatives(e, s.key, s.origin);
      e.origin[s.key] = s.origin;
    } else if (const MegatronKey* m = find_megatron_key(s.key)) {
      if (m->set) {
        if (is_null(s.value)) continue;  // not set: the Tessera key keeps its value
        const KeySpec& target = *find_key(m->sets);
        const std::string before = target.get(e);
        if (const std::string expected = m->set(e, s.value); !expected.empty())
          throw ConfigError(s.origin, s.key, s.value, expected);
        // fp16: false sets nothing; the key's origin stays where its value came from.
        if (target.get(e) != before) e.origin[std::string(m->sets)] = s.origin;
      } else {
        std::erase_if(*accepted, [&](const Setting& a) { return a.key == s.key; });
        accepted->push_back(s);
      }
    } else {
      throw unknown_key(s.origin, s.key, s.value);
    }
  }
}

// Each accepted Megatron/Primus key's last value must agree with what Tessera does.
void check_megatron_keys(Experiment& e, const std::vector<Setting>& accepted) {
  for (const Setting& s : accepted) {
    const MegatronKey& m = *find_megatron_key(s.key);
    if (const std::string expected = m.check(e, s.value); !expected.empty())
      throw ConfigError(s.origin, s.key, s.value, expected);
    e.megatron_keys.push_back({s.key, s.value, s.origin});
  }
}

// Megatron's run length in samples becomes train_iters here, so that everything reading
// train_iters (schedule, data, validation) sees the run's length. A train_iters that was set
// as well is left for validation to compare.
void derive_train_iters(Experiment& e) {
  TrainingConfig& t = e.training;
  if (t.train_samples <= 0 || t.global_batch_size <= 0) return;
  if (t.train_iters != 0 && e.origin["train_iters"] != "default") return;
  t.train_iters = t.train_samples / t.global_batch_size;
  e.origin["train_iters"] = e.origin["train_samples"];
}

// Keys whose value means another key's: eval_iters 0 is no evaluation (Megatron's), and
// recompute_num_layers without recompute_granularity is the full recompute of the block method
// that Primus's configs pair it with (recompute_granularity: full, recompute_method: block).
void derive_implied_keys(Experiment& e) {
  DataConfig& d = e.data;
  if (d.eval_iters == 0 && d.eval_interval > 0) {
    d.eval_interval = 0;
    e.origin["eval_interval"] = e.origin["eval_iters"];
  }
  TrainingConfig& t = e.training;
  // A granularity other than full given on the command line (--recompute_granularity
  // selective over a 70B experiment's full recompute) leaves the file's method and layer count
  // nothing to divide: they go with the full recompute they belonged to.
  if (t.recompute_granularity != RecomputeGranularity::Full &&
      e.origin["recompute_granularity"] == "command line") {
    static const TrainingConfig kDefaults;
    for (const char* key : {"recompute_method", "recompute_num_layers"}) {
      if (e.origin[key] == "command line") continue;
      e.origin[key] = "default";
    }
    if (e.origin["recompute_method"] == "default") t.recompute_method = kDefaults.recompute_method;
    if (e.origin["recompute_num_layers"] == "default")
      t.recompute_num_layers = kDefaults.recompute_num_layers;
  }
  if (t.recompute_num_layers > 0 && t.recompute_granularity == RecomputeGranularity::None &&
      e.origin["recompute_granularity"] == "default") {
    t.recompute_granularity = RecomputeGranularity::Full;
    e.origin["recompute_granularity"] = e.origin["recompute_num_layers"];
    if (t.recompute_method == RecomputeMethod::None) {
      t.recompute_method = RecomputeMethod::Block;
      e.origin["recompute_method"] = e.origin["recompute_num_layers"];
    }
  }
}

}  // namespace

std::vector<std::string> shipped_config_names(std::string_view folder) {
  std::vector<std::string> names;
  const std::string prefix = std::string(folder) + "/";
  for (const auto& c : embedded_configs()) {
    if (!c.path.starts_with(prefix) || !c.path.ends_with(".yaml")) continue;
    const std::string_view rel = c.path.substr(prefix.size(), c.path.size() - prefix.size() - 5);
    names.emplace_back(rel);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string Experiment::experiment_root() const {
  return (fs::path(workspace) / work_group / user_name / exp_name).lexically_normal().string();
}

Experiment load_experiment(const LoadOptions& options) {
  std::vector<Setting> cli = parse_cli(options.cli_overrides);
  ConfigDoc exp_doc = options.config_path.empty()
                          ? resolve(kDefaultExperiment, "", "command line", "config", "")
                          : resolve_experiment(options.config_path);
  Chain chain;
  std::vector<std::string> stack;
  std::set<std::string> loaded;
  load_chain(exp_doc, &stack, &loaded, &chain);
  std::vector<Setting>& exp_settings = chain.settings;

  // The preset named last (command line over file) supplies the model's defaults.
  std::string model_ref, model_origin = exp_doc.display, model_dir = exp_doc.dir;
  for (const auto& s : exp_settings)
    if (s.key == "model") model_ref = s.value, model_origin = s.origin;
  bool cli_model = false;
  for (const auto& s : cli)
    if (s.key == "model")
      model_ref = s.value, model_origin = s.origin, model_dir = "", cli_model = true;
  // The default experiment shrinks its tiny_llama (hidden 128, ...); a --model given without
  // --config is the preset as defined, so the default's model keys make way for it.
  if (cli_model && options.config_path.empty())
    std::erase_if(exp_settings, [](const Setting& s) {
      const KeySpec* spec = find_key(s.key);
      return spec && spec->section == "model";
    });

  Experiment e;
  for (const auto& k : config_keys()) e.origin[std::string(k.name)] = "default";
  std::vector<Setting> accepted;
  // As in Primus: the module configuration, then the model, then the experiment's overrides.
  if (chain.module_config) {
    const Setting& c = *chain.module_config;
    Chain module;
    std::vector<std::string> module_stack;
    std::set<std::string> module_loaded;
    // Only the shipped file: Primus names its own module configurations, not a path.
    load_chain(resolve("primus/" + c.value, kEmbeddedPrefix, c.origin, c.key, ""), &module_stack,
               &module_loaded, &module);
    apply_settings(e, module.settings, &accepted);
  }
  if (!model_ref.empty() && model_ref != "null") {
    Chain preset;
    std::vector<std::string> preset_stack;
    std::set<std::string> preset_loaded;
    load_chain(resolve(model_ref, model_dir, model_origin, "model", "models"), &preset_stack,
               &preset_loaded, &preset, "models");
    apply_settings(e, preset.settings, &accepted);
  }
  apply_settings(e, exp_settings, &accepted);
  apply_settings(e, cli, &accepted);
  check_megatron_keys(e, accepted);
  derive_train_iters(e);
  derive_implied_keys(e);
  e.source_file = exp_doc.display;
  validate_experiment(e, options.data_parallel_size);
  return e;
}

std::vector<double> parse_split(const std::string& text) {
  std::vector<double> parts;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(v >= 0)) return {};
    parts.push_back(v);
  }
  return parts;
}

std::string experiment_to_yaml(const Experiment& e) {
  std::string out =
      "# Effective configuration (defaults < model preset < experiment < command line)\n";
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section != section) {
      section = k.section;
      out += "# " + std::string(section) + "\n";
    }
    std::string value = k.get(e);
    if (k.type == KeyType::String && value != "null") {
      YAML::Emitter quoted;
      quoted << YAML::DoubleQuoted << value;
      value = quoted.c_str();
    }
    out += std::string(k.name) + ": " + value + "\n";
  }
  return out;
}

}  // namespace tessera
