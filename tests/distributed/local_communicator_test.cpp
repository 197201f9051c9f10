// LocalCommunicator: every collective on the world and on split sub-groups (groups of
// different colors at once), point-to-point in a ring and along a pipeline, sums in rank
// order whatever the threads' timing, and the failures a CPU proof must report instead of
// hanging: a throwing rank, mismatched collectives, a deadlock.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/device_mesh.h"
#include "tessera/distributed/local_communicator.h"

namespace tessera::dist {
namespace {

Tensor host(std::vector<float>& v) {
  return Tensor{v.data(), DType::F32, Shape{static_cast<int64_t>(v.size())}, Device{}};
}
Tensor host(std::vector<int32_t>& v) {
  return Tensor{v.data(), DType::I32, Shape{static_cast<int64_t>(v.size())}, Device{}};
}

// Rank r's input: exact in fp32 and distinct per rank and element, so sums are exact.
float value(int r, int i) {
  return 0.5f * (r + 1) + 4.0f * i;
}

// Runs `body` and returns the failure it reports ("" if none).
std::string failure_of(int world, const std::function<void(int, Communicator&)>& body) {
  try {
    run_local_ranks(world, body);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(LocalCommunicatorTest, EveryCollectiveOnTheWorld) {
  constexpr int kWorld = 4, kN = 3;
  std::mutex mutex;
  int ran = 0;
  run_local_ranks(kWorld, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), kWorld);
    std::vector<float> sum(kN), max(kN);
    for (int i = 0; i < kN; ++i) sum[i] = max[i] = value(rank, i);
    comm.all_reduce(host(sum), ReduceOp::Sum, Lane::Compute);
    comm.all_reduce(host(max), ReduceOp::Max, Lane::Comm);
    for (int i = 0; i < kN; ++i) {
      EXPECT_EQ(sum[i], 0.5f * (1 + 2 + 3 + 4) + 4 * 4.0f * i);
      EXPECT_EQ(max[i], value(kWorld - 1, i));
    }

    // reduce_scatter: rank r keeps the sum of every rank's block r.
    std::vector<float> in(kWorld * kN), mine(kN);
    for (int j = 0; j < kWorld * kN; ++j) in[j] = value(rank, j);
    comm.reduce_scatter(host(mine), host(in), Lane::Comm);
    for (int i = 0; i < kN; ++i) EXPECT_EQ(mine[i], 5.0f + 16.0f * (rank * kN + i));

    // all_gather in place: each rank fills its own block of `gathered`.
    std::vector<int32_t> gathered(kWorld * kN, -1);
    for (int i = 0; i < kN; ++i) gathered[rank * kN + i] = 100 * rank + i;
    const Tensor all = host(gathered);
    comm.all_gather(all, all.flat_range(rank * kN, kN), Lane::Compute);
    for (int r = 0; r < kWorld; ++r)
      for (int i = 0; i < kN; ++i) EXPECT_EQ(gathered[r * kN + i], 100 * r + i);

    std::vector<int32_t> b = {rank, 7 * rank};
    comm.broadcast(host(b), 2, Lane::Compute);
    EXPECT_EQ(b, (std::vector<int32_t>{2, 14}));

    // all_to_all: out block r = rank r's in block `rank`.
    std::vector<int32_t> send(kWorld * 2), recv(kWorld * 2, -1);
    for (int r = 0; r < kWorld; ++r) send[2 * r] = 10 * rank + r, send[2 * r + 1] = -rank;
    comm.all_to_all(host(recv), host(send), Lane::Comm);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(recv[2 * r], 10 * r + rank);
      EXPECT_EQ(recv[2 * r + 1], -r);
    }
    comm.wait_comm();
    comm.synchronize();
    std::lock_guard lock(mutex);
    ++ran;
  });
  EXPECT_EQ(ran, kWorld);
}

