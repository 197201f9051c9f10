#include "tessera/distributed/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
namespace {

using Clock = std::chrono::steady_clock;

// Frames: a fixed header, then `len` payload bytes. Both ends are the same binary on the same
// architecture, so the header goes in host byte order.
enum FrameType : uint32_t { kHello = 1, kConfig = 2, kVerdict = 3, kBlob = 4, kBye = 5, kLost = 6 };

struct Header {
  uint32_t type = 0;
  uint32_t aux = 0;  // HELLO: sender's rank; LOST: the lost rank
  uint64_t len = 0;
};

enum class ReadStatus { Ok, Closed, Timeout };

int remaining_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

ReadStatus read_all(int fd, void* dst, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, remaining_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return ReadStatus::Timeout;
    if (r < 0) return ReadStatus::Closed;
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return ReadStatus::Closed;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return ReadStatus::Ok;
}

ReadStatus read_frame(int fd, Header* h, std::string* payload, Clock::time_point deadline) {
  if (ReadStatus s = read_all(fd, h, sizeof *h, deadline); s != ReadStatus::Ok) return s;
  // A configuration or unique id is small; anything larger is not one of ours.
  if (h->len > (64u << 20)) return ReadStatus::Closed;
  payload->resize(h->len);
  return h->len ? read_all(fd, payload->data(), h->len, deadline) : ReadStatus::Ok;
}

std::string serialize(const std::map<std::string, std::string>& config) {
  std::string out;
  for (const auto& [k, v] : config) {
    out += k;
    out.push_back('\0');
    out += v;
    out.push_back('\0');
  }
  return out;
}

std::map<std::string, std::string> deserialize(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t k_end = text.find('\0', pos);
    if (k_end == std::string::npos) break;
    const size_t v_end = text.find('\0', k_end + 1);
    if (v_end == std::string::npos) break;
    out[text.substr(pos, k_end - pos)] = text.substr(k_end + 1, v_end - k_end - 1);
    pos = v_end + 1;
  }
  return out;
}

// "lr = 0.001 (rank 0: 0.0003), seed = 1 (rank 0: 1234)"; empty when equal.
std::string config_differences(const std::map<std::string, std::string>& root,
                               const std::map<std::string, std::string>& other) {
  std::string out;
  auto add = [&](const std::string& key, const std::string& mine, const std::string& theirs) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} = {} (rank 0: {})", key, theirs, mine);
  };
  for (const auto& [k, v] : root) {
    const auto it = other.find(k);
    if (it == other.end())
      add(k, v, "<missing>");
    else if (it->second != v)
      add(k, v, it->second);
  }
  for (const auto& [k, v] : other)
    if (!root.contains(k)) add(k, "<missing>", v);
  return out;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

Rendezvous::Rendezvous(const DistEnv& env, double timeout_s) : env_(env), timeout_s_(timeout_s) {
  if (env_.rank == 0) {
    peer_fds_.assign(env_.world_size, -1);
    said_bye_.assign(env_.world_size, false);
    if (env_.world_size > 1) accept_peers(timeout_s);  // alone: nobody to wait for, no port
  } else {
    peer_fds_.assign(1, -1);
    said_bye_.assign(1, false);
    connect_to_root(timeout_s);
  }
}

