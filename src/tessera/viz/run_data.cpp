#include "tessera/viz/run_data.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/train/run_directories.h"

namespace tessera::viz {
namespace {

namespace fs = std::filesystem;

// The report tables a run report shows, in this order, when present.
constexpr const char* kReportTables[] = {"gpu_timeline", "categories", "top_kernels",
                                         "gemm",         "attention",  "collectives"};

double number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : NAN;
}

std::vector<std::pair<std::string, std::string>> read_config(const fs::path& file) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!fs::exists(file)) return out;
  try {
    const YAML::Node root = YAML::LoadFile(file.string());
    for (const auto& kv : root) {
      const YAML::Node& v = kv.second;
      std::string text;
      if (v.IsScalar()) {
        text = v.as<std::string>();
      } else if (!v.IsNull()) {
        YAML::Emitter e;
        e << YAML::Flow << v;
        text = e.c_str();
      }
      out.emplace_back(kv.first.as<std::string>(), text);
    }
  } catch (const YAML::Exception& e) {
    throw DataError(fmt::format("{}: not valid YAML: {}", file.string(), e.what()));
  }
  return out;
}

// The message of the first line of rank 0's `file` that contains `text`:
// "[2026-11-22 03:12:52.390][rank-0][INFO] backend: NVIDIA H200 (...)" -> "backend: ...".
std::string log_message(const fs::path& dir, const char* file, const std::string& text) {
  std::ifstream in(dir / "logs" / "pre_trainer" / "rank-0" / file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(text) == std::string::npos) continue;
    const size_t at = line.find("] ");
    return at == std::string::npos ? line : line.substr(at + 2);
  }
  return "";
}

std::vector<std::string> find_traces(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir / "traces", ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && (name.ends_with(".json") || name.ends_with(".json.gz")))
      out.push_back("traces/" + name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The shallowest directory under `dir` (itself included, two levels down) holding the CSVs
// of `tessera report`.
fs::path find_report_dir(const fs::path& dir) {
  if (fs::exists(dir / "gpu_timeline.csv")) return dir;
  std::vector<fs::path> level = {dir};
  for (int depth = 0; depth < 2; ++depth) {
    std::vector<fs::path> next;
    for (const fs::path& d : level) {
      std::error_code ec;
      for (const auto& entry : fs::directory_iterator(d, ec)) {
        if (!entry.is_directory()) continue;
        if (fs::exists(entry.path() / "gpu_timeline.csv")) return entry.path();
        next.push_back(entry.path());
      }
    }
    level = std::move(next);
  }
  return {};
}

}  // namespace

std::string RunData::config_value(const std::string& key) const {
  for (const auto& [k, v] : config)
    if (k == key) return v;
  return "";
}

CsvTable read_csv(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot read", file.string()));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<std::vector<std::string>> records(1);
  std::string field;
  bool quoted = false, any = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"', ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      quoted = any = true;
    } else if (c == ',') {
      records.back().push_back(std::move(field)), field.clear(), any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) records.back().push_back(std::move(field));
      field.clear(), any = false;
      records.emplace_back();
    } else {
      field += c, any = true;
    }
  }
  if (any || !field.empty()) records.back().push_back(std::move(field));
  while (!records.empty() && records.back().empty()) records.pop_back();
  CsvTable t;
  t.name = file.stem().string();
  if (records.empty()) return t;
  t.columns = std::move(records.front());
  t.rows.assign(std::make_move_iterator(records.begin() + 1),
                std::make_move_iterator(records.end()));
  return t;
}

namespace {

// Where the latest run's records begin: after the last record of another run id or, in files
// written before runs had ids, after the last time the iteration went down (a rerun that
// appended from iteration 1). A resumed run continues its iterations, and its id.
size_t latest_run_start(const std::vector<nlohmann::json>& records) {
  if (records.empty()) return 0;
  const nlohmann::json& last = records.back();
  if (last.contains("run_id")) {
    size_t i = records.size();
    while (i > 0 && records[i - 1].value("run_id", std::string()) == last["run_id"]) --i;
    return i;
  }
  size_t start = 0;
  for (size_t i = 1; i < records.size(); ++i)
    if (records[i]["iteration"].get<int64_t>() < records[i - 1]["iteration"].get<int64_t>())
      start = i;
  return start;
}

// The largest of the per-layer expert-load CVs of an MoE record; NaN otherwise.
double worst_cv(const nlohmann::json& j) {
  double worst = std::nan("");
  if (!j.contains("moe_expert_tokens_cv") || !j["moe_expert_tokens_cv"].is_array()) return worst;
  for (const auto& v : j["moe_expert_tokens_cv"])
    if (v.is_number())
      worst = std::isfinite(worst) ? std::max(worst, v.get<double>()) : v.get<double>();
  return worst;
}

}  // namespace

