#pragma once
// What `tessera plot` reads from an experiment directory: metrics.jsonl (one record per
// logged iteration, plus evaluation records), config.yaml (the effective configuration), the
// device line of rank 0's info.log, and a `tessera report` output if one was written there.
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace tessera::viz {

// One logged iteration; NaN where the record lacks the key.
struct IterationRecord {
  int64_t iteration = 0;
  double lm_loss, elapsed_ms, tokens_per_s_per_gpu, tflops_per_gpu, mem_peak_gib, mem_allocated_gib;
  // MoE runs: the aux loss (mean over MoE layers) and the worst layer's expert-load CV.
  double moe_aux_loss, moe_expert_tokens_cv;
  // DPO runs: TRL's rewards/accuracies and rewards/margins.
  double dpo_accuracy, dpo_margin;
  // GRPO runs: the mean reward of the step's completions and their share of right answers.
  double grpo_reward, grpo_accuracy;
};

// A table of a trace report, read back from its CSV: every cell as text.
struct CsvTable {
  std::string name;  // file stem: categories, gemm, ...
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
};

struct RunData {
  std::filesystem::path dir;
  std::string label;                        // exp_name from config.yaml, else the directory name
  // The latest run in metrics.jsonl (its run id; earlier runs that appended there before
  // runs were moved aside are left out). Earlier runs of the experiment are under
  // previous_runs/<run id>/, each an experiment directory of its own.
  std::string run_id;
  bool earlier_runs_left_out = false;
  std::vector<IterationRecord> iterations;  // by iteration
  std::vector<std::pair<int64_t, double>> eval_loss;        // (iteration, eval_lm_loss)
  std::vector<std::pair<std::string, std::string>> config;  // config.yaml, in file order
  bool has_config = false;                                  // config.yaml exists
  std::string device;                // "NVIDIA H200 (sm_90, ...)"; empty if no log
  // Trained on the CPU backend: rank 0's log names it ("cpu (OpenBLAS, ...)") or, without a
  // log, config.yaml says `device: cpu`. Its memory is host memory and a rank is a thread.
  bool on_cpu = false;
  std::string eval_warning;          // rank 0's warning that evaluation is disabled, if any
  std::filesystem::path report_dir;  // a `tessera report` output under dir; empty if none
  std::vector<CsvTable> report_tables;
  std::vector<std::string> trace_files;  // traces/*.json[.gz] relative to dir, sorted
  int skipped_lines = 0;  // metrics lines that were not JSON objects

  std::string config_value(const std::string& key) const;  // "" when absent
};

// The run directories `dir` names: `dir` itself when it holds a metrics.jsonl, else every
// directory below it that does (a workspace: {workspace}/{work_group}/{user_name}/{exp_name}),
// sorted. The search does not go into a run (its previous_runs/ holds earlier runs of the same
// experiment, to be named explicitly) or into hidden directories. Empty when there is none.
std::vector<std::filesystem::path> find_runs(const std::filesystem::path& dir);

// Throws DataError when `dir` has no readable metrics.jsonl.
RunData load_run(const std::filesystem::path& dir);

// Gives runs with equal labels distinct ones ("name (dir)") so legends stay unambiguous.
void disambiguate_labels(std::vector<RunData>& runs);

// RFC 4180 CSV as written by analysis::write_csv (quoted fields may hold commas, quotes and
// newlines). Throws DataError when the file cannot be read.
CsvTable read_csv(const std::filesystem::path& file);

}  // namespace tessera::viz
