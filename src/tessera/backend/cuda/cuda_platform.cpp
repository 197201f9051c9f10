#include "tessera/backend/cuda/cuda_platform.h"

#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/device_info.h"
#include "tessera/core/error.h"
#include "tessera/ops/gpu_tracer.h"
#ifdef TESSERA_WITH_NCCL
#include "tessera/backend/cuda/nccl_communicator.h"
#endif
#ifdef TESSERA_WITH_CUPTI
#include "tessera/backend/cuda/cupti_tracer.h"
#endif

namespace tessera::cuda {
namespace {

class CudaPlatform final : public Platform {
 public:
  std::string_view name() const override { return "CUDA"; }
  int device_count() const override { return cuda::device_count(); }
  std::string unavailable_reason() const override { return cuda::unavailable_reason(); }

  std::unique_ptr<Backend> make_backend(int device, const BackendOptions& options) const override {
    return make_cuda_backend(device, options);
  }

  std::unique_ptr<dist::Communicator> make_communicator(Backend& backend,
                                                        dist::Rendezvous& rendezvous,
                                                        double timeout_s,
                                                        Logger& log) const override {
#ifdef TESSERA_WITH_NCCL
    return make_nccl_communicator(backend, rendezvous, timeout_s, log);
#else
    (void)backend, (void)rendezvous, (void)timeout_s, (void)log;
    throw ConfigError("environment", "WORLD_SIZE", "more than 1",
                      "1: this build of Tessera has no NCCL (CUDA toolkit with nccl.h and libnccl "
                      "at configure time), so it cannot train on several processes");
#endif
  }

  std::unique_ptr<profiler::GpuTracer> make_tracer(int device,
                                                   std::string* why_not) const override {
#ifdef TESSERA_WITH_CUPTI
    (void)why_not;
    return make_cupti_tracer(device);
#else
    (void)device;
    *why_not = "this build has no CUPTI (not found when it was configured)";
    return nullptr;
#endif
  }

  size_t step_buffer_bytes(const StepBufferDemand& d) const override {
    return cuda::step_buffer_bytes(d);
  }
  int64_t fp8_gemm_multiple() const override {
    return cuda::kFp8GemmMultiple;
  }

  DeviceInfo device_info(int device) const override {
    return cuda::device_info(device);
  }

  std::vector<RuntimeLibrary> runtime_libraries() const override {
    return {{"cuDNN", cudnn_version(), "loaded at run time for attention_backend cudnn/auto",
             "attention_backend auto falls back to Tessera's kernels"},
            {"NCCL", nccl_version(), "loaded at run time (ncclGetVersion)",
             "needed for multi-GPU runs"}};
  }
};

}  // namespace

const Platform& cuda_platform() {
  static const CudaPlatform platform;
  return platform;
}

}  // namespace tessera::cuda
