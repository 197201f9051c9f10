// The op-test registry (tests/common/op_registry.h) on the CPU backend: fp32 inputs, every
// output within 1e-5 of the double reference or the case's tighter tolerance. Cases of more
// than 2^24 elements are GPU-sized and left out. And the registry against the op table: every
// op of ops/op_table.inc has a case named after it.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "common/op_registry.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/ops/op_table.h"

namespace tessera::test {
namespace {

TEST(OpRegistry, EveryOpOnTheCpuMatchesTheReference) {
  const BackendUnderTest cpu{"cpu", DType::F32, "", [] { return make_cpu_backend(); },
                             int64_t{1} << 24};
  for (const OpCase& c : all_cases()) check_case(c, cpu);
}

// The ops a case's name says it tests: its first word, ops joined by '+', where "x+backward"
// and "x_forward+backward" also name x_backward ("fp8_block_cast+matmul_fp8 ...",
// "swiglu_forward+backward", "log_softmax_gather+backward").
std::set<std::string> ops_named(const std::string& case_name) {
  std::set<std::string> ops;
  const std::string first = case_name.substr(0, case_name.find(' '));
  std::string previous;
  for (size_t at = 0; at <= first.size();) {
    const size_t plus = std::min(first.find('+', at), first.size());
    std::string part = first.substr(at, plus - at);
    if (part == "backward") {
      const std::string base =
          previous.ends_with("_forward") ? previous.substr(0, previous.size() - 8) : previous;
      part = base + "_backward";
    }
    ops.insert(part);
    previous = part;
    at = plus + 1;
  }
  return ops;
}

TEST(OpRegistry, EveryOpOfTheTableHasACase) {
  std::set<std::string> covered;
  for (const OpCase& c : all_cases()) covered.merge(ops_named(c.name));
  for (const char* op : kOpNames)
    EXPECT_TRUE(covered.count(op)) << op << " has no case in tests/common/op_registry.cpp";
}

}  // namespace
}  // namespace tessera::test