Rendezvous::~Rendezvous() {
  stop_watching();
  for (int fd : peer_fds_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void Rendezvous::send_frame(int fd, uint32_t type, uint32_t aux, const std::string& payload) {
  const std::lock_guard lock(send_mu_);
  Header h{type, aux, payload.size()};
  std::string bytes(reinterpret_cast<const char*>(&h), sizeof h);
  bytes += payload;
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the receiver is gone; its watcher or read reports that
    sent += static_cast<size_t>(n);
  }
}

void Rendezvous::accept_peers(double timeout_s) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(env_.master_port));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, env_.world_size) != 0)
    throw DistributedError(fmt::format(
        "rank 0 cannot listen on port {} for the rendezvous: {} (another job on this port? set "
        "MASTER_PORT or --master_port)",
        env_.master_port, std::strerror(errno)));
  const auto deadline = deadline_after(timeout_s);
  int connected = 0;
  while (connected < env_.world_size - 1) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, remaining_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Header h;
    std::string payload;
    // A stray connection (a port scanner, another job) that sends no valid hello is dropped.
    const auto hello_deadline = std::min(deadline, deadline_after(5.0));
    if (read_frame(fd, &h, &payload, hello_deadline) != ReadStatus::Ok || h.type != kHello ||
        h.aux == 0 || static_cast<int>(h.aux) >= env_.world_size || peer_fds_[h.aux] >= 0) {
      ::close(fd);
      continue;
    }
    peer_fds_[h.aux] = fd;
    ++connected;
  }
  std::vector<int> missing;
  for (int r = 1; r < env_.world_size; ++r)
    if (peer_fds_[r] < 0) missing.push_back(r);
  std::string verdict;
  if (!missing.empty())
    verdict = fmt::format(
        "rendezvous on port {} timed out after {:.1f} s: rank{} {} of {} never connected to rank 0 "
        "(not started, crashed before connecting, or cannot reach {}:{})",
        env_.master_port, timeout_s, missing.size() > 1 ? "s" : "", rank_list(missing),
        env_.world_size, env_.master_addr, env_.master_port);
  for (int r = 1; r < env_.world_size; ++r)
    if (peer_fds_[r] >= 0) send_frame(peer_fds_[r], kVerdict, 0, verdict);
  if (!verdict.empty()) throw DistributedError(verdict);
}