// fp32 addition is not associative: in rank order ((1e8 + 1) - 1e8) + 1 is 1, in reverse
// order 0, and other orders give 0 or 2. The ranks arrive in a random order each time.
TEST(LocalCommunicatorTest, SumsInRankOrderWhateverTheTiming) {
  const float inputs[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> results(4);
    run_local_ranks(4, [&](int rank, Communicator& comm) {
      std::mt19937 rng(trial * 4 + rank);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
      std::vector<float> x = {inputs[rank]};
      comm.all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
      results[rank] = x[0];
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(results[r], 1.0f) << "trial " << trial << " rank " << r;
  }
}

// Megatron's world 8 with tp 2, pp 2 (dp 2): every rank joins its tp, dp and pp groups, and
// the four tp groups (then the dp, then the pp groups) reduce at the same time.
TEST(LocalCommunicatorTest, MeshGroupsReduceConcurrently) {
  const DeviceMesh mesh(8, {.tp = 2, .pp = 2});
  run_local_ranks(8, [&](int rank, Communicator& world) {
    for (MeshDim d : {MeshDim::TP, MeshDim::DP, MeshDim::PP}) {
      const auto group = split_mesh_group(world, mesh, {d});
      const std::vector<int> members = mesh.group_ranks(rank, d);
      ASSERT_TRUE(group);
      EXPECT_EQ(group->size(), 2);
      EXPECT_EQ(group->rank(), mesh.coordinate(rank, d));
      std::vector<float> x = {value(rank, 0), value(rank, 1)};
      group->all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
      for (int i = 0; i < 2; ++i)
        EXPECT_EQ(x[i], value(members[0], i) + value(members[1], i)) << mesh_dim_name(d);
      std::vector<int32_t> ranks(2);
      std::vector<int32_t> me = {rank};
      group->all_gather(host(ranks), host(me), Lane::Compute);
      EXPECT_EQ(ranks, (std::vector<int32_t>{members[0], members[1]})) << mesh_dim_name(d);
    }
    // A model-parallel group of 4 with its own collective after the pairs'.
    const auto mp = split_mesh_group(world, mesh, {MeshDim::TP, MeshDim::PP});
    std::vector<int32_t> got(4), me = {rank};
    mp->all_gather(host(got), host(me), Lane::Compute);
    const std::vector<int> expected = mesh.model_parallel_ranks(rank);
    EXPECT_EQ(got, std::vector<int32_t>(expected.begin(), expected.end()));
    EXPECT_EQ(mp->description(),
              "local threads, tp-pp rank " + std::to_string(mp->rank()) + " of 4");
  });
}

TEST(LocalCommunicatorTest, SplitRanksByKeyAndLeavesOutNegativeColors) {
  run_local_ranks(6, [&](int rank, Communicator& world) {
    // Colors 0 (even ranks) and 1 (odd ranks), keys descending; rank 5 joins none.
    const auto group = world.split(rank == 5 ? -1 : rank % 2, -rank, "parity");
    if (rank == 5) {
      EXPECT_EQ(group, nullptr);
      return;
    }
    ASSERT_TRUE(group);
    const int size = rank % 2 == 0 ? 3 : 2;
    EXPECT_EQ(group->size(), size);
    std::vector<int32_t> got(size), me = {rank};
    group->all_gather(host(got), host(me), Lane::Compute);
    EXPECT_EQ(got, rank % 2 == 0 ? (std::vector<int32_t>{4, 2, 0}) : (std::vector<int32_t>{3, 1}));
    // A split of a split.
    const auto single = group->split(group->rank(), 0, "single");
    EXPECT_EQ(single->size(), 1);
    std::vector<float> x = {2.5f};
    single->all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
    EXPECT_EQ(x[0], 2.5f);
  });
}

// Every rank sends to the next and receives from the previous one in one call; then a second
// ring in the other direction with two messages per pair, which arrive in order.
TEST(LocalCommunicatorTest, RingExchangeInOneCallDoesNotDeadlock) {
  constexpr int kWorld = 5;
  run_local_ranks(kWorld, [&](int rank, Communicator& comm) {
    const int next = (rank + 1) % kWorld, prev = (rank + kWorld - 1) % kWorld;
    std::vector<float> out = {value(rank, 0), value(rank, 1)}, in(2, -1.0f);
    const P2POp ops[] = {{P2POp::Kind::Send, host(out), next}, {P2POp::Kind::Recv, host(in), prev}};
    comm.send_recv(ops, Lane::Comm);
    EXPECT_EQ(in, (std::vector<float>{value(prev, 0), value(prev, 1)}));

    std::vector<int32_t> a = {rank}, b = {100 + rank}, first(1, -1), second(1, -1);
    const P2POp back[] = {{P2POp::Kind::Recv, host(first), next},
                          {P2POp::Kind::Send, host(a), prev},
                          {P2POp::Kind::Send, host(b), prev},
                          {P2POp::Kind::Recv, host(second), next}};
    comm.send_recv(back, Lane::Compute);
    EXPECT_EQ(first[0], next);
    EXPECT_EQ(second[0], 100 + next);
  });
}

// A pipeline over the pp groups of a tp 2 x pp 4 mesh: stage s receives from s - 1, adds its
// stage number and sends on, with plain send and recv (no cycle, so no grouping needed).
TEST(LocalCommunicatorTest, PipelineOverSplitGroupsWithPlainSendAndRecv) {
  const DeviceMesh mesh(8, {.tp = 2, .pp = 4});
  std::vector<float> last(2);
  run_local_ranks(8, [&](int rank, Communicator& world) {
    const auto pp = split_mesh_group(world, mesh, {MeshDim::PP});
    const int stage = pp->rank();
    std::vector<float> act = {static_cast<float>(mesh.coordinate(rank, MeshDim::TP))};
    if (stage > 0) pp->recv(host(act), stage - 1, Lane::Comm);
    act[0] += 10.0f * stage;
    if (stage < pp->size() - 1)
      pp->send(host(act), stage + 1, Lane::Comm);
    else
      last[mesh.coordinate(rank, MeshDim::TP)] = act[0];
  });
  EXPECT_EQ(last, (std::vector<float>{60.0f, 61.0f}));
}

// As on NCCL, a send may wait for its receive: two ranks sending to each other first
// deadlock. Here the deadlock is reported, naming what each rank waits for.
TEST(LocalCommunicatorTest, OppositeLoneSendsAreReportedAsADeadlock) {
  const std::string error = failure_of(2, [](int rank, Communicator& comm) {
    std::vector<float> out = {1.0f}, in(1);
    comm.send(host(out), 1 - rank, Lane::Comm);
    comm.recv(host(in), 1 - rank, Lane::Comm);
  });
  EXPECT_NE(error.find("deadlock"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 0 waits in send 4 B (fp32) to world rank 1"), std::string::npos)
      << error;
  EXPECT_NE(error.find("rank 1 waits in send 4 B (fp32) to world rank 0"), std::string::npos)
      << error;
}

TEST(LocalCommunicatorTest, ARankThatReturnsEarlyIsReported) {
  const std::string error = failure_of(3, [](int rank, Communicator& comm) {
    if (rank == 1) return;
    std::vector<float> x = {1.0f};
    comm.all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
  });
  EXPECT_NE(error.find("deadlock"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 2 waits in all_reduce of 4 B (fp32) on world rank 2 of 3"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("1 ranks have returned"), std::string::npos) << error;
}

// The failing rank's exception is the one rethrown; the ranks waiting for it in a world
// collective and in a sub-group's are released.
TEST(LocalCommunicatorTest, AFailingRankReleasesTheOthers) {
  std::vector<int> released(4, 0);
  const std::string error = failure_of(4, [&](int rank, Communicator& world) {
    const auto pair = world.split(rank / 2, rank, "pair");
    std::vector<float> x = {1.0f};
    try {
      if (rank == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        throw std::runtime_error("rank 3 broke");
      }
      if (rank == 2) pair->all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
      world.all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
    } catch (const DistributedError&) {
      released[rank] = 1;
      throw;
    }
  });
  EXPECT_EQ(error, "rank 3 broke");
  EXPECT_EQ(released, (std::vector<int>{1, 1, 1, 0}));
}

TEST(LocalCommunicatorTest, MismatchedCollectivesAreNamed) {
  const std::string error = failure_of(2, [](int rank, Communicator& comm) {
    std::vector<float> x(rank == 0 ? 2 : 3, 1.0f);
    if (rank == 0)
      comm.all_reduce(host(x), ReduceOp::Sum, Lane::Compute);
    else
      comm.broadcast(host(x), 0, Lane::Compute);
  });
  EXPECT_NE(error.find("mismatched collectives on world"), std::string::npos) << error;
  EXPECT_NE(error.find("all_reduce of 8 B (fp32)"), std::string::npos) << error;
  EXPECT_NE(error.find("broadcast of 12 B (fp32) from 0"), std::string::npos) << error;

  const std::string transfer = failure_of(2, [](int rank, Communicator& comm) {
    std::vector<float> x(rank + 1, 1.0f);
    if (rank == 0)
      comm.send(host(x), 1, Lane::Compute);
    else
      comm.recv(host(x), 0, Lane::Compute);
  });
  EXPECT_NE(transfer.find("rank 0 sends 4 B (fp32) to rank 1, which receives 8 B (fp32)"),
            std::string::npos)
      << transfer;
}

}  // namespace
}  // namespace tessera::dist
