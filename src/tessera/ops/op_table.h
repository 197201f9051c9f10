#pragma once
// What follows from the op table (ops/op_table.inc) beside the facade itself: the op ids and
// names, the dtype-signature vocabulary the table's lines use, an op's cost, and the list of
// do_<op> overrides a backend declares:
//
//   class MyBackend : public Backend {
//    protected:
//   #define TS_OP TESSERA_OP_DECLARE_OVERRIDE
//   #include "tessera/ops/op_table.inc"
//   };
#include <array>
#include <cstdint>
#include <string_view>

#include "tessera/core/tensor.h"

namespace tessera {

// Every op of the table, in table order.
enum class OpId : uint16_t {
#define TS_OP(name, params, args, signature) name,
#include "tessera/ops/op_table.inc"
};

inline constexpr std::array kOpNames = {
#define TS_OP(name, params, args, signature) #name,
#include "tessera/ops/op_table.inc"
};
inline constexpr size_t kOpCount = kOpNames.size();

// "matmul" for OpId::matmul.
constexpr const char* op_name(OpId id) {
  return kOpNames[static_cast<size_t>(id)];
}

// The dtype rules of a table line's signature (see op_table.inc).
enum class DtypeRule : uint8_t { Compute, ComputeOrF32, Float, F32, I32, Fp8, Like };

struct TensorDtype {
  const Tensor* tensor;
  const char* name;  // the argument as written in the table ("args.out")
  DtypeRule rule;
  const Tensor* like = nullptr;  // DtypeRule::Like
  const char* like_name = "";
};

#define TS_DTYPE_RULE(t, rule)           \
  ::tessera::TensorDtype {               \
    &(t), #t, ::tessera::DtypeRule::rule \
  }
#define TS_COMPUTE(t) TS_DTYPE_RULE(t, Compute)
#define TS_COMPUTE_OR_F32(t) TS_DTYPE_RULE(t, ComputeOrF32)
#define TS_FLOAT(t) TS_DTYPE_RULE(t, Float)
#define TS_F32(t) TS_DTYPE_RULE(t, F32)
#define TS_I32(t) TS_DTYPE_RULE(t, I32)
#define TS_FP8(t) TS_DTYPE_RULE(t, Fp8)
#define TS_LIKE(t, other)                                  \
  ::tessera::TensorDtype {                                 \
    &(t), #t, ::tessera::DtypeRule::Like, &(other), #other \
  }

// What one call of an op costs: floating-point operations and the bytes it reads and writes
// at least once (the roofline's two axes). Reported with the op to the profiler ("op_flops",
// "op_bytes") and summed by the op registry's timing mode.
struct OpCost {
  double flops = 0;
  double bytes = 0;
};

// The parenthesized lists of a table line, unwrapped.
#define TS_UNPAREN(...) __VA_ARGS__

// Inside a backend class, as TS_OP: its override of every do_<op> of the table.
#define TESSERA_OP_DECLARE_OVERRIDE(name, params, args, signature) void do_##name params override;

}  // namespace tessera
