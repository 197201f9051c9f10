#pragma once
// `tessera report --compare A B`: the same tables side by side. Rows are matched on the key
// columns (category, kernel name, GEMM shape, ...); every numeric column becomes
// <col>_a, <col>_b, <col>_diff (b - a) and <col>_pct (100 * (b - a) / a); text columns keep
// A's value (B's when the row exists only in B).
#include <string>

#include "tessera/analysis/table.h"

namespace tessera::analysis {

Table compare_tables(const Table& a, const Table& b);
Report compare_reports(const Report& a, const Report& b);

}  // namespace tessera::analysis
