#include "tessera/distributed/local_communicator.h"

#include <cblas.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
namespace {

std::string tensor_text(const Tensor& t) {
  return fmt::format("{} B ({})", t.nbytes(), dtype_name(t.dtype));
}

void expect_host(const Tensor& t, const char* op) {
  TS_CHECK(t.device.kind == DeviceKind::CPU, "{}: the local communicator moves host memory, not {}",
           op, device_name(t.device));
}

void expect_reducible(const Tensor& t, const char* op) {
  TS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16,
           "{}: the local communicator reduces fp32 and bf16 only, not {}", op,
           dtype_name(t.dtype));
}

// Element i of a rank's reduction input (fp32 or bf16), as fp32.
float element(const std::byte* data, DType dtype, int64_t i) {
  if (dtype == DType::F32) return reinterpret_cast<const float*>(data)[i];
  return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(data)[i]);
}

// ranks' inputs reduced in rank order in fp32, elements [first, first + n) into out (bf16
// rounded once at the end, as the sum of fp32 values NCCL's kernels add would be).
void reduce_into(const Tensor& out, std::span<const std::vector<std::byte>> ins, DType dtype,
                 int64_t first, int64_t n, ReduceOp op) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = element(ins[0].data(), dtype, first + i);
    for (size_t r = 1; r < ins.size(); ++r) {
      const float x = element(ins[r].data(), dtype, first + i);
      acc = op == ReduceOp::Sum ? acc + x : std::max(acc, x);
    }
    if (dtype == DType::F32)
      out.as<float>()[i] = acc;
    else
      out.as<uint16_t>()[i] = float_to_bf16_bits(acc);
  }
}

}  // namespace

struct LocalCommunicator::Job {
  // What a blocked rank waits for; ready() is read by other ranks under the lock.
  struct Waiter {
    std::string what;
    std::function<bool()> ready;
  };

  explicit Job(int world) : world(world), live(world), waiting(world, nullptr) {}

  bool failed() const { return cause != nullptr; }

  // The first failure becomes the run's; every waiting rank is released.
  void fail(std::exception_ptr e) {
    if (!cause) cause = std::move(e);
    cv.notify_all();
  }

  // On the ranks that another's failure released: a consequence, never the run's cause.
  void throw_if_failed(int rank) const {
    if (failed())
      throw DistributedError(fmt::format("rank {}: released: another rank failed", rank));
  }

  // Blocks global rank `rank` until ready() (evaluated under the lock `lock` holds).
  void wait(std::unique_lock<std::mutex>& lock, int rank, std::string what,
            std::function<bool()> ready) {
    throw_if_failed(rank);
    if (ready()) return;
    Waiter w{std::move(what), std::move(ready)};
    waiting[rank] = &w;
    detect_deadlock();
    cv.wait(lock, [&] { return failed() || w.ready(); });
    waiting[rank] = nullptr;
    if (!w.ready()) throw_if_failed(rank);
  }

  // A rank whose body returned can no longer satisfy anyone.
  void finish() {
    --live;
    detect_deadlock();
  }

  // Only ranks change the state, so when every live rank waits and none is ready, none will
  // ever be: fail the run naming what each waits for instead of hanging the test.
  void detect_deadlock() {
    int blocked = 0;
    for (const Waiter* w : waiting) {
      if (!w) continue;
      if (w->ready()) return;
      ++blocked;
    }
    if (failed() || blocked == 0 || blocked < live) return;
    std::string message = "deadlock: every rank that has not returned waits and none can go on";
    for (int r = 0; r < world; ++r)
      if (waiting[r]) message += fmt::format("; rank {} waits in {}", r, waiting[r]->what);
    if (live < world) message += fmt::format(" ({} ranks have returned)", world - live);
    fail(std::make_exception_ptr(DistributedError(message)));
  }

