// The CUPTI GpuTracer: CUPTI's activity API records kernels (CONCURRENT_KERNEL), memcpy,
// memset, CUDA runtime and driver API calls and external correlations into buffers that
// CUPTI hands back through callbacks; they are decoded into GpuTrace records as they arrive.
//
// Compiled into tessera_cuda only, when CMake finds CUPTI, so no CUPTI symbol reaches
// tessera_lib. Every CUPTI call is checked: a failure to start
// becomes a reason string (the profiler then writes a CPU-only trace), a failure later
// becomes a warning in the trace, never an exception or an abort.
//
// Clock: CUPTI's own timestamps (CLOCK_REALTIME on Linux, normalised by CUPTI for GPU
// timestamps); host spans read the same clock through cuptiGetTimestamp.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "tessera/backend/cuda/cupti_tracer.h"
#include "tessera/backend/cuda/vendor.h"

namespace tessera::profiler {
namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kBufferAlignment = 8;
constexpr CUpti_ExternalCorrelationKind kExternalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

// Enabled in this order, disabled in reverse. Without an optional kind the trace is still
// useful: without DRIVER, kernels launched through the driver API (cuBLASLt, cuDNN) have no
// launch record; without EXTERNAL_CORRELATION, ops are matched to API calls by time.
struct KindSpec {
  CUpti_ActivityKind kind;
  bool required;
};
constexpr KindSpec kKinds[] = {
    {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, true},
    {CUPTI_ACTIVITY_KIND_MEMCPY, true},
    {CUPTI_ACTIVITY_KIND_MEMSET, true},
    {CUPTI_ACTIVITY_KIND_RUNTIME, true},
    {CUPTI_ACTIVITY_KIND_DRIVER, false},
    {CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION, false},
};

const char* kind_name(CUpti_ActivityKind k) {
  switch (k) {
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION:
      return "EXTERNAL_CORRELATION";
    case CUPTI_ACTIVITY_KIND_RUNTIME:
      return "RUNTIME";
    case CUPTI_ACTIVITY_KIND_DRIVER:
      return "DRIVER";
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      return "CONCURRENT_KERNEL";
    case CUPTI_ACTIVITY_KIND_MEMCPY:
      return "MEMCPY";
    case CUPTI_ACTIVITY_KIND_MEMSET:
      return "MEMSET";
    default:
      return "?";
  }
}

std::string cupti_message(const char* call, CUptiResult r) {
  const char* text = nullptr;
  if (cuptiGetResultString(r, &text) != CUPTI_SUCCESS || text == nullptr) text = "unknown error";
  std::string msg = fmt::format("{} failed: {} ({})", call, text, static_cast<int>(r));
  if (r == CUPTI_ERROR_INSUFFICIENT_PRIVILEGES) {
    msg +=
        "; this user may not trace the GPU (see NVreg_RestrictProfilingToAdminUsers, or run "
        "with the needed capability)";
  } else if (r == CUPTI_ERROR_NOT_INITIALIZED) {
    msg += "; CUPTI could not initialise (driver older than this CUPTI, or no device)";
  } else if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
    msg += "; another profiler (Nsight Systems, a CUPTI tool) is attached";
  }
  return msg;
}

std::string cuda_message(const char* call, cudaError_t e) {
  return fmt::format("{} failed: {} ({})", call, cudaGetErrorName(e), cudaGetErrorString(e));
}

// "Memcpy HtoD (Pageable -> Device)", Kineto's naming.
const char* memory_kind_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE:
      return "Pageable";
    case CUPTI_ACTIVITY_MEMORY_KIND_PINNED:
      return "Pinned";
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE:
      return "Device";
    case CUPTI_ACTIVITY_MEMORY_KIND_ARRAY:
      return "Array";
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED:
      return "Managed";
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC:
      return "Device Static";
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC:
      return "Managed Static";
    default:
      return "Unknown";
  }
}

const char* copy_kind_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA:
      return "HtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH:
      return "AtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA:
      return "AtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD:
      return "AtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA:
      return "DtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "PtoP";
    default:
      return "Unknown";
  }
}

