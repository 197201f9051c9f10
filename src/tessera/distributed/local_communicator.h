#pragma once
// N ranks as threads of one process over host memory, so that every parallel mode runs on
// the CPU backend and can be proven exactly against one rank before it meets a GPU.
//
// Collectives move any dtype as bytes and reduce fp32 only; each rank computes its output
// from every member's input in rank order, so results have the same bits on every rank
// whatever the threads' timing. Operations complete before they return (lanes, marks and
// synchronize() have nothing to wait for). NCCL's rules are enforced rather than relaxed, so
// that what runs here runs there: the members of a group must call the same collectives in
// the same order with the same sizes (else every rank fails, naming both calls), and a send
// waits for the peer's receive (NCCL's rendezvous), so two ranks that send to each other
// outside one send_recv deadlock here too. Unlike on GPUs, a deadlock is detected (every
// rank that has not returned waits and none can go on) and fails the run naming what each
// rank waits for, and a rank that throws releases the others.
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"

namespace tessera::dist {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return rank_; }
  int size() const override;
  // "local threads, tp rank 1 of 2"
  std::string description() const override;

  void all_reduce(const Tensor& buffer, ReduceOp op, Lane lane) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, Lane lane) override;
  void all_gather(const Tensor& out, const Tensor& in, Lane lane) override;
  void broadcast(const Tensor& buffer, int root, Lane lane) override;
  void all_to_all(const Tensor& out, const Tensor& in, Lane lane) override;
  void send_recv(std::span<const P2POp> ops, Lane lane) override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;

  void wait_comm() override {}
  int comm_mark() override { return 0; }
  void wait_comm_mark(int) override {}
  void synchronize() override {}
  void finalize() override {}

  // Defined in local_communicator.cpp.
  struct Job;    // the run's threads: one lock, the first failure, deadlock detection
  struct Group;  // one communicator's members and the state of their current call
  struct Call;   // what a member called, checked against the other members' calls

 private:
  friend void run_local_ranks(int, const std::function<void(int, Communicator&)>&);
  LocalCommunicator(std::shared_ptr<Group> group, int rank);

  using Bytes = std::vector<std::byte>;
  // Publishes this rank's input, waits for every member's, lets compute(inputs) write this
  // rank's output (inputs by group rank), and waits until every member has read them.
  void collective(const char* name, const Tensor& in, int root,
                  const std::function<void(std::span<const Bytes>)>& compute);
  // Under the run's lock (held by `lock`): waits until every member has made `call`; the
  // last to arrive checks that the calls agree and runs on_last before releasing the others.
  void arrive(std::unique_lock<std::mutex>& lock, const Call& call,
              const std::function<void()>& on_last = {});
  int global_rank() const;
  std::string where() const;  // "tp rank 1 of 2"

  std::shared_ptr<Group> group_;
  int rank_;  // in the group
};

// Runs body(rank, world communicator) for ranks 0..world-1, each on its own thread, and
// rethrows the first failure (a rank's exception, a mismatched collective, a deadlock).
void run_local_ranks(int world, const std::function<void(int rank, Communicator& comm)>& body);

}  // namespace tessera::dist
