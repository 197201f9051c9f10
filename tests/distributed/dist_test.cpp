// Distributed plumbing without GPUs: environment parsing, the TCP rendezvous (threads and
// processes on localhost), the launcher and the gradient bucket plan.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <string>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/env.h"
#include "tessera/distributed/launcher.h"
#include "tessera/distributed/rendezvous.h"

namespace tessera::dist {
namespace {

using Env = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;

DistEnv parse(const Env& vars, std::vector<std::string> hosts = {}) {
  return parse_dist_env(
      [&](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      },
      [hosts](const std::string&) { return hosts; });
}

// A port per test: tests of one binary run one after another, but other jobs may hold ports.
int test_port(int offset) {
  return 20000 + (static_cast<int>(::getpid()) % 20000 + offset * 97) % 40000;
}

DistEnv local(int rank, int world, int port) {
  DistEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.local_world_size = world;
  e.master_port = port;
  return e;
}

TEST(DistEnvTest, SingleProcessWithoutVariables) {
  const DistEnv e = parse({});
  EXPECT_EQ(e.world_size, 1);
  EXPECT_FALSE(e.distributed());
}

TEST(DistEnvTest, TorchrunVariables) {
  const DistEnv e = parse({{"RANK", "3"},
                           {"WORLD_SIZE", "8"},
                           {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "node7"},
                           {"MASTER_PORT", "1234"}});
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(e.source, "torchrun environment");
}

TEST(DistEnvTest, TorchrunWinsOverSlurm) {
  const DistEnv e =
      parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}});
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
}

TEST(DistEnvTest, RejectsRankOutsideWorldNamingTheVariable) {
  try {
    parse({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "RANK");
  }
  EXPECT_THROW(parse({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), ConfigError);
}

TEST(DistEnvTest, SlurmVariablesWithScontrolHosts) {
  const DistEnv e = parse({{"SLURM_PROCID", "5"},
                           {"SLURM_NTASKS", "8"},
                           {"SLURM_LOCALID", "1"},
                           {"SLURM_NTASKS_PER_NODE", "4"},
                           {"SLURM_JOB_NODELIST", "gpu[003-004]"},
                           {"SLURM_JOB_ID", "4242"}},
                          {"gpu003", "gpu004"});
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "gpu003");
  EXPECT_EQ(e.master_port, 20000 + 4242);
  EXPECT_EQ(e.source, "Slurm (srun)");
}

TEST(DistEnvTest, SlurmWithoutScontrolParsesNodeListAndTaskCounts) {
  const DistEnv e = parse({{"SLURM_PROCID", "9"},
                           {"SLURM_NTASKS", "10"},
                           {"SLURM_LOCALID", "1"},
                           {"SLURM_NODEID", "2"},
                           {"SLURM_TASKS_PER_NODE", "4(x2),2"},
                           {"SLURM_NODELIST", "a-node[07,09-10],b1"},
                           {"MASTER_PORT", "999"}});
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "a-node07");
  EXPECT_EQ(e.master_port, 999);
}

TEST(DistEnvTest, SlurmHelpers) {
  EXPECT_EQ(first_slurm_host("gpu[003-005,9],cpu1"), "gpu003");
  EXPECT_EQ(first_slurm_host("single"), "single");
  EXPECT_EQ(first_slurm_host("n1,n2"), "n1");
  EXPECT_EQ(slurm_tasks_on_node("4(x2),2", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),2", 1), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),2", 2), 2);
  EXPECT_THROW(slurm_tasks_on_node("4(x2),2", 3), ConfigError);
  EXPECT_THROW(slurm_tasks_on_node("x", 0), ConfigError);
}

TEST(DistEnvTest, DeviceForLocalRank) {
  DistEnv e = local(1, 2, 1);
  EXPECT_EQ(device_for_local_rank(e, 2), 1);
  EXPECT_EQ(device_for_local_rank(e, 1), 0);  // one GPU visible per task
}

// Runs `body(rank)` on `world` threads; returns each rank's error message ("" if none).
std::vector<std::string> run_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::future<std::string>> f;
  for (int r = 0; r < world; ++r)
    f.push_back(std::async(std::launch::async, [&body, r]() -> std::string {
      try {
        body(r);
        return "";
      } catch (const std::exception& e) {
        return e.what();
      }
    }));
  std::vector<std::string> out;
  for (auto& x : f) out.push_back(x.get());
  return out;
}

TEST(RendezvousTest, ExchangesTheUniqueIdAndAgreesOnTheConfig) {
  const int port = test_port(1), world = 4;
  std::vector<std::string> got(world);
  const auto errors = run_ranks(world, [&](int r) {
    Rendezvous rv(local(r, world, port), 20);
    rv.check_config({{"lr", "0.001"}, {"seed", "1234"}});
    got[r] = rv.broadcast(r == 0 ? std::string("unique-id\0bytes", 15) : std::string());
    rv.close();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], std::string("unique-id\0bytes", 15)) << "rank " << r;
  }
}