// "cudaLaunchKernel_v7000" -> "cudaLaunchKernel".
std::string strip_version_suffix(std::string name) {
  const size_t v = name.rfind("_v");
  if (v != std::string::npos && v + 2 < name.size() &&
      name.find_first_not_of("0123456789", v + 2) == std::string::npos) {
    name.resize(v);
  }
  return name;
}

std::string demangle(const char* name) {
  if (name == nullptr) return "(unnamed kernel)";
  int status = -1;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string result = (status == 0 && out != nullptr) ? std::string(out) : std::string(name);
  std::free(out);
  return result;
}

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

class CuptiTracer;

// CUPTI's buffer callbacks carry no user pointer: buffers go to the one recording tracer.
std::mutex g_mutex;
CuptiTracer* g_recording = nullptr;   // guarded by g_mutex
bool g_callbacks_registered = false;  // guarded by g_mutex

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;  // 0: CUPTI drops records and counts them
  *max_records = 0;                               // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t size,
                               size_t valid);

class CuptiTracer final : public GpuTracer {
 public:
  CuptiTracer() = default;
  ~CuptiTracer() override {
    if (recording_) stop();  // discards what was recorded
  }

  std::string description() const override {
    uint32_t version = 0;
    if (cuptiGetVersion(&version) != CUPTI_SUCCESS) return "CUPTI";
    return fmt::format("CUPTI (API version {}, headers {})", version, CUPTI_API_VERSION);
  }

