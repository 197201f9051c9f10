#pragma once
// The per-op parts of the op table's lines (ops/op_table.inc), defined in ops/op_defs.cpp:
//   check_<op>     placement and shapes (dtypes are the table's signature),
//   describe_<op>  the arguments reported to the profiler (ops/op_observer.h),
//   cost_<op>      FLOPs and bytes of one call.
#include "tessera/ops/backend.h"
#include "tessera/ops/op_checks.h"
#include "tessera/ops/op_observer.h"

namespace tessera::op_defs {

#define TS_OP(name, params, args, signature)                      \
  void check_##name(const OpChecks& check, TS_UNPAREN params); \
  OpArgs describe_##name params;                               \
  OpCost cost_##name params;
#include "tessera/ops/op_table.inc"

}  // namespace tessera::op_defs
