#pragma once
// The CPU backend: the fp32 reference implementation of the op API, fast enough to train a
// tiny model. The arithmetic is that of backend/cpu/reference.h (float instances) except
// matmul, which is OpenBLAS sgemm; rows, heads and chunks are spread over OpenMP threads.
// Results do not depend on the OpenMP thread count: row ops are independent per row, and
// reductions (sum, sum_squares, weight-gradient column sums, dk/dv shared by query heads)
// combine fixed pieces in a fixed order. sgemm's own threading is OpenBLAS's business.
//
// Tensors are fp32 (int32 for tokens and targets); other dtypes fail a check, since bf16
// compute belongs to the GPU backend. FP8 casts are emulated code for code and FP8 GEMMs
// in fp32 on the dequantised codes, so that the FP8 recipe can be tested here
// (cpu_fp8.cpp). convert() also handles fp32 <-> bf16 so that checkpoints and tests can
// move data between the two.
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "tessera/ops/allocation_tracker.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Not final: tests derive broken variants of single ops from it.
class CpuBackend : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  Device device() const override { return Device{DeviceKind::CPU, 0}; }
  std::string_view name() const override { return "cpu"; }
  std::string description() const override;
  bool supports(Capability c) const override;
  // The GPU backends' rule (CUDA's cuBLASLt: 16), kept by the FP8 emulation so that an FP8
  // model the CPU runs in tests is one a GPU runs.
  int64_t fp8_gemm_multiple() const override { return 16; }

  void* allocate(size_t bytes, const char* what) override;
  void release(void* ptr) override;
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;
  void synchronize() override {}

  // Ops run as they are called, so an event is the host time at which it was recorded.
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event) override;
  void wait_event(EventHandle) override {}
  double elapsed_ms(EventHandle start, EventHandle end) override;

 protected:
  void do_upload(const Tensor& dst, const void* host_src) override;
  void do_download(void* host_dst, const Tensor& src) override;
  void do_copy(const Tensor& dst, const Tensor& src) override;

  // Every op of the table (ops/op_table.inc).
#define TS_OP TESSERA_OP_DECLARE_OVERRIDE
#include "tessera/ops/op_table.inc"

 private:
  AllocationTracker allocations_;
  std::deque<double> event_times_ms_;  // events: indices into it, biased by one
  std::vector<size_t> free_events_;
};

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace tessera
