#pragma once
// GEMM and attention shapes, FLOPs and roofline columns. shapes.cpp reads shapes and holds
// the FLOP conventions; shape_tables.cpp builds the gemm and attention tables.
//
// Shapes come from Tessera's kernel args (M/N/K/batch/dtype; B/H/KV/T/S/D/causal/window) or
// from the "Input Dims" / "Input type" / "Concrete Inputs" of the CPU op that launched the
// kernel (External id). A "call" is one op instance: the kernels it launched are summed (a
// split-K GEMM or cuDNN's four-kernel attention backward is one call).
//
// Conventions (docs/report.md): GEMM FLOPs = 2*M*N*K*batch, bytes = A + B + C once each
// (fp8 GEMMs write bf16). Attention forward FLOPs = 4*B*H*T*S*D (QK^T and PV), halved when
// causal; with a sliding window W < S the pairs are T*W instead; backward = 2.5x forward.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/table.h"
#include "tessera/analysis/trace_data.h"

namespace tessera::analysis {

struct GemmShape {
  int64_t m = -1, n = -1, k = -1, batch = 1;
  std::string dtype;
};

struct AttentionShape {
  int64_t b = -1, h = -1, kv = -1, t = -1, s = -1, d = -1, window = -1;
  int causal = -1;
  std::string dtype;
  int64_t dv = -1;  // value head dim where it differs from d (multi-latent attention)
};

// "[[1024, 256], [256, 256]]" -> {{1024, 256}, {256, 256}}; entries that are not flat lists
// of integers (tensor lists, scalars) become empty.
std::vector<std::vector<int64_t>> parse_dims(std::string_view raw_json);
// '["c10::BFloat16", "", "True"]' -> {"c10::BFloat16", "", "True"}
std::vector<std::string> parse_strings(std::string_view raw_json);

std::optional<GemmShape> gemm_shape_from_op(std::string_view op,
                                            const std::vector<std::vector<int64_t>>& dims,
                                            const std::vector<std::string>& types);
std::optional<AttentionShape> attention_shape_from_op(std::string_view op,
                                                      const std::vector<std::vector<int64_t>>& dims,
                                                      const std::vector<std::string>& types,
                                                      const std::vector<std::string>& concrete);

double gemm_flops(const GemmShape& s);
double gemm_bytes(const GemmShape& s);
double attention_flops(const AttentionShape& s, bool backward);

Table gemm_table(const TraceData& data, const std::optional<GpuSpec>& gpu);
Table attention_table(const TraceData& data, const std::optional<GpuSpec>& gpu);

}  // namespace tessera::analysis
