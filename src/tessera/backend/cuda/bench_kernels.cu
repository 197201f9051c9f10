#include "tessera/backend/cuda/bench_kernels.cuh"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <initializer_list>

#include "tessera/backend/cuda/cuda_check.cuh"

namespace tessera::cuda {
namespace {

std::string dotted(size_t major, size_t minor, size_t patch) {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// The first of `names` the dynamic loader can open, or nullptr with the last error in *why.
// The handle is never closed: the libraries stay loaded for the life of the process anyway.
void* open_first(std::initializer_list<const char*> names, std::string* why) {
  for (const char* name : names) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return handle;
    const char* error = dlerror();
    *why = error != nullptr ? error : name;
  }
  return nullptr;
}

}  // namespace

GpuProperties gpu_properties(int device) {
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  GpuProperties p;
  p.name = prop.name;
  p.sm_major = prop.major;
  p.sm_minor = prop.minor;
  p.multiprocessors = prop.multiProcessorCount;
  p.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  TS_CUDA_CHECK(cudaSetDevice(device));
  TS_CUDA_CHECK(cudaMemGetInfo(&p.free_bytes, &p.total_bytes));
  TS_CUDA_CHECK(cudaDriverGetVersion(&p.driver_version));
  TS_CUDA_CHECK(cudaRuntimeGetVersion(&p.runtime_version));
  p.cublaslt_version = cublasLtGetVersion();
  return p;
}

std::string cudnn_version() {
  std::string why;
  void* lib = open_first({"libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"}, &why);
  if (lib == nullptr) return "not found (" + why + ")";
  using GetVersion = size_t (*)();
  auto get = reinterpret_cast<GetVersion>(dlsym(lib, "cudnnGetVersion"));
  if (get == nullptr) return "not found (libcudnn has no cudnnGetVersion)";
  const size_t v = get();  // cuDNN 9: 91002 = 9.10.2; cuDNN 8: 8902 = 8.9.2
  return v >= 90000 ? dotted(v / 10000, (v / 100) % 100, v % 100)
                    : dotted(v / 1000, (v / 100) % 10, v % 100);
}

std::string nccl_version() {
  std::string why;
  void* lib = open_first({"libnccl.so.2", "libnccl.so"}, &why);
  if (lib == nullptr) return "not found (" + why + ")";
  using GetVersion = int (*)(int*);  // ncclResult_t ncclGetVersion(int*); 0 = ncclSuccess
  auto get = reinterpret_cast<GetVersion>(dlsym(lib, "ncclGetVersion"));
  int v = 0;
  if (get == nullptr || get(&v) != 0) return "not found (libnccl has no working ncclGetVersion)";
  // NCCL >= 2.9: 22703 = 2.27.3; older: 2804 = 2.8.4.
  return v >= 10000 ? dotted(v / 10000, (v / 100) % 100, v % 100)
                    : dotted(v / 1000, (v / 100) % 10, v % 100);
}

}  // namespace tessera::cuda