  const int world;
  std::mutex mutex;
  std::condition_variable cv;
  int live;                            // ranks whose body has not returned
  std::vector<const Waiter*> waiting;  // by global rank; null while it runs
  std::exception_ptr cause;            // the first failure
};

struct LocalCommunicator::Call {
  const char* name = "";
  size_t bytes = 0;
  DType dtype = DType::F32;
  int root = 0;
  int color = 0, key = 0;  // split's arguments, which may differ between members

  bool same_as(const Call& o) const {
    return std::strcmp(name, o.name) == 0 && bytes == o.bytes && dtype == o.dtype && root == o.root;
  }
  std::string text() const {
    if (std::strcmp(name, "split") == 0) return name;
    return fmt::format("{} of {} B ({}){}", name, bytes, dtype_name(dtype),
                       std::strcmp(name, "broadcast") == 0 ? fmt::format(" from {}", root) : "");
  }
};

struct LocalCommunicator::Group {
  // One posted send or receive; the later of a matching pair moves the bytes.
  struct Transfer {
    const P2POp* op;
    bool done = false;
  };

  Group(std::shared_ptr<Job> job, std::vector<int> members, std::string label)
      : job(std::move(job)),
        members(std::move(members)),
        label(std::move(label)),
        calls(size()),
        inputs(size()),
        split_result(size()) {}

  int size() const { return static_cast<int>(members.size()); }

  std::shared_ptr<Job> job;
  const std::vector<int> members;  // global ranks, by rank in the group
  const std::string label;

  // Collectives: every member's current call and input, and a barrier.
  std::vector<Call> calls;
  std::vector<Bytes> inputs;
  int arrived = 0;
  int64_t generation = 0;  // barriers completed
  // split()'s result for each member: its new group (null: none) and rank in it.
  std::vector<std::pair<std::shared_ptr<Group>, int>> split_result;

  // Point-to-point: posted, unmatched transfers, in order, by (from, to).
  std::map<std::pair<int, int>, std::deque<Transfer*>> sends, recvs;
};

LocalCommunicator::LocalCommunicator(std::shared_ptr<Group> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

int LocalCommunicator::size() const {
  return group_->size();
}
int LocalCommunicator::global_rank() const {
  return group_->members[rank_];
}
std::string LocalCommunicator::where() const {
  return fmt::format("{} rank {} of {}", group_->label, rank_, size());
}
std::string LocalCommunicator::description() const {
  return "local threads, " + where();
}

void LocalCommunicator::arrive(std::unique_lock<std::mutex>& lock, const Call& call,
                               const std::function<void()>& on_last) {
  Group& g = *group_;
  Job& job = *g.job;
  job.throw_if_failed(global_rank());
  g.calls[rank_] = call;
  const int64_t generation = g.generation;
  if (++g.arrived < size()) {
    job.wait(lock, global_rank(), fmt::format("{} on {}", call.text(), where()),
             [&] { return g.generation != generation; });
    return;
  }
  g.arrived = 0;
  for (int r = 1; r < size(); ++r) {
    if (g.calls[r].same_as(g.calls[0])) continue;
    // NCCL would hang or corrupt memory here; say which calls disagree instead.
    const auto e = std::make_exception_ptr(DistributedError(
        fmt::format("mismatched collectives on {}: rank {} called {} while rank {} called {}",
                    g.label, r, g.calls[r].text(), 0, g.calls[0].text())));
    job.fail(e);
    std::rethrow_exception(e);
  }
  if (on_last) on_last();
  ++g.generation;
  job.cv.notify_all();
}

void LocalCommunicator::collective(const char* name, const Tensor& in, int root,
                                   const std::function<void(std::span<const Bytes>)>& compute) {
  expect_host(in, name);
  Group& g = *group_;
  // Only this rank touches its slot until the first barrier, and nobody reads it after the
  // second one, so the copy needs no lock.
  const auto* bytes = static_cast<const std::byte*>(in.data);
  g.inputs[rank_].assign(bytes, bytes + in.nbytes());
  const Call call{name, in.nbytes(), in.dtype, root};
  std::unique_lock lock(g.job->mutex);
  arrive(lock, call);
  lock.unlock();
  compute(g.inputs);
  lock.lock();
  arrive(lock, call);
}

void LocalCommunicator::all_reduce(const Tensor& buffer, ReduceOp op, Lane) {
  expect_reducible(buffer, "all_reduce");
  collective("all_reduce", buffer, 0, [&](std::span<const Bytes> in) {
    reduce_into(buffer, in, buffer.dtype, 0, buffer.numel(), op);
  });
}

void LocalCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, Lane) {
  expect_reducible(in, "reduce_scatter");
  TS_CHECK(in.numel() == out.numel() * size() && in.dtype == out.dtype,
           "reduce_scatter: in {} must hold {} x out {}", in.shape.str(), size(), out.shape.str());
  collective("reduce_scatter", in, 0, [&](std::span<const Bytes> ins) {
    const int64_t n = out.numel();
    reduce_into(out, ins, in.dtype, rank_ * n, n, ReduceOp::Sum);
  });
}

