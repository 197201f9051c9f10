#pragma once
// Data-parallel ranks as threads of the test process, so that trainers with a communicator
// (plain DP, ZeRO-1) run on the CPU backend. Each collective copies every rank's input into
// shared memory and, once all ranks have arrived, computes each rank's output in rank order,
// so sums are deterministic. A rank that throws releases the others (they throw too) instead
// of leaving them waiting.
#include <cblas.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tessera/distributed/communicator.h"

namespace tessera::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), inputs_(world) {}

  int world() const { return world_; }
  std::vector<std::vector<float>>& inputs() { return inputs_; }

  void wait() {
    std::unique_lock lock(mutex_);
    if (failed_) throw std::runtime_error("another rank failed");
    const int64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || failed_; });
    if (generation_ == generation) throw std::runtime_error("another rank failed");
  }

  // Releases every waiting rank; true for the first failure (the cause, not a consequence).
  bool fail() {
    std::lock_guard lock(mutex_);
    const bool first = !failed_;
    failed_ = true;
    cv_.notify_all();
    return first;
  }

 private:
  int world_;
  std::vector<std::vector<float>> inputs_;  // by rank: the current collective's input
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool failed_ = false;
};

// fp32 host tensors only (the CPU backend's); lanes and streams do not exist on the CPU.
class ThreadCommunicator : public dist::Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.world(); }
  std::string description() const override { return "test threads"; }

  void all_reduce(const Tensor& buffer, dist::ReduceOp op, dist::Lane) override {
    exchange(buffer, [&](const auto& in) {
      float* out = values(buffer);
      for (size_t i = 0; i < in[0].size(); ++i) {
        float v = in[0][i];
        for (int r = 1; r < size(); ++r)
          v = op == dist::ReduceOp::Sum ? v + in[r][i] : std::max(v, in[r][i]);
        out[i] = v;
      }
    });
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, dist::Lane) override {
    exchange(in, [&](const auto& ins) {
      const int64_t n = out.numel();
      float* o = values(out);
      for (int64_t i = 0; i < n; ++i) {
        float v = ins[0][rank_ * n + i];
        for (int r = 1; r < size(); ++r) v += ins[r][rank_ * n + i];
        o[i] = v;
      }
    });
  }
  void all_gather(const Tensor& out, const Tensor& in, dist::Lane) override {
    exchange(in, [&](const auto& ins) {
      float* o = values(out);
      for (int r = 0; r < size(); ++r) std::copy(ins[r].begin(), ins[r].end(), o + r * in.numel());
    });
  }
  void broadcast(const Tensor& buffer, int root, dist::Lane) override {
    exchange(buffer, [&](const auto& ins) {
      std::copy(ins[root].begin(), ins[root].end(), values(buffer));
    });
  }
  void all_to_all(const Tensor& out, const Tensor& in, dist::Lane) override {
    exchange(in, [&](const auto& ins) {
      const int64_t n = in.numel() / size();
      float* o = values(out);
      for (int r = 0; r < size(); ++r)
        std::copy(ins[r].begin() + rank_ * n, ins[r].begin() + (rank_ + 1) * n, o + r * n);
    });
  }
  void wait_comm() override {}
  int comm_mark() override { return 0; }  // collectives here complete before they return
  void wait_comm_mark(int) override {}
  void synchronize() override {}
  void finalize() override {}

 private:
  static float* values(const Tensor& t) {
    if (t.dtype != DType::F32) throw std::runtime_error("test communicator: fp32 tensors only");
    return static_cast<float*>(t.data);
  }

  // Publishes `in`, waits for every rank's, lets `compute` write this rank's output, and
  // waits until every rank has read the inputs before they may be replaced.
  void exchange(const Tensor& in,
                const std::function<void(const std::vector<std::vector<float>>&)>& compute) {
    const float* v = values(in);
    group_.inputs()[rank_].assign(v, v + in.numel());
    group_.wait();
    compute(group_.inputs());
    group_.wait();
  }

  ThreadGroup& group_;
  int rank_;
};

// Runs body(rank, communicator) for every rank on its own thread and rethrows the first
// failure. OpenBLAS is called from several threads at once here, which its OpenMP build
// supports only single-threaded; the CPU backend's results do not depend on thread counts.
inline void run_ranks(int world, const std::function<void(int, dist::Communicator&)>& body) {
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  ThreadGroup group(world);
  std::exception_ptr cause;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadCommunicator comm(group, r);
        body(r, comm);
      } catch (...) {
        if (group.fail()) cause = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  openblas_set_num_threads(blas_threads);
  if (cause) std::rethrow_exception(cause);
}

}  // namespace tessera::testing