std::vector<fs::path> find_runs(const fs::path& dir) {
  if (fs::is_regular_file(dir / "metrics.jsonl")) return {dir};
  std::vector<fs::path> runs;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& entry = *it;
    std::error_code type_ec;
    if (!entry.is_directory(type_ec)) continue;
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".") || name == kPreviousRunsDir) {
      it.disable_recursion_pending();
    } else if (fs::is_regular_file(entry.path() / "metrics.jsonl", type_ec)) {
      runs.push_back(entry.path());
      it.disable_recursion_pending();
    }
  }
  std::sort(runs.begin(), runs.end());
  return runs;
}

RunData load_run(const fs::path& dir) {
  RunData r;
  r.dir = dir;
  std::ifstream in(dir / "metrics.jsonl");
  if (!in) {
    throw DataError(
        fmt::format("{}: no metrics.jsonl (expected an experiment directory written "
                    "by tessera train)",
                    dir.string()));
  }
  std::vector<nlohmann::json> records;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    // A run killed mid-write leaves a torn last line: count it, keep the rest.
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("iteration") || !j["iteration"].is_number_integer()) {
      ++r.skipped_lines;
      continue;
    }
    records.push_back(std::move(j));
  }
  const size_t first = latest_run_start(records);
  r.earlier_runs_left_out = first > 0;
  if (!records.empty() && records.back().contains("run_id"))
    r.run_id = records.back()["run_id"].get<std::string>();
  std::map<int64_t, IterationRecord> by_iteration;
  std::map<int64_t, double> eval;
  for (size_t i = first; i < records.size(); ++i) {
    const nlohmann::json& j = records[i];
    const int64_t it = j["iteration"].get<int64_t>();
    if (j.contains("eval_lm_loss")) eval[it] = number(j, "eval_lm_loss");
    if (!j.contains("lm_loss")) continue;
    by_iteration[it] = IterationRecord{it,
                                       number(j, "lm_loss"),
                                       number(j, "elapsed_ms"),
                                       number(j, "tokens_per_s_per_gpu"),
                                       number(j, "tflops_per_gpu"),
                                       number(j, "mem_peak_gib"),
                                       number(j, "mem_allocated_gib"),
                                       number(j, "moe_aux_loss"),
                                       worst_cv(j),
                                       number(j, "rewards/accuracies"),
                                       number(j, "rewards/margins"),
                                       number(j, "reward"),
                                       number(j, "accuracy")};
  }
  for (auto& [it, rec] : by_iteration) r.iterations.push_back(rec);
  for (auto& [it, loss] : eval)
    if (std::isfinite(loss)) r.eval_loss.emplace_back(it, loss);

  r.config = read_config(dir / "config.yaml");
  r.label = r.config_value("exp_name");
  if (r.label.empty()) {
    fs::path norm = fs::absolute(dir).lexically_normal();
    if (norm.filename().empty()) norm = norm.parent_path();  // "runs/a/" names "a"
    r.label = norm.filename().string();
  }
  r.has_config = fs::exists(dir / "config.yaml");
  const std::string backend = "backend: ";
  r.device = log_message(dir, "info.log", "] " + backend);
  if (r.device.starts_with(backend)) r.device.erase(0, backend.size());
  r.on_cpu = r.device.empty() ? r.config_value("device") == "cpu" : r.device.starts_with("cpu");
  r.eval_warning = log_message(dir, "warning.log", "evaluation is disabled");
  r.trace_files = find_traces(dir);
  r.report_dir = find_report_dir(dir);
  if (!r.report_dir.empty()) {
    for (const char* name : kReportTables) {
      const fs::path csv = r.report_dir / (std::string(name) + ".csv");
      if (fs::exists(csv)) r.report_tables.push_back(read_csv(csv));
    }
  }
  return r;
}

void disambiguate_labels(std::vector<RunData>& runs) {
  std::map<std::string, int> count;
  for (const RunData& r : runs) ++count[r.label];
  for (RunData& r : runs) {
    if (count[r.label] > 1) r.label += " (" + r.dir.lexically_normal().string() + ")";
  }
}

}  // namespace tessera::viz
