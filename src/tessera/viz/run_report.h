#pragma once
// What `tessera plot` makes of a set of runs: the four curves (loss, time per iteration,
// tokens/s, memory) with every run overlaid in its own colour, the throughput and
// configuration tables, and one self-contained HTML page holding all of it plus the tables of
// any trace report found in the run directories.
#include <string>
#include <vector>

#include "tessera/analysis/table.h"
#include "tessera/viz/chart.h"
#include "tessera/viz/run_data.h"

namespace tessera::viz {

struct NamedChart {
  std::string file_stem;  // loss, iteration_time, tokens_per_s, memory
  Chart chart;
};

std::vector<NamedChart> run_charts(const std::vector<RunData>& runs);

// One row per run: steady-state medians (the first logged record, which includes warm-up, is
// left out when there are more), peak memory, final losses, tokens/s relative to the first run.
analysis::Table throughput_table(const std::vector<RunData>& runs);
// One row per config.yaml key, one column per run, and whether the runs differ.
analysis::Table config_table(const std::vector<RunData>& runs);

std::string run_report_html(const std::vector<RunData>& runs, const std::vector<NamedChart>& charts,
                            const analysis::Table& throughput, const analysis::Table& config);

}  // namespace tessera::viz
