// The op-test registry (tests/common/op_registry.h) on the CPU backend: fp32 inputs, every
// output within 1e-5 of the double reference or the case's tighter tolerance. Cases of more
// than 2^24 elements are GPU-sized and left out.
#include <gtest/gtest.h>

#include "common/op_registry.h"
#include "tessera/backend/cpu/cpu_backend.h"

namespace tessera::test {
namespace {

TEST(OpRegistry, EveryOpOnTheCpuMatchesTheReference) {
  const BackendUnderTest cpu{"cpu", DType::F32, "", [] { return make_cpu_backend(); },
                             int64_t{1} << 24};
  for (const OpCase& c : all_cases()) check_case(c, cpu);
}

}  // namespace
}  // namespace tessera::test
