// The NCCL communicator (compiled into tessera_cuda when NCCL is found).
// Non-blocking NCCL (ncclCommInitRankConfig, blocking = 0) lets a watchdog thread abort a
// communicator whose collective never finishes; NCCL's blocking mode would leave the
// process stuck inside NCCL with nobody to say which collective or rank hung. Communicators
// split from it (ncclCommSplit, NCCL 2.18) are non-blocking too, with their own Lane::Comm
// stream and watchdog, so a hang in a tensor- or pipeline-parallel group is named like one in
// the world.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "tessera/backend/cuda/cuda_backend.h"
#include "tessera/backend/cuda/nccl_communicator.h"
#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/rendezvous.h"
#include "tessera/obs/logger.h"
#include "tessera/ops/backend.h"
#include "tessera/ops/op_observer.h"

namespace tessera::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::string version_text(int v) {
  // ncclGetVersion encodes major*10000 + minor*100 + patch since NCCL 2.9.
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

ncclDataType_t nccl_type(DType t, bool reducing, const char* op) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U8:
      return ncclUint8;
    case DType::E4M3:
    case DType::E5M2:
      // Moved as bytes; a sum of fp8 values over ranks would lose everything anyway.
      if (!reducing) return ncclUint8;
      break;
    case DType::U16:  // the master's low halves stay with the rank that updates them
      break;
  }
  throw InternalError(fmt::format("{}: dtype {} cannot be reduced by NCCL", op, dtype_name(t)));
}

std::string bytes_text(size_t bytes) {
  if (bytes >= (1u << 20)) return fmt::format("{:.1f} MiB", bytes / 1048576.0);
  if (bytes >= 1024) return fmt::format("{:.1f} KiB", bytes / 1024.0);
  return fmt::format("{} B", bytes);
}

// "send to rank 1", "send_recv (send to rank 1, recv from rank 3)": peers are ranks of the
// communicator.
std::string p2p_text(std::span<const P2POp> ops) {
  std::string list;
  for (const P2POp& op : ops)
    list += fmt::format("{}{}", list.empty() ? "" : ", ",
                        op.kind == P2POp::Kind::Send ? fmt::format("send to rank {}", op.peer)
                                                     : fmt::format("recv from rank {}", op.peer));
  return ops.size() == 1 ? list : fmt::format("send_recv ({})", list);
}

// PyTorch's op names for collectives ("nccl:all_reduce"), as string literals.
const char* collective_op_name(std::string_view kind) {
  if (kind == "all_reduce") return "nccl:all_reduce";
  if (kind == "reduce_scatter") return "nccl:reduce_scatter";
  if (kind == "all_gather") return "nccl:all_gather";
  if (kind == "broadcast") return "nccl:broadcast";
  if (kind == "all_to_all") return "nccl:all_to_all";
  return "nccl:send_recv";
}

// A process group's name with the static storage a trace argument needs: "world", or a split
// group's label with its smallest world rank ("tp:2"), which names one group among its kind.
std::string_view interned_group_name(const std::string& name) {
  static std::mutex mu;
  static std::set<std::string> names;
  std::lock_guard lock(mu);
  return *names.insert(name).first;
}

// While a profiler observes the backend, one collective is an op with PyTorch's
// record_param_comms arguments. Its NCCL kernels then carry the kind, group, size and sequence
// number in the trace, and `report --ranks` matches each occurrence across its group's ranks.
class ObservedCollective {
 public:
  ObservedCollective(const Backend& backend, const char* op, const char* kind,
                     std::string_view group, int group_size, uint64_t seq, size_t bytes,
                     DType dtype)
      : observer_(backend.op_observer()) {
    if (!observer_) return;
    OpArgs args;
    args.add_string("collective", kind)
        .add_string("process_group", group)
        .add("group_size", group_size)
        .add("seq", static_cast<int64_t>(seq))
        .add("bytes", static_cast<int64_t>(bytes))
        .add_dtype("dtype", dtype);
    observer_->op_begin(op, args);
  }
  ~ObservedCollective() {
    if (observer_) observer_->op_end();
  }
  ObservedCollective(const ObservedCollective&) = delete;
  ObservedCollective& operator=(const ObservedCollective&) = delete;

 private:
  OpObserver* observer_;
};

