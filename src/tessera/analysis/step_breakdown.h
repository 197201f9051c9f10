#pragma once
// Where the time of one training step goes, from a trace of it (Tessera's, or a PyTorch
// profiler's with a ProfilerStep# range): every nanosecond of the step's host range is given
// to exactly one part, so the parts add up to the step.
//
//   recompute      kernels launched inside a "recompute" range (activation recompute)
//   gemm           GEMM kernels (kernel categories, docs/report.md)
//   attention      attention kernels, forward and backward
//   casts          FP8 casts, scale updates and dtype conversions (launched by the ops
//                  fp8_cast_transpose, fp8_update_scales, convert)
//   optimizer      the gradient norm and AdamW (ops sum_squares, adamw_step; kernels of the
//                  optimizer category)
//   other          every other kernel, memset and memcpy (norms, rope, SwiGLU, loss, ...)
//   communication  collectives, where no kernel of the parts above runs (exposed)
//   idle           the step's time with nothing on the GPU
//
// Kernels may overlap (a collective beside compute): each instant goes to the first part in
// the order above that is busy then.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::analysis {

struct StepPart {
  std::string name;
  int64_t ns = 0;
};

struct StepBreakdown {
  std::string step;             // the ProfilerStep#N range's name
  int64_t step_ns = 0;          // its length: the sum of the parts
  std::vector<StepPart> parts;  // in the order above, idle last
  int64_t kernels = 0;          // GPU activities inside the step
};

// The first ProfilerStep# range of the trace at `path` (plain or .gz). Throws DataError when
// the trace has none.
StepBreakdown step_breakdown(const std::string& path);

}  // namespace tessera::analysis
