#pragma once
// The CUPTI GpuTracer behind CudaPlatform::make_tracer (cupti_tracer.cpp, compiled only
// when CUPTI is found). Plain C++.
#include <memory>

#include "tessera/ops/gpu_tracer.h"

namespace tessera::cuda {

// One tracer records every device of the process; `device` is the one the caller uses.
std::unique_ptr<profiler::GpuTracer> make_cupti_tracer(int device);

}  // namespace tessera::cuda
