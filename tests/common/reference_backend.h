#pragma once
// The oracle of the op-test registry (op_registry.h): a backend whose every computing op runs
// the double instances of backend/cpu/reference.h on double copies of its fp32 tensors (int32
// for ids) and rounds the results to fp32 once. So the CPU backend, which runs the float
// instances, OpenBLAS and OpenMP, is tested like any other backend.
//
// Memory, transfers and events are the CPU backend's (host memory). Everything else is
// overridden, fill and convert included, so that no op of the backend under test is ever
// compared with itself. Exceptions, where the op is defined in float: init_normal (bit for bit
// the float instance), the FP8 codes (core/fp8.h, of the fp32 product x * scale, as GPUs
// compute it) and the FP8 scale update (core/fp8.h's fp32 reference).
#include "tessera/backend/cpu/cpu_backend.h"

namespace tessera::test {

class ReferenceBackend final : public CpuBackend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string description() const override { return "double-precision reference"; }

 protected:
  // Every op of the table (ops/op_table.inc).
#define TS_OP TESSERA_OP_DECLARE_OVERRIDE
#include "tessera/ops/op_table.inc"
};

}  // namespace tessera::test
