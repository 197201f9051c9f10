#pragma once
// The one header through which backend/cuda/ reaches its GPU vendor, as ggml's vendors/ do:
// kernels, launchers, the backend and the communicator are written against CUDA's names (the
// runtime, bf16 types, cuBLASLt, NCCL, NVTX) and a few device helpers with one name on every
// vendor (warp shuffles and votes, exp2, a device-coherent load, opaque bits, the max of 16-bit
// pairs, FP8 codes, launch bounds in blocks per multiprocessor); vendors/hip.h maps the names onto
// HIP, hipBLASLt, RCCL and roctx. The build picks the vendor (CMake's TESSERA_GPU).
//
// What each vendor compiles (docs/architecture.md, "Adding a GPU vendor"): the portable kernel
// families use only this header, so they compile for both; files with inline PTX (flash
// attention), cuDNN, cuBLASLt's FP8 GEMMs or CUPTI are CUDA's, and the backend answers the
// capability queries (Backend::supports) that keep callers off what it does not have.
#if defined(TESSERA_GPU_HIP)
#include "tessera/backend/cuda/vendors/hip.h"
#else
#include "tessera/backend/cuda/vendors/cuda.h"
#endif