void LocalCommunicator::all_gather(const Tensor& out, const Tensor& in, Lane) {
  TS_CHECK(out.numel() == in.numel() * size() && in.dtype == out.dtype,
           "all_gather: out {} must hold {} x in {}", out.shape.str(), size(), in.shape.str());
  collective("all_gather", in, 0, [&](std::span<const Bytes> ins) {
    for (int r = 0; r < size(); ++r)
      std::memcpy(static_cast<std::byte*>(out.data) + r * in.nbytes(), ins[r].data(), in.nbytes());
  });
}

void LocalCommunicator::broadcast(const Tensor& buffer, int root, Lane) {
  TS_CHECK(root >= 0 && root < size(), "broadcast: root {} of {} ranks", root, size());
  collective("broadcast", buffer, root, [&](std::span<const Bytes> ins) {
    std::memcpy(buffer.data, ins[root].data(), buffer.nbytes());
  });
}

void LocalCommunicator::all_to_all(const Tensor& out, const Tensor& in, Lane) {
  TS_CHECK(out.numel() == in.numel() && in.dtype == out.dtype && in.numel() % size() == 0,
           "all_to_all: in {} and out {} must be equal multiples of {}", in.shape.str(),
           out.shape.str(), size());
  collective("all_to_all", in, 0, [&](std::span<const Bytes> ins) {
    const size_t block = in.nbytes() / size();
    for (int r = 0; r < size(); ++r)
      std::memcpy(static_cast<std::byte*>(out.data) + r * block, ins[r].data() + rank_ * block,
                  block);
  });
}

