#pragma once
// The op-test registry (ggml test-backend-ops): every op of the op API, forward and backward,
// as cases that run on a backend under test and on the double-precision reference backend
// (reference_backend.h) with identical inputs; each output must match within a relative error.
//
// Rules, for every case on every backend: float inputs are random and never zero (asserted)
// and must come back unchanged; outputs are poisoned with NaN so that unwritten elements fail;
// accumulating outputs are pre-filled with random values; every tensor sits between guard
// bytes that must stay untouched. A case's tolerance is for bf16 compute (GPUs); fp32 compute
// (the CPU backend, which gets inputs of full fp32 precision) is held to min(tolerance, 1e-5),
// except outputs stored in bf16 (Kind::BF16), which keep their own.
//
// With TESSERA_OP_PERF=1 each case is also timed on the backend under test (median of 20 after
// warm-up) and reported against the FLOPs and bytes the op table gives the ops it runs.
//
// A backend joins with a BackendUnderTest and a test that checks every case on it: the CPU in
// tests/ops/op_registry_test.cpp, CUDA in tests/gpu/op_registry_test.cpp (attention cases once
// per attention implementation).
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/ops/backend.h"

namespace tessera::test {

enum class Kind { Act, F32, BF16, I32 };    // Act: the compute dtype of the backend under test
enum class Role { In, Out, Accum, InOut };  // Accum: pre-filled, added to; InOut: read, overwritten

// One tensor argument of a case.
struct Spec {
  std::string name;
  Shape shape;
  Kind kind = Kind::Act;
  Role role = Role::In;
  float scale = 1.0f;  // normal(0, scale) values, or ints in [int_lo, int_hi) for I32
  int int_lo = 0, int_hi = 1;
  double tol = 2e-2;      // relative error allowed for outputs under bf16 compute
  bool positive = false;  // absolute values (second moments)
};

using Tensors = std::map<std::string, Tensor>;  // by Spec::name

struct OpCase {
  std::string name;  // op, then shape and options: "matmul M64 N48 K32 NT"
  std::vector<Spec> specs;
  std::function<void(Backend&, const Tensors&)> run;
};

std::vector<OpCase> all_cases();
// rope on each attention shape and attention_forward / attention_backward.
std::vector<OpCase> attention_cases();
// Attention shapes with more query tiles than a GPU has SMs (the Hopper forward's persistent
// CTAs then take several each), causal, windowed and packed; for GPUs only: the CPU would
// spend minutes on them.
std::vector<OpCase> wide_attention_cases();

struct BackendUnderTest {
  std::string name;            // "cpu", "cuda"
  DType compute = DType::F32;  // of Kind::Act tensors; inputs are rounded to it
  std::string attention;       // its attention implementation, named in attention cases
  std::function<std::unique_ptr<Backend>()> make;  // a fresh backend per case
  // Cases whose tensors hold more elements in all are left out, with a printed line: the
  // model-sized ones (a Llama 3 vocabulary, an 8B MLP) are there for GPU kernels and timing,
  // and would cost the CPU most of the test's time and several GB.
  int64_t max_elements = std::numeric_limits<int64_t>::max();
};

// Runs `c` on a fresh backend under test and on the reference; failures are GoogleTest
// failures naming the case, the backend and the tensor.
void check_case(const OpCase& c, const BackendUnderTest& under_test);

}  // namespace tessera::test
