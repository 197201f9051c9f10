#pragma once
// The TCP rendezvous of a distributed job: rank 0 listens on MASTER_ADDR:MASTER_PORT and
// every other rank connects to it (star). Over these connections the ranks check that they
// run the same configuration, receive rank 0's NCCL unique id, and afterwards keep the
// sockets open as a heartbeat: a rank whose process dies closes its socket, which rank 0
// sees at once and relays to the others, so a dead peer is named instead of a collective
// hanging until the watchdog fires.
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/distributed/env.h"

namespace tessera::dist {

class Rendezvous {
 public:
  // Connects the world within timeout_s: rank 0 accepts world_size - 1 peers, the others
  // retry connecting until rank 0 listens. Throws DistributedError naming the ranks that did
  // not connect (on rank 0 and, through its answer, on every connected rank).
  Rendezvous(const DistEnv& env, double timeout_s);
  // Closes the sockets without a goodbye unless close() ran: peers then report this rank
  // as lost, which is what an exception escaping the training loop should cause.
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  // Every rank's effective configuration (key -> value) is compared with rank 0's; on a
  // difference every rank throws DistributedError naming the first differing rank and keys.
  void check_config(const std::map<std::string, std::string>& config);
  // Rank 0's `blob` (ignored elsewhere) on every rank.
  std::string broadcast(const std::string& blob);

  // Watches the peers from a background thread: a peer whose connection ends without the
  // goodbye of close() is reported once, as on_lost(rank, message). The callback runs on
  // the watcher thread.
  void watch(std::function<void(int rank, const std::string& message)> on_lost);
  // A clean end: says goodbye to the peers (they stop watching this rank) and closes.
  void close();

 private:
  void accept_peers(double timeout_s);
  void connect_to_root(double timeout_s);
  void watch_loop();
  void report_lost(int rank, const std::string& message);
  void send_frame(int fd, uint32_t type, uint32_t aux, const std::string& payload);
  void stop_watching();

  DistEnv env_;
  double timeout_s_;
  int listen_fd_ = -1;
  std::vector<int> peer_fds_;  // rank 0: index = rank (own slot -1); others: [0] = rank 0
  std::vector<bool> said_bye_;
  std::mutex send_mu_;
  std::function<void(int, const std::string&)> on_lost_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> reported_{false};
  std::thread watcher_;
  bool closed_ = false;
};

}  // namespace tessera::dist