// Set by the first thread that ends the process over a failed rank or collective. Errors
// that the abort causes on other threads are its echo: those threads wait for the exit
// instead of unwinding (and exiting) while the abort is still running.
std::atomic<bool> g_failing{false};

[[noreturn]] void wait_for_exit() {
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// NCCL names a dead peer only by its socket address; the rendezvous names its rank, a few
// hundred milliseconds later (rank 0 polls the peers' connections, then tells the others). A
// peer's error therefore waits up to this long for the rendezvous to end the process with the
// rank's name before ending it with NCCL's words.
constexpr auto kLostRankGrace = std::chrono::milliseconds(1500);

bool is_peer_failure(ncclResult_t r) {
  return r == ncclRemoteError || r == ncclSystemError;
}

// Returns only if no other thread began ending the process within kLostRankGrace.
void await_lost_rank_report() {
  const auto until = std::chrono::steady_clock::now() + kLostRankGrace;
  while (std::chrono::steady_clock::now() < until) {
    if (g_failing) wait_for_exit();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// TS_CUDA_CHECK for the communicator's own CUDA calls, with two differences: a failure while
// another thread ends the process over a failed collective is that failure's echo (wait for
// the exit), and a failure is a DistributedError, which names the communicator's operation.
void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  if (g_failing) wait_for_exit();
  throw DistributedError(fmt::format("{}: CUDA error {}", what, cudaGetErrorString(e)));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Backend& backend, Rendezvous& rendezvous, double timeout_s, Logger& log)
      : backend_(backend),
        compute_stream_(static_cast<cudaStream_t>(backend.stream().native)),
        device_(backend.device().index),
        rank_(rendezvous.rank()),
        size_(rendezvous.world_size()),
        timeout_s_(timeout_s),
        log_(log),
        group_name_(interned_group_name("world")) {
    ncclGetVersion(&version_code_);
    const int version = version_code_;
    version_ = version_text(version);
    log_.info("NCCL {} (runtime; built against {}.{}.{})", version_, NCCL_MAJOR, NCCL_MINOR,
              NCCL_PATCH);
    if (version < NCCL_VERSION(2, 19, 0))
      throw DistributedError(
          fmt::format("NCCL {} is too old: Tessera needs 2.19 or newer "
                      "(non-blocking communicators with ncclCommGetAsyncError)",
                      version_));
    create_streams();

    ncclUniqueId id{};
    if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
    const std::string blob = rendezvous.broadcast(
        rank_ == 0 ? std::string(reinterpret_cast<const char*>(&id), sizeof id) : std::string());
    if (blob.size() != sizeof id)
      throw DistributedError(
          fmt::format("rank {}: the NCCL unique id from rank 0 has {} bytes, not {}", rank_,
                      blob.size(), sizeof id));
    std::memcpy(&id, blob.data(), sizeof id);

    // The peers' sockets name a rank that dies; the watchdog names a collective that hangs.
    rendezvous.watch([this](int, const std::string& message) {
      fail(fmt::format("{}; aborting the NCCL communicator", message));
    });
    watchdog_ = std::thread([this] { watchdog_loop(); });

    ncclConfig_t config = communicator_config();
    const auto t0 = Clock::now();
    begin("ncclCommInitRankConfig", 0);
    ncclComm_t comm = nullptr;
    const ncclResult_t init = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
    comm_ = comm;
    windows_->comm = comm;
    check(init, "ncclCommInitRankConfig", 0);
    end_host_call();
    log_.info("NCCL communicator: rank {} of {} on GPU {} in {:.2f} s", rank_, size_, device_,
              std::chrono::duration<double>(Clock::now() - t0).count());
  }

  // A communicator split from `parent` (split()), once NCCL has made `comm`.
  NcclCommunicator(const NcclCommunicator& parent, ncclComm_t comm, const std::string& label,
                   int color)
      : backend_(parent.backend_),
        compute_stream_(parent.compute_stream_),
        device_(parent.device_),
        rank_(-1),
        size_(0),
        timeout_s_(parent.timeout_s_),
        log_(parent.log_),
        version_(parent.version_),
        version_code_(parent.version_code_),
        label_(label),
        group_name_(interned_group_name(fmt::format("{}:{}", label, color))),
        world_rank_(parent.world_rank()),
        comm_(comm) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm, &state);
    check(state, "ncclCommSplit", 0);
    check(ncclCommUserRank(comm, &rank_), "ncclCommUserRank", 0);
    check(ncclCommCount(comm, &size_), "ncclCommCount", 0);
    windows_->comm = comm;
    create_streams();
    watchdog_ = std::thread([this] { watchdog_loop(); });
    log_.info("NCCL {} communicator: rank {} of {}", label_, rank_, size_);
  }

  ~NcclCommunicator() override {
    stop_watchdog();
    if (comm_) {
      // An exception is unwinding (finalize() did not run): peers may be stuck in a
      // collective with us, so abort rather than a collective destroy (which takes the
      // windows with it).
      ncclCommAbort(comm_);
      forget_windows();
    }
    for (auto& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    if (compute_ready_) cudaEventDestroy(compute_ready_);
    if (comm_done_) cudaEventDestroy(comm_done_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string description() const override {
    return fmt::format("NCCL {}, {}{} ranks, non-blocking, timeout {:.0f} s", version_,
                       label_.empty() ? "" : label_ + " group of ", size_, timeout_s_);
  }

  void all_reduce(const Tensor& buffer, ReduceOp op, Lane lane) override {
    const size_t bytes = buffer.nbytes();
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed = observe("all_reduce", bytes, buffer.dtype);
    begin("all_reduce", bytes);
    const NcclCallGuard guard(*this);
    check(ncclAllReduce(buffer.data, buffer.data, static_cast<size_t>(buffer.numel()),
                        nccl_type(buffer.dtype, true, "all_reduce"),
                        op == ReduceOp::Sum ? ncclSum : ncclMax, comm_, s),
          "all_reduce", bytes);
    enqueued("all_reduce", bytes, s);
  }

  void reduce_scatter(const Tensor& out, const Tensor& in, Lane lane) override {
    TS_CHECK(in.numel() == out.numel() * size_ && in.dtype == out.dtype,
             "reduce_scatter: in {} must hold {} x out {}", in.shape.str(), size_, out.shape.str());
    const size_t bytes = in.nbytes();
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed = observe("reduce_scatter", bytes, in.dtype);
    begin("reduce_scatter", bytes);
    const NcclCallGuard guard(*this);
    check(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()),
                            nccl_type(in.dtype, true, "reduce_scatter"), ncclSum, comm_, s),
          "reduce_scatter", bytes);
    enqueued("reduce_scatter", bytes, s);
  }

  void all_gather(const Tensor& out, const Tensor& in, Lane lane) override {
    TS_CHECK(out.numel() == in.numel() * size_ && in.dtype == out.dtype,
             "all_gather: out {} must hold {} x in {}", out.shape.str(), size_, in.shape.str());
    const size_t bytes = out.nbytes();
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed = observe("all_gather", bytes, in.dtype);
    begin("all_gather", bytes);
    const NcclCallGuard guard(*this);
    check(ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()),
                        nccl_type(in.dtype, false, "all_gather"), comm_, s),
          "all_gather", bytes);
    enqueued("all_gather", bytes, s);
  }

  void broadcast(const Tensor& buffer, int root, Lane lane) override {
    const size_t bytes = buffer.nbytes();
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed = observe("broadcast", bytes, buffer.dtype);
    begin("broadcast", bytes);
    const NcclCallGuard guard(*this);
    check(ncclBroadcast(buffer.data, buffer.data, static_cast<size_t>(buffer.numel()),
                        nccl_type(buffer.dtype, false, "broadcast"), root, comm_, s),
          "broadcast", bytes);
    enqueued("broadcast", bytes, s);
  }

  void all_to_all(const Tensor& out, const Tensor& in, Lane lane) override {
    TS_CHECK(out.numel() == in.numel() && in.dtype == out.dtype && in.numel() % size_ == 0,
             "all_to_all: in {} and out {} must be equal multiples of {}", in.shape.str(),
             out.shape.str(), size_);
    const size_t bytes = in.nbytes();
    const size_t block = static_cast<size_t>(in.numel() / size_);
    const size_t block_bytes = bytes / size_;
    const ncclDataType_t t = nccl_type(in.dtype, false, "all_to_all");
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed = observe("all_to_all", bytes, in.dtype);
    begin("all_to_all", bytes);
    const NcclCallGuard guard(*this);  // over the whole group
    check(ncclGroupStart(), "all_to_all (ncclGroupStart)", bytes);
    for (int r = 0; r < size_; ++r) {
      check(ncclSend(static_cast<const char*>(in.data) + r * block_bytes, block, t, r, comm_, s),
            "all_to_all (ncclSend)", bytes);
      check(ncclRecv(static_cast<char*>(out.data) + r * block_bytes, block, t, r, comm_, s),
            "all_to_all (ncclRecv)", bytes);
    }
    check(ncclGroupEnd(), "all_to_all (ncclGroupEnd)", bytes);
    enqueued("all_to_all", bytes, s);
  }

  void send_recv(std::span<const P2POp> ops, Lane lane) override {
    size_t bytes = 0;
    for (const P2POp& op : ops) {
      TS_CHECK(op.peer >= 0 && op.peer < size_, "send_recv: peer {} of {} ranks", op.peer, size_);
      bytes += op.tensor.nbytes();
    }
    const std::string what = p2p_text(ops);
    cudaStream_t s = stream_for(lane);
    const ObservedCollective observed =
        observe("send_recv", bytes, ops.empty() ? DType::U8 : ops.front().tensor.dtype);
    begin(what, bytes);
    // One group: NCCL progresses all of them together, so opposite sends do not deadlock.
    const NcclCallGuard guard(*this);  // over the whole group
    check(ncclGroupStart(), what + " (ncclGroupStart)", bytes);
    for (const P2POp& op : ops) {
      const Tensor& t = op.tensor;
      const ncclDataType_t type = nccl_type(t.dtype, false, "send_recv");
      const size_t count = static_cast<size_t>(t.numel());
      check(op.kind == P2POp::Kind::Send ? ncclSend(t.data, count, type, op.peer, comm_, s)
                                         : ncclRecv(t.data, count, type, op.peer, comm_, s),
            what, bytes);
    }
    check(ncclGroupEnd(), what + " (ncclGroupEnd)", bytes);
    enqueued(what, bytes, s);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override {
    ncclConfig_t config = communicator_config();
    ncclComm_t child = nullptr;
    begin("ncclCommSplit", 0);
    const NcclCallGuard guard(*this);
    const ncclResult_t r =
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
    // The split runs in the background as a job of this (the parent) communicator, which stays
    // "in progress" until it ends, and NCCL stores `child` only then. Whatever the call
    // answered, poll the parent until the job is over (polling also completes it), then wait
    // for `child` to appear: seen on H200s, returning on the call's answer alone left `child`
    // null and the parent busy for the next split.
    check(r == ncclSuccess ? ncclInProgress : r, "ncclCommSplit", 0);
    if (color >= 0) {
      const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
      while (std::atomic_ref<ncclComm_t>(child).load(std::memory_order_acquire) == nullptr) {
        if (Clock::now() > deadline)
          throw DistributedError(
              fmt::format("{}: NCCL ncclCommSplit ({}) made no communicator within {:.0f} s",
                          where(), label, timeout_s_));
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    end_host_call();
    if (!child) return nullptr;
    return std::unique_ptr<Communicator>(new NcclCommunicator(*this, child, label, color));
  }

  // NCCL's VMM memory, registered as a symmetric window of this communicator: an all-gather
  // between two such windows runs on the copy engines under NCCL_CTA_POLICY_ZERO (NCCL 2.28,
  // one node). Without symmetric memory support the registration gives no window and the
  // memory serves as ordinary memory.
  CollectiveBuffer collective_buffer(Backend& backend, size_t bytes, const char* what) override {
    void* ptr = nullptr;
    if (bytes == 0 || version_code_ < NCCL_VERSION(2, 28, 0) ||
        ncclMemAlloc(&ptr, bytes) != ncclSuccess)
      // Out of memory included: the backend's allocation then says so by name.
      return Communicator::collective_buffer(backend, bytes, what);
    ncclWindow_t window = nullptr;
    begin("ncclCommWindowRegister", bytes);
    {
      const NcclCallGuard guard(*this);
      // As with a split, the registration is a background job that NCCL completes (and
      // writes `window`) only when polled, whatever the call answered.
      const ncclResult_t r =
          ncclCommWindowRegister(comm_, ptr, bytes, &window, NCCL_WIN_COLL_SYMMETRIC);
      check(r == ncclSuccess ? ncclInProgress : r, fmt::format("ncclCommWindowRegister ({})", what),
            bytes);
    }
    end_host_call();
    if (window) {
      std::lock_guard lock(windows_->mu);
      windows_->open.push_back({ptr, window});
    }
    log_.info("{}: {} in NCCL memory ({}){}", where(), what, bytes_text(bytes),
              window ? ", a symmetric window: all-gathers between such windows use the copy "
                       "engines"
                     : "; NCCL has no symmetric memory here");
    cuda::count_foreign_allocation(backend, ptr, bytes);
    return {ptr, bytes, backend.device(), [&backend, windows = windows_](void* p) {
              cudaDeviceSynchronize();  // no collective or kernel still reads or writes it
              windows->close(p);
              cuda::uncount_foreign_allocation(backend, p);
              ncclMemFree(p);
            }};
  }

  void wait_comm() override {
    cuda_check(cudaEventRecord(comm_done_, comm_stream_), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(compute_stream_, comm_done_, 0), "cudaStreamWaitEvent");
    comm_queued_ = false;
    marks_used_ = 0;
  }

  int comm_mark() override {
    if (marks_used_ == marks_.size()) {
      cudaEvent_t e = nullptr;
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      marks_.push_back(e);
    }
    cuda_check(cudaEventRecord(marks_[marks_used_], comm_stream_), "cudaEventRecord");
    return static_cast<int>(marks_used_++);
  }

  void wait_comm_mark(int mark) override {
    TS_CHECK(mark >= 0 && static_cast<size_t>(mark) < marks_used_,
             "wait_comm_mark: mark {} is not one of the {} taken since the last wait_comm()", mark,
             marks_used_);
    cuda_check(cudaStreamWaitEvent(compute_stream_, marks_[mark], 0), "cudaStreamWaitEvent");
  }

  void synchronize() override {
    // Polling keeps this thread out of a blocking CUDA wait the watchdog could not end.
    while (true) {
      {
        std::lock_guard lock(mu_);
        if (pending_.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    cuda_check(cudaStreamSynchronize(comm_stream_), "cudaStreamSynchronize");
  }

  void finalize() override {
    if (!comm_) return;
    synchronize();
    close_windows();
    begin("ncclCommFinalize", 0);
    check(ncclCommFinalize(comm_), "ncclCommFinalize", 0);
    end_host_call();
    stop_watchdog();
    ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

 private:
  struct Pending {
    cudaEvent_t event = nullptr;  // null: a host-side call (init, split, finalize) in progress
    std::string name;
    size_t bytes;
    uint64_t seq;
    Clock::time_point start;
  };

  // Blocking off for the watchdog (see the top of the file); zero CTAs for the collectives
  // NCCL can run on the copy engines (all-gathers between symmetric windows), so that they
  // leave every SM to the compute they overlap. Others run on SMs as by default.
  static ncclConfig_t communicator_config() {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    return config;
  }

  // The symmetric windows of collective_buffer()s still alive, in registration order: every
  // rank deregisters them in that order (a collective) when a buffer goes or at finalize().
  // Shared with the buffers' release, which may run after the communicator is gone.
  struct Windows {
    std::mutex mu;
    ncclComm_t comm = nullptr;  // null once finalized or aborted: nothing left to deregister
    std::vector<std::pair<void*, ncclWindow_t>> open;
    void close(void* ptr) {
      std::lock_guard lock(mu);
      for (auto it = open.begin(); it != open.end(); ++it)
        if (it->first == ptr) {
          if (comm && !g_failing) ncclCommWindowDeregister(comm, it->second);
          open.erase(it);
          return;
        }
    }
  };
  void close_windows() {
    std::lock_guard lock(windows_->mu);
    for (const auto& [ptr, window] : windows_->open) ncclCommWindowDeregister(comm_, window);
    windows_->open.clear();
    windows_->comm = nullptr;
  }
  void forget_windows() {
    std::lock_guard lock(windows_->mu);
    windows_->open.clear();
    windows_->comm = nullptr;
  }

  void create_streams() {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    int lo = 0, hi = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lo, &hi), "cudaDeviceGetStreamPriorityRange");
    // The gradient reduction should not queue behind the backward's kernels.
    cuda_check(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, hi),
               "cudaStreamCreate");
    cuda_check(cudaEventCreateWithFlags(&compute_ready_, cudaEventDisableTiming),
               "cudaEventCreate");
    cuda_check(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming), "cudaEventCreate");
  }

  int world_rank() const { return label_.empty() ? rank_ : world_rank_; }
  // "rank 3" for the world, "rank 3 (tp rank 1 of 2)" for a split communicator: the rank the
  // logs use, and the rank that the operation's peers and roots refer to.
  std::string where() const {
    return label_.empty()
               ? fmt::format("rank {}", rank_)
               : fmt::format("rank {} ({} rank {} of {})", world_rank_, label_, rank_, size_);
  }

  cudaStream_t stream_for(Lane lane) {
    if (lane == Lane::Compute) {
      if (comm_queued_) wait_comm();
      return compute_stream_;
    }
    comm_queued_ = true;
    cuda_check(cudaEventRecord(compute_ready_, compute_stream_), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(comm_stream_, compute_ready_, 0), "cudaStreamWaitEvent");
    return comm_stream_;
  }

  // The profiler's view of the collective enqueued next (its sequence number is seq_).
  ObservedCollective observe(const char* kind, size_t bytes, DType dtype) const {
    return ObservedCollective(backend_, collective_op_name(kind), kind, group_name_, size_, seq_,
                              bytes, dtype);
  }

  // Watches a host call into NCCL (the watchdog times it like a collective).
  void begin(const std::string& name, size_t bytes) {
    std::lock_guard lock(mu_);
    host_call_ = Pending{nullptr, name, bytes, seq_, Clock::now()};
    in_host_call_ = true;
  }
  void end_host_call() {
    std::lock_guard lock(mu_);
    in_host_call_ = false;
  }

  void enqueued(const std::string& name, size_t bytes, cudaStream_t s) {
    cudaEvent_t ev = nullptr;
    {
      std::lock_guard lock(mu_);
      in_host_call_ = false;
      if (!spare_events_.empty()) {
        ev = spare_events_.back();
        spare_events_.pop_back();
      }
    }
    if (!ev) cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ev, s), "cudaEventRecord");
    std::lock_guard lock(mu_);
    pending_.push_back(Pending{ev, name, bytes, seq_++, Clock::now()});
  }

  // A non-blocking communicator answers ncclInProgress while it works in the background;
  // the call is complete once ncclCommGetAsyncError says so.
  void check(ncclResult_t r, const std::string& what, size_t bytes) {
    while (r == ncclInProgress && comm_) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const NcclCallGuard guard(*this);
      ncclCommGetAsyncError(comm_, &r);
    }
    if (r == ncclSuccess || r == ncclInProgress) return;
    if (g_failing) wait_for_exit();
    if (is_peer_failure(r)) await_lost_rank_report();
    const NcclCallGuard guard(*this);
    const char* last = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
    throw DistributedError(
        fmt::format("{}: NCCL {} of {} failed: {} ({}){}", where(), what, bytes_text(bytes),
                    ncclGetErrorString(r), last && *last ? last : "no detail",
                    r == ncclSystemError || r == ncclRemoteError
                        ? "; a peer or the network failed (set NCCL_DEBUG=INFO for details)"
                        : ""));
  }

  void watchdog_loop() {
    cudaSetDevice(device_);
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (stop_) break;
      while (!pending_.empty() && cudaEventQuery(pending_.front().event) == cudaSuccess) {
        spare_events_.push_back(pending_.front().event);
        pending_.pop_front();
      }
      // During a host call the calling thread polls ncclCommGetAsyncError itself (check());
      // two threads polling at once could both complete NCCL's background job (init, split),
      // which NCCL does not guard against.
      if (comm_ && !in_host_call_) {
        ncclResult_t async = ncclSuccess;
        std::string last;
        {
          const NcclCallGuard guard(*this);
          ncclCommGetAsyncError(comm_, &async);
          if (async != ncclSuccess && async != ncclInProgress && ncclGetLastError(comm_))
            last = ncclGetLastError(comm_);
        }
        if (async != ncclSuccess && async != ncclInProgress) {
          const std::string what =
              pending_.empty()
                  ? std::string("a collective")
                  : fmt::format("{} #{} of {}", pending_.front().name, pending_.front().seq,
                                bytes_text(pending_.front().bytes));
          lock.unlock();
          if (is_peer_failure(async)) await_lost_rank_report();
          fail(fmt::format("NCCL reported an error during {}: {} ({})", what,
                           ncclGetErrorString(async), last.empty() ? "no detail" : last));
        }
      }
      const Pending* late = in_host_call_      ? &host_call_
                            : pending_.empty() ? nullptr
                                               : &pending_.front();
      if (!late) continue;
      const double waited = std::chrono::duration<double>(Clock::now() - late->start).count();
      if (waited < timeout_s_) continue;
      const std::string msg = fmt::format(
          "{} #{} of {} on {} did not finish within {:.0f} s (dist_timeout_minutes): another "
          "rank is late, hung or died without closing its connection; aborting the NCCL "
          "communicator",
          late->name, late->seq, bytes_text(late->bytes), where(), waited);
      lock.unlock();
      fail(msg);
    }
  }

  // Ends the process from any thread: the main thread may be blocked on the device.
  [[noreturn]] void fail(const std::string& message) {
    if (g_failing.exchange(true)) wait_for_exit();
    log_.clear_progress();
    log_.error("{}: {}", where(), message);
    log_.flush();
    std::fprintf(stderr, "error: %s: %s\n", where().c_str(), message.c_str());
    std::fflush(stderr);
    // Threads still polling the communicator see g_failing at their next poll; aborting
    // (which frees it) under a poll would crash the process instead of ending it.
    for (int i = 0; i < 100 && polling_ > 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    // ncclCommAbort can itself wait on a wedged device; never let it keep the process alive.
    std::atomic<bool> aborted{false};
    ncclComm_t comm = comm_;
    std::thread([comm, &aborted] {
      if (comm) ncclCommAbort(comm);
      aborted = true;
    }).detach();
    for (int i = 0; i < 100 && !aborted; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::_Exit(kExitRuntimeFailure);
  }

  void stop_watchdog() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  const Backend& backend_;       // whose profiler observer sees the collectives
  cudaStream_t compute_stream_;  // the backend's: Lane::Compute collectives queue there
  int device_, rank_, size_;
  double timeout_s_;
  Logger& log_;
  std::string version_;
  int version_code_ = 0;         // ncclGetVersion's
  std::string label_;            // the group, for a split communicator ("tp"); empty for the world
  std::string_view group_name_;  // the group in traces: "world", "tp:2"
  int world_rank_ = -1;          // a split communicator's rank in the world, for messages
  std::atomic<ncclComm_t> comm_{nullptr};  // read by the watchdog thread
  std::shared_ptr<Windows> windows_ = std::make_shared<Windows>();
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t compute_ready_ = nullptr, comm_done_ = nullptr;
  bool comm_queued_ = false;        // Lane::Comm work compute has not waited for
  std::vector<cudaEvent_t> marks_;  // comm_mark()'s events, reused after each wait_comm()
  size_t marks_used_ = 0;

  // Threads inside an NCCL call on comm_ (a collective's enqueue, a group, a poll of
  // ncclCommGetAsyncError or ncclGetLastError): fail() lets them leave before it aborts the
  // communicator, whose memory the abort frees. A caller that arrives after g_failing was set
  // waits for the exit instead (seq_cst on both sides: one of the two always sees the other).
  std::atomic<int> polling_{0};
  struct NcclCallGuard {
    explicit NcclCallGuard(NcclCommunicator& c) : c_(c) {
      ++c_.polling_;
      if (g_failing) {
        --c_.polling_;
        wait_for_exit();
      }
    }
    ~NcclCallGuard() { --c_.polling_; }
    NcclCallGuard(const NcclCallGuard&) = delete;
    NcclCallGuard& operator=(const NcclCallGuard&) = delete;
    NcclCommunicator& c_;
  };

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_events_;
  Pending host_call_{};
  bool in_host_call_ = false;
  bool stop_ = false;
  uint64_t seq_ = 0;
  std::thread watchdog_;
};

}  // namespace
}  // namespace tessera::dist

namespace tessera::cuda {

std::unique_ptr<dist::Communicator> make_nccl_communicator(Backend& backend,
                                                           dist::Rendezvous& rendezvous,
                                                           double timeout_s, Logger& log) {
  // The platform makes a communicator only over its own backends; a GPU backend's stream is
  // then a cudaStream_t.
  if (backend.device().kind != DeviceKind::GPU || backend.name() != "cuda")
    throw ConfigError("command line", "device", device_name(backend.device()),
                      "cuda: distributed training runs on NCCL, one GPU per rank");
  return std::make_unique<dist::NcclCommunicator>(backend, rendezvous, timeout_s, log);
}

}  // namespace tessera::cuda