void Rendezvous::connect_to_root(double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  std::string last_error = "no attempt";
  int fd = -1;
  while (fd < 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(env_.master_port);
    const int gai = ::getaddrinfo(env_.master_addr.c_str(), port.c_str(), &hints, &res);
    if (gai != 0) {
      last_error = fmt::format("cannot resolve {}: {}", env_.master_addr, ::gai_strerror(gai));
    } else {
      for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
        const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (s < 0) continue;
        if (::connect(s, a->ai_addr, a->ai_addrlen) == 0) {
          fd = s;
        } else {
          last_error = std::strerror(errno);
          ::close(s);
        }
      }
      ::freeaddrinfo(res);
    }
    if (fd >= 0) break;
    if (remaining_ms(deadline) == 0)
      throw DistributedError(fmt::format(
          "rank {} could not reach rank 0 at {}:{} within {:.1f} s (last error: {}); is rank 0 "
          "running, and are MASTER_ADDR/MASTER_PORT the same on every rank?",
          env_.rank, env_.master_addr, env_.master_port, timeout_s, last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  peer_fds_[0] = fd;
  send_frame(fd, kHello, static_cast<uint32_t>(env_.rank), "");
  // Rank 0 answers once everybody connected or at its own deadline, which may come up to a
  // full timeout after ours (it started later): wait for both.
  Header h;
  std::string payload;
  const ReadStatus s = read_frame(fd, &h, &payload, deadline_after(2 * timeout_s + 5));
  if (s != ReadStatus::Ok || h.type != kVerdict)
    throw DistributedError(fmt::format(
        "rank {}: rank 0 at {}:{} {} during the rendezvous", env_.rank, env_.master_addr,
        env_.master_port, s == ReadStatus::Timeout ? "did not answer" : "closed the connection"));
  if (!payload.empty()) throw DistributedError(payload);
}

void Rendezvous::check_config(const std::map<std::string, std::string>& config) {
  const auto deadline = deadline_after(timeout_s_);
  if (env_.rank != 0) {
    send_frame(peer_fds_[0], kConfig, 0, serialize(config));
    Header h;
    std::string payload;
    const ReadStatus s = read_frame(peer_fds_[0], &h, &payload, deadline_after(2 * timeout_s_));
    if (s != ReadStatus::Ok || h.type != kVerdict)
      throw DistributedError(fmt::format("rank {}: rank 0 {} while comparing configurations",
                                         env_.rank,
                                         s == ReadStatus::Timeout ? "did not answer" : "exited"));
    if (!payload.empty()) throw DistributedError(payload);
    return;
  }
  std::string verdict;
  for (int r = 1; r < env_.world_size && verdict.empty(); ++r) {
    Header h;
    std::string payload;
    const ReadStatus s = read_frame(peer_fds_[r], &h, &payload, deadline);
    if (s != ReadStatus::Ok || h.type != kConfig) {
      verdict = fmt::format("rank {} {} before sending its configuration", r,
                            s == ReadStatus::Timeout ? "did not answer" : "exited");
      break;
    }
    const std::string diff = config_differences(config, deserialize(payload));
    if (!diff.empty())
      verdict = fmt::format(
          "the configuration differs between ranks: rank {} has {}. Every rank "
          "must run the same command line and files.",
          r, diff);
  }
  for (int r = 1; r < env_.world_size; ++r) send_frame(peer_fds_[r], kVerdict, 0, verdict);
  if (!verdict.empty()) throw DistributedError(verdict);
}

std::string Rendezvous::broadcast(const std::string& blob) {
  if (env_.rank == 0) {
    for (int r = 1; r < env_.world_size; ++r) send_frame(peer_fds_[r], kBlob, 0, blob);
    return blob;
  }
  Header h;
  std::string payload;
  const ReadStatus s = read_frame(peer_fds_[0], &h, &payload, deadline_after(timeout_s_));
  if (s != ReadStatus::Ok || h.type != kBlob)
    throw DistributedError(fmt::format("rank {}: rank 0 {} before sending the NCCL id", env_.rank,
                                       s == ReadStatus::Timeout ? "did not answer" : "exited"));
  return payload;
}

void Rendezvous::watch(std::function<void(int, const std::string&)> on_lost) {
  on_lost_ = std::move(on_lost);
  stop_ = false;
  watcher_ = std::thread([this] { watch_loop(); });
}

void Rendezvous::report_lost(int rank, const std::string& message) {
  if (reported_.exchange(true)) return;
  if (env_.rank == 0)
    for (int r = 1; r < env_.world_size; ++r)
      if (r != rank && peer_fds_[r] >= 0 && !said_bye_[r])
        send_frame(peer_fds_[r], kLost, rank, message);
  if (on_lost_) on_lost_(rank, message);
}

void Rendezvous::watch_loop() {
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  while (!stop_) {
    fds.clear();
    ranks.clear();
    for (size_t i = 0; i < peer_fds_.size(); ++i) {
      if (peer_fds_[i] < 0 || said_bye_[i]) continue;
      fds.push_back({peer_fds_[i], POLLIN, 0});
      ranks.push_back(env_.rank == 0 ? static_cast<int>(i) : 0);
    }
    if (fds.empty()) return;
    const int n = ::poll(fds.data(), fds.size(), 200);
    if (n <= 0) continue;
    for (size_t j = 0; j < fds.size(); ++j) {
      if (!fds[j].revents) continue;
      const size_t slot = env_.rank == 0 ? static_cast<size_t>(ranks[j]) : 0;
      Header h;
      std::string payload;
      const ReadStatus s = read_frame(fds[j].fd, &h, &payload, deadline_after(5.0));
      if (s == ReadStatus::Ok && h.type == kBye) {
        said_bye_[slot] = true;
      } else if (s == ReadStatus::Ok && h.type == kLost) {
        report_lost(static_cast<int>(h.aux), payload);
      } else if (s != ReadStatus::Timeout) {
        said_bye_[slot] = true;  // nothing more to read from it
        report_lost(ranks[j], fmt::format("rank {} exited or became unreachable: its rendezvous "
                                          "connection to rank {} closed without a clean shutdown",
                                          ranks[j], env_.rank));
      }
    }
  }
}

void Rendezvous::stop_watching() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
}

void Rendezvous::close() {
  if (closed_) return;
  closed_ = true;
  stop_watching();
  for (size_t i = 0; i < peer_fds_.size(); ++i) {
    if (peer_fds_[i] < 0) continue;
    if (!said_bye_[i]) send_frame(peer_fds_[i], kBye, static_cast<uint32_t>(env_.rank), "");
    ::close(peer_fds_[i]);
    peer_fds_[i] = -1;
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

}  // namespace tessera::dist