  std::vector<GpuDeviceInfo> devices() const override {
    std::vector<GpuDeviceInfo> out;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      return out;
    }
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      GpuDeviceInfo i;
      i.id = d;
      i.name = p.name;
      i.total_memory = p.totalGlobalMem;
      i.compute_major = p.major;
      i.compute_minor = p.minor;
      i.sms = p.multiProcessorCount;
      i.max_threads_per_block = p.maxThreadsPerBlock;
      i.max_threads_per_sm = p.maxThreadsPerMultiProcessor;
      i.regs_per_block = p.regsPerBlock;
      i.regs_per_sm = p.regsPerMultiprocessor;
      i.warp_size = p.warpSize;
      i.shared_memory_per_block = p.sharedMemPerBlock;
      i.shared_memory_per_block_optin = p.sharedMemPerBlockOptin;
      i.shared_memory_per_sm = p.sharedMemPerMultiprocessor;
      out.push_back(std::move(i));
    }
    return out;
  }

  bool start(std::string* error) override {
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_recording != nullptr) {
        *error = "another GPU trace is already recording in this process";
        return false;
      }
      g_recording = this;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      trace_ = GpuTrace{};
      names_.clear();
      api_names_.clear();
      push_failures_ = 0;
      first_failure_.clear();
    }
    // No CUPTI call below holds g_mutex: CUPTI may deliver buffers on this thread.
    auto fail = [&](const std::string& why) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_recording = nullptr;
      *error = why;
      return false;
    };
    bool register_now = false;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      register_now = !g_callbacks_registered;
    }
    if (register_now) {
      const CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
      if (r != CUPTI_SUCCESS) return fail(cupti_message("cuptiActivityRegisterCallbacks", r));
      std::lock_guard<std::mutex> lock(g_mutex);
      g_callbacks_registered = true;
    }
    // System thread ids (gettid), so that API calls land on the host spans' thread.
    CUptiResult r = cuptiSetThreadIdType(CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM);
    if (r != CUPTI_SUCCESS) {
      std::lock_guard<std::mutex> lock(mu_);
      trace_.warnings.push_back(cupti_message("cuptiSetThreadIdType(SYSTEM)", r) +
                                "; CUDA API calls may appear on separate thread tracks");
    }
    enabled_.clear();
    for (const KindSpec& k : kKinds) {
      r = cuptiActivityEnable(k.kind);
      if (r == CUPTI_SUCCESS) {
        enabled_.push_back(k.kind);
        continue;
      }
      const std::string why =
          cupti_message(fmt::format("cuptiActivityEnable({})", kind_name(k.kind)).c_str(), r);
      if (k.required) {
        disable_enabled();
        return fail(why);
      }
      std::lock_guard<std::mutex> lock(mu_);
      trace_.warnings.push_back(why + "; recording without it");
    }
    // The first timestamp read initialises CUPTI's clock conversion before any span needs it.
    uint64_t now = 0;
    r = cuptiGetTimestamp(&now);
    if (r != CUPTI_SUCCESS) {
      const std::string why = cupti_message("cuptiGetTimestamp", r);
      disable_enabled();
      return fail(why);
    }
    recording_ = true;
    return true;
  }

  int64_t timestamp_ns() override {
    uint64_t t = 0;
    if (cuptiGetTimestamp(&t) == CUPTI_SUCCESS) return static_cast<int64_t>(t);
    return realtime_ns();  // CUPTI's documented default clock on Linux
  }

  void push_external_id(uint64_t id) override {
    const CUptiResult r = cuptiActivityPushExternalCorrelationId(kExternalKind, id);
    if (r != CUPTI_SUCCESS) note_failure("cuptiActivityPushExternalCorrelationId", r);
  }

  void pop_external_id() override {
    uint64_t last = 0;
    const CUptiResult r = cuptiActivityPopExternalCorrelationId(kExternalKind, &last);
    if (r != CUPTI_SUCCESS) note_failure("cuptiActivityPopExternalCorrelationId", r);
  }

  GpuTrace stop() override {
    if (!recording_) return {};
    recording_ = false;
    std::vector<std::string> warnings;
    // Every activity must be complete before the forced flush, or its record is lost.
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      cudaGetLastError();
      warnings.push_back(cuda_message("cudaDeviceSynchronize", e) +
                         "; activities still running may be missing");
    }
    disable_enabled(&warnings);
    CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (r != CUPTI_SUCCESS) warnings.push_back(cupti_message("cuptiActivityFlushAll", r));
    size_t dropped = 0;
    r = cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_recording == this) g_recording = nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (r == CUPTI_SUCCESS) trace_.dropped_records += dropped;
    if (trace_.dropped_records > 0) {
      trace_.warnings.push_back(
          fmt::format("CUPTI dropped {} activity records (buffers full); the trace is incomplete",
                      trace_.dropped_records));
    }
    if (push_failures_ > 0) {
      trace_.warnings.push_back(fmt::format(
          "{} external-correlation calls failed (first: {}); kernels of those ops are linked "
          "by time instead",
          push_failures_, first_failure_));
    }
    for (auto& w : warnings) trace_.warnings.push_back(std::move(w));
    GpuTrace out = std::move(trace_);
    trace_ = GpuTrace{};
    names_.clear();
    api_names_.clear();
    return out;
  }

  // Decodes one completed buffer (CUPTI's thread, or ours inside the flush).
  void consume(uint8_t* buffer, size_t valid) {
    std::lock_guard<std::mutex> lock(mu_);
    CUpti_Activity* record = nullptr;
    for (;;) {
      const CUptiResult r = cuptiActivityGetNextRecord(buffer, valid, &record);
      if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
      if (r != CUPTI_SUCCESS) {
        trace_.warnings.push_back(cupti_message("cuptiActivityGetNextRecord", r) +
                                  "; the rest of an activity buffer was skipped");
        break;
      }
      decode(record);
    }
  }

  void add_dropped(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    trace_.dropped_records += n;
  }

 private:
  uint32_t intern(std::string name) {
    auto it = names_.find(name);
    if (it != names_.end()) return it->second;
    const auto id = static_cast<uint32_t>(trace_.names.size());
    trace_.names.push_back(name);
    names_.emplace(std::move(name), id);
    return id;
  }

  uint32_t api_name(bool driver, uint32_t cbid) {
    const uint64_t key = (static_cast<uint64_t>(driver) << 32) | cbid;
    auto it = api_names_.find(key);
    if (it != api_names_.end()) return it->second;
    const char* raw = nullptr;
    const CUpti_CallbackDomain domain =
        driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API;
    std::string name = (cuptiGetCallbackName(domain, cbid, &raw) == CUPTI_SUCCESS && raw != nullptr)
                           ? strip_version_suffix(raw)
                           : fmt::format("{} API {}", driver ? "driver" : "runtime", cbid);
    const uint32_t id = intern(std::move(name));
    api_names_.emplace(key, id);
    return id;
  }

  // The fields kernels, copies and sets share (CUPTI's records name them alike).
  template <typename Record>
  GpuActivityRecord device_activity(const Record& r, GpuActivityKind kind, std::string name) {
    GpuActivityRecord a;
    a.kind = kind;
    a.name = intern(std::move(name));
    a.start_ns = static_cast<int64_t>(r.start);
    a.end_ns = static_cast<int64_t>(r.end);
    a.device = r.deviceId;
    a.context = r.contextId;
    a.stream = r.streamId;
    a.correlation = r.correlationId;
    return a;
  }

  void decode(const CUpti_Activity* record) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        if (k->start == 0 && k->end == 0) {
          ++trace_.records_without_timestamps;
          return;
        }
        GpuActivityRecord a = device_activity(*k, GpuActivityKind::kKernel, demangle(k->name));
        a.grid[0] = k->gridX, a.grid[1] = k->gridY, a.grid[2] = k->gridZ;
        a.block[0] = k->blockX, a.block[1] = k->blockY, a.block[2] = k->blockZ;
        a.registers_per_thread = k->registersPerThread;
        a.shared_memory = k->staticSharedMemory + k->dynamicSharedMemory;
        trace_.activities.push_back(a);
        return;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        GpuActivityRecord a = device_activity(
            *m, GpuActivityKind::kMemcpy,
            fmt::format("Memcpy {} ({} -> {})", copy_kind_name(m->copyKind),
                        memory_kind_name(m->srcKind), memory_kind_name(m->dstKind)));
        a.bytes = m->bytes;
        trace_.activities.push_back(a);
        return;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        GpuActivityRecord a = device_activity(
            *m, GpuActivityKind::kMemset,
            fmt::format("Memset ({})", memory_kind_name(static_cast<uint8_t>(m->memoryKind))));
        a.bytes = m->bytes;
        trace_.activities.push_back(a);
        return;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* api = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        ApiCallRecord c;
        c.driver = record->kind == CUPTI_ACTIVITY_KIND_DRIVER;
        c.cbid = static_cast<uint32_t>(api->cbid);
        c.name = api_name(c.driver, c.cbid);
        c.start_ns = static_cast<int64_t>(api->start);
        c.end_ns = static_cast<int64_t>(api->end);
        c.process = api->processId;
        c.thread = api->threadId;
        c.correlation = api->correlationId;
        trace_.api_calls.push_back(c);
        return;
      }
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        const auto* x = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
        if (x->externalKind == kExternalKind) trace_.external_ids[x->correlationId] = x->externalId;
        return;
      }
      default:
        return;
    }
  }

  void note_failure(const char* call, CUptiResult r) {
    std::lock_guard<std::mutex> lock(mu_);
    if (push_failures_++ == 0) first_failure_ = cupti_message(call, r);
  }

  // Disables the kinds enabled so far, in reverse order.
  void disable_enabled(std::vector<std::string>* warnings = nullptr) {
    while (!enabled_.empty()) {
      const CUpti_ActivityKind kind = enabled_.back();
      enabled_.pop_back();
      const CUptiResult r = cuptiActivityDisable(kind);
      if (r != CUPTI_SUCCESS && warnings != nullptr)
        warnings->push_back(
            cupti_message(fmt::format("cuptiActivityDisable({})", kind_name(kind)).c_str(), r));
    }
  }

  bool recording_ = false;
  std::vector<CUpti_ActivityKind> enabled_;  // in enabling order
  std::mutex mu_;  // guards trace_ and the name caches (buffers arrive on CUPTI's thread)
  GpuTrace trace_;
  std::unordered_map<std::string, uint32_t> names_;
  std::unordered_map<uint64_t, uint32_t> api_names_;
  uint64_t push_failures_ = 0;
  std::string first_failure_;
};

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t /*size*/,
                               size_t valid) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_recording != nullptr && buffer != nullptr) {
      g_recording->consume(buffer, valid);
      size_t dropped = 0;
      if (cuptiActivityGetNumDroppedRecords(context, stream, &dropped) == CUPTI_SUCCESS &&
          dropped > 0)
        g_recording->add_dropped(dropped);
    }
  }
  std::free(buffer);
}

}  // namespace

}  // namespace tessera::profiler

namespace tessera::cuda {

std::unique_ptr<profiler::GpuTracer> make_cupti_tracer(int /*device*/) {
  return std::make_unique<profiler::CuptiTracer>();
}

}  // namespace tessera::cuda
