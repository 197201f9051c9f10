// Device facts and the versions of the libraries the CUDA platform opens at run time (cuDNN,
// NCCL): Tessera does not link them, so a machine without them still runs.
#include "tessera/backend/cuda/device_info.h"

#include <dlfcn.h>

#include <initializer_list>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/vendor.h"

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

// CUDA's version encoding: 13000 = 13.0.
static std::string cuda_version(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

DeviceInfo device_info(int device) {
  cudaDeviceProp prop{};
  TS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo d;
  d.name = prop.name;
  d.compute_capability = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  d.multiprocessors = prop.multiProcessorCount;
  d.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  TS_CUDA_CHECK(cudaSetDevice(device));
  TS_CUDA_CHECK(cudaMemGetInfo(&d.free_bytes, &d.total_bytes));
  int driver = 0, runtime = 0;
  TS_CUDA_CHECK(cudaDriverGetVersion(&driver));
  TS_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  d.driver = cuda_version(driver);
  d.runtime = cuda_version(runtime);
  const size_t lt = cublasLtGetVersion();  // 130100 = 13.1.0
  d.blas = "cuBLASLt " + dotted(lt / 10000, lt / 100 % 100, lt % 100);
  return d;
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
