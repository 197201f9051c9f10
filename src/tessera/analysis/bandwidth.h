#pragma once
// The bandwidth roofline of the kernels that move memory rather than compute: elementwise,
// reduction, normalization and optimizer kernels, copies and fills. Per op call: the bytes it
// moves (from its shapes and dtypes), the GB/s it achieved and the share of the GPU's HBM
// bandwidth that is. docs/report.md ("Bandwidth") states what the bytes count.
//
// Bytes are the minimum traffic: every tensor the op reads or writes, once. Kernels that read
// a tensor twice, or keep it in L2, move more or less than that, so the numbers are an
// estimate; each row says which rule counted its bytes, or why none could.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

struct BytesEstimate {
  double bytes = -1;  // per call; < 0 when not derived
  std::string basis;  // the rule that counted them, or "not derived: <why>"
  bool hbm = true;    // false for host and peer transfers, which a link bounds, not HBM
};

// A PyTorch op from its "Input Dims", "Input type" and "Concrete Inputs" (raw JSON text).
BytesEstimate pytorch_op_bytes(std::string_view op, std::string_view input_dims,
                               std::string_view input_types, std::string_view concrete_inputs);
// A Tessera op from its arguments (a JSON object: rows, cols, numel, dtype, ...).
BytesEstimate tessera_op_bytes(std::string_view op, std::string_view args_json);
// A gpu_memcpy / gpu_memset event from its "bytes".
BytesEstimate transfer_bytes(std::string_view activity_name, GpuKind kind, int64_t bytes);

// True for the categories the bandwidth sheet covers.
bool bandwidth_category(Category c);

Table bandwidth_table(const TraceData& data, const std::optional<GpuSpec>& gpu);

}  // namespace tessera::analysis