TEST(RendezvousTest, ConfigMismatchNamesRankAndKeyOnEveryRank) {
  const int port = test_port(2), world = 3;
  const auto errors = run_ranks(world, [&](int r) {
    Rendezvous rv(local(r, world, port), 20);
    rv.check_config({{"lr", r == 2 ? "0.01" : "0.001"}, {"seed", "1"}});
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("rank 2"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("lr = 0.01 (rank 0: 0.001)"), std::string::npos) << errors[r];
  }
}

TEST(RendezvousTest, PeerThatNeverConnectsIsNamedAfterTheTimeout) {
  const int port = test_port(3), world = 3;
  const auto t0 = Clock::now();
  const auto errors = run_ranks(2, [&](int r) { Rendezvous rv(local(r, world, port), 1.0); });
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(s, 10.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 2 of 3 never connected"), std::string::npos) << errors[r];
  }
}

TEST(RendezvousTest, NonRootWithoutRootTimesOutNamingRankZero) {
  const auto errors = run_ranks(1, [&](int) { Rendezvous rv(local(1, 2, test_port(4)), 0.5); });
  EXPECT_NE(errors[0].find("could not reach rank 0"), std::string::npos) << errors[0];
}

// Processes: rank 1 dies abruptly after the rendezvous; ranks 0 and 2 must notice, name
// rank 1 and exit non-zero well within the timeout.
TEST(RendezvousTest, PeerThatDiesIsNoticedByEveryOtherRank) {
  const int port = test_port(5), world = 3;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        Rendezvous rv(local(r, world, port), 20);
        rv.check_config({{"k", "v"}});
        if (r == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          std::_Exit(9);  // a crash: no goodbye
        }
        rv.watch([](int rank, const std::string& message) {
          std::fprintf(stderr, "%s\n", message.c_str());
          std::_Exit(rank == 1 && message.find("rank 1") != std::string::npos ? 42 : 1);
        });
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);  // never noticed
      } catch (...) {
        std::_Exit(2);
      }
    }
    pids.push_back(pid);
  }
  const auto t0 = Clock::now();
  std::vector<int> codes;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  EXPECT_EQ(codes[0], 42);
  EXPECT_EQ(codes[1], 9);
  EXPECT_EQ(codes[2], 42);
}

TEST(RendezvousTest, CleanCloseIsNotReportedAsLoss) {
  const int port = test_port(6), world = 2;
  std::atomic<int> lost{0};
  const auto errors = run_ranks(world, [&](int r) {
    Rendezvous rv(local(r, world, port), 20);
    rv.check_config({});
    rv.watch([&](int, const std::string&) { ++lost; });
    if (r == 1) rv.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    rv.close();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(lost.load(), 0);
}

TEST(LauncherTest, SetsTheRankEnvironment) {
  LaunchOptions o;
  o.nproc_per_node = 3;
  o.master_port = 4321;
  o.command = {"/bin/sh", "-c",
               "test \"$WORLD_SIZE\" = 3 && test \"$LOCAL_WORLD_SIZE\" = 3 && test \"$RANK\" = "
               "\"$LOCAL_RANK\" && test \"$MASTER_PORT\" = 4321"};
  const LaunchResult r = launch(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.failed_rank, -1);
}

TEST(LauncherTest, FailingRankStopsTheOthersAndItsCodeIsReturned) {
  LaunchOptions o;
  o.nproc_per_node = 3;
  o.grace_s = 2;
  // Rank 1 fails at once; rank 0 would run for a minute; rank 2 ignores SIGTERM (SIGKILL).
  o.command = {"/bin/sh", "-c",
               "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 7; fi; "
               "if [ \"$RANK\" = 2 ]; then trap '' TERM; fi; sleep 60"};
  const auto t0 = Clock::now();
  const LaunchResult r = launch(o);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_LT(s, 15.0);
}

TEST(LauncherTest, RejectsBadOptions) {
  LaunchOptions o;
  o.command = {"true"};
  o.nnodes = 2;
  o.node_rank = 2;
  EXPECT_THROW(launch(o), ConfigError);
}

TEST(BucketPlanTest, BucketsCoverThePaddedBufferFromTheTop) {
  const BucketPlan p = plan_buckets(1000003, 300000, 4);
  EXPECT_EQ(p.padded % flat_buffer_multiple(4), 0);
  EXPECT_GE(p.padded, 1000003);
  int64_t end = p.padded;
  for (const ParamRange& b : p.buckets) {
    EXPECT_EQ(b.end, end);
    EXPECT_EQ(b.count() % flat_buffer_multiple(4), 0);
    end = b.begin;
  }
  EXPECT_EQ(end, 0);
}

TEST(BucketPlanTest, ShardsPartitionEveryBucketAndOwnedRangesTheParameters) {
  const int world = 3;
  const BucketPlan p = plan_buckets(100000, 20000, world);
  int64_t owned_total = 0;
  for (int r = 0; r < world; ++r) {
    int64_t prev_end = -1;
    for (const ParamRange& o : p.owned(r)) {
      EXPECT_GT(o.begin, prev_end);
      EXPECT_LE(o.end, p.params);
      EXPECT_EQ(o.begin % 64, 0);
      prev_end = o.end;
      owned_total += o.count();
    }
  }
  EXPECT_EQ(owned_total, p.params);  // every parameter has exactly one owner
  for (size_t k = 0; k < p.buckets.size(); ++k)
    EXPECT_EQ(p.shard(k, world - 1).end, p.buckets[k].end);
}

}  // namespace
}  // namespace tessera::dist