void LocalCommunicator::send_recv(std::span<const P2POp> ops, Lane) {
  Group& g = *group_;
  Job& job = *g.job;
  std::vector<Group::Transfer> mine;
  std::string what;
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    TS_CHECK(op.peer >= 0 && op.peer < size(), "{}: peer {} of {} ranks", send ? "send" : "recv",
             op.peer, size());
    expect_host(op.tensor, send ? "send" : "recv");
    mine.push_back({&op});
    what += fmt::format("{}{} {} {} {} rank {}", what.empty() ? "" : ", ", send ? "send" : "recv",
                        tensor_text(op.tensor), send ? "to" : "from", g.label, op.peer);
  }
  std::unique_lock lock(job.mutex);
  job.throw_if_failed(global_rank());
  // Posts each transfer, or completes it with the peer's matching one posted earlier.
  for (Group::Transfer& t : mine) {
    const bool send = t.op->kind == P2POp::Kind::Send;
    const std::pair<int, int> route =
        send ? std::pair(rank_, t.op->peer) : std::pair(t.op->peer, rank_);
    std::deque<Group::Transfer*>& others = (send ? g.recvs : g.sends)[route];
    if (others.empty()) {
      (send ? g.sends : g.recvs)[route].push_back(&t);
      continue;
    }
    Group::Transfer& peer = *others.front();
    others.pop_front();
    const Tensor& src = (send ? t : peer).op->tensor;
    const Tensor& dst = (send ? peer : t).op->tensor;
    if (src.nbytes() != dst.nbytes() || src.dtype != dst.dtype) {
      const auto e = std::make_exception_ptr(DistributedError(
          fmt::format("mismatched transfer on {}: rank {} sends {} to rank {}, which receives {}",
                      g.label, route.first, tensor_text(src), route.second, tensor_text(dst))));
      job.fail(e);
      std::rethrow_exception(e);
    }
    std::memmove(dst.data, src.data, src.nbytes());
    t.done = peer.done = true;
    job.cv.notify_all();
  }
  try {
    job.wait(lock, global_rank(), fmt::format("{} on {}", what, where()), [&] {
      return std::all_of(mine.begin(), mine.end(), [](const auto& t) { return t.done; });
    });
  } catch (...) {
    // The run failed: withdraw what is still posted, since `mine` is about to go.
    for (auto* queues : {&g.sends, &g.recvs})
      for (auto& [route, queue] : *queues)
        std::erase_if(queue, [&](const Group::Transfer* t) {
          return t >= mine.data() && t < mine.data() + mine.size();
        });
    throw;
  }
}

std::unique_ptr<Communicator> LocalCommunicator::split(int color, int key,
                                                       const std::string& label) {
  Group& g = *group_;
  Call call{"split"};
  call.color = color;
  call.key = key;
  std::unique_lock lock(g.job->mutex);
  arrive(lock, call, [&] {
    std::map<int, std::vector<int>> by_color;  // group ranks, ascending
    for (int r = 0; r < size(); ++r) {
      g.split_result[r] = {nullptr, -1};
      if (g.calls[r].color >= 0) by_color[g.calls[r].color].push_back(r);
    }
    for (auto& [c, ranks] : by_color) {
      std::stable_sort(ranks.begin(), ranks.end(),
                       [&](int a, int b) { return g.calls[a].key < g.calls[b].key; });
      std::vector<int> members;
      for (int r : ranks) members.push_back(g.members[r]);
      auto child = std::make_shared<Group>(g.job, std::move(members), label);
      for (size_t i = 0; i < ranks.size(); ++i)
        g.split_result[ranks[i]] = {child, static_cast<int>(i)};
    }
  });
  const auto [child, child_rank] = g.split_result[rank_];
  if (!child) return nullptr;
  return std::unique_ptr<Communicator>(new LocalCommunicator(child, child_rank));
}

void run_local_ranks(int world, const std::function<void(int rank, Communicator& comm)>& body) {
  TS_CHECK(world >= 1, "run_local_ranks: {} ranks", world);
  // The ranks call OpenBLAS from several threads at once, which its OpenMP build supports
  // only when it runs single-threaded (its threaded path assumes one caller at a time; see
  // OpenBLAS's FAQ on multi-threaded applications). The CPU backend's results do not depend
  // on the thread count, so this changes no number.
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  auto job = std::make_shared<LocalCommunicator::Job>(world);
  std::vector<int> members(world);
  std::iota(members.begin(), members.end(), 0);
  auto group = std::make_shared<LocalCommunicator::Group>(job, std::move(members), "world");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        LocalCommunicator comm(group, r);
        body(r, comm);
      } catch (...) {
        std::lock_guard lock(job->mutex);
        job->fail(std::current_exception());
      }
      std::lock_guard lock(job->mutex);
      job->finish();
    });
  for (auto& t : threads) t.join();
  openblas_set_num_threads(blas_threads);
  if (job->cause) std::rethrow_exception(job->cause);
}

}  // namespace tessera::dist
