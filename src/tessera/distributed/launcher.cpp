#include "tessera/distributed/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "tessera/core/error.h"

extern char** environ;

namespace tessera::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_forward_signal{0};

void remember_signal(int sig) {
  g_forward_signal = sig;
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;  // read ends; -1 once drained
  std::string out_partial, err_partial;
  bool exited = false;
  int code = 0;
};

// Writes every complete line of `buffer` to `to`, prefixed; keeps the unfinished tail.
void forward_lines(std::string& buffer, FILE* to, int rank, bool flush_tail) {
  size_t start = 0;
  for (size_t nl; (nl = buffer.find('\n', start)) != std::string::npos; start = nl + 1)
    fmt::print(to, "[rank {}] {}\n", rank, std::string_view(buffer).substr(start, nl - start));
  buffer.erase(0, start);
  if (flush_tail && !buffer.empty()) {
    fmt::print(to, "[rank {}] {}\n", rank, buffer);
    buffer.clear();
  }
  std::fflush(to);
}

pid_t spawn(const std::vector<std::string>& command, const std::vector<std::string>& env_add,
            int out_fd, int err_fd) {
  std::vector<char*> argv;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The child's environment: ours without the variables we set, then ours.
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    bool replaced = false;
    for (const auto& add : env_add)
      if (kv.substr(0, kv.find('=') + 1) == std::string_view(add).substr(0, add.find('=') + 1))
        replaced = true;
    if (!replaced) env_text.emplace_back(kv);
  }
  for (const auto& add : env_add) env_text.push_back(add);
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);

  const pid_t pid = ::fork();
  if (pid == 0) {
    // Its own process group: stopping a rank also stops whatever it started (a shell's child).
    ::setpgid(0, 0);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::execvpe(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "cannot run %s: %s\n", argv[0], std::strerror(errno));
    std::_Exit(127);
  }
  return pid;
}

}  // namespace

LaunchResult launch(const LaunchOptions& o) {
  if (o.nproc_per_node < 1)
    throw ConfigError("command line", "nproc_per_node", std::to_string(o.nproc_per_node),
                      "at least 1");
  if (o.nnodes < 1)
    throw ConfigError("command line", "nnodes", std::to_string(o.nnodes), "at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw ConfigError("command line", "node_rank", std::to_string(o.node_rank),
                      fmt::format("a node index below --nnodes ({})", o.nnodes));
  if (o.command.empty()) throw ConfigError("command line", "launch", "", "a command to run");
  const int world = o.nproc_per_node * o.nnodes;

  struct sigaction sa {};
  sa.sa_handler = remember_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  g_forward_signal = 0;

  std::vector<Child> children(o.nproc_per_node);
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Child& c = children[local];
    c.rank = o.node_rank * o.nproc_per_node + local;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw Error(fmt::format("launch: cannot create pipes: {}", std::strerror(errno)));
    const std::vector<std::string> env = {
        fmt::format("RANK={}", c.rank),
        fmt::format("WORLD_SIZE={}", world),
        fmt::format("LOCAL_RANK={}", local),
        fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node),
        fmt::format("GROUP_RANK={}", o.node_rank),
        fmt::format("MASTER_ADDR={}", o.master_addr),
        fmt::format("MASTER_PORT={}", o.master_port),
    };
    c.pid = spawn(o.command, env, out[1], err[1]);
    ::close(out[1]);
    ::close(err[1]);
    c.out_fd = out[0];
    c.err_fd = err[0];
    if (c.pid < 0)
      throw Error(fmt::format("launch: cannot start rank {}: {}", c.rank, std::strerror(errno)));
  }

  LaunchResult result;
  bool terminating = false, killed = false;
  Clock::time_point term_sent, all_exited_at;
  auto signal_all = [&](int sig) {
    for (const Child& c : children)
      if (!c.exited) ::kill(-c.pid, sig);
  };
  while (true) {
    if (int sig = g_forward_signal.exchange(0)) {
      signal_all(sig);
      if (!terminating) {
        terminating = true;
        term_sent = Clock::now();
      }
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, bool>> owners;  // (child, is stdout)
    for (Child& c : children) {
      if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0}), owners.push_back({&c, true});
      if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0}), owners.push_back({&c, false});
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto [c, is_out] = owners[i];
      int& fd = is_out ? c->out_fd : c->err_fd;
      std::string& buf = is_out ? c->out_partial : c->err_partial;
      char chunk[4096];
      const ssize_t n = ::read(fd, chunk, sizeof chunk);
      if (n > 0) {
        buf.append(chunk, static_cast<size_t>(n));
        forward_lines(buf, is_out ? stdout : stderr, c->rank, false);
      } else if (n == 0 || errno != EINTR) {
        forward_lines(buf, is_out ? stdout : stderr, c->rank, true);
        ::close(fd);
        fd = -1;
      }
    }
    bool all_exited = true;
    for (Child& c : children) {
      if (c.exited) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.exited = true;
        c.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (c.code != 0 && result.failed_rank < 0 && !terminating) {
          result.failed_rank = c.rank;
          result.exit_code = c.code;
          fmt::print(stderr, "launch: rank {} exited with {} {}; stopping the other ranks\n",
                     c.rank, WIFEXITED(status) ? "code" : "signal",
                     WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
          std::fflush(stderr);
          terminating = true;
          term_sent = Clock::now();
          signal_all(SIGTERM);
        } else if (c.code != 0 && result.failed_rank < 0) {
          result.failed_rank = c.rank;
          result.exit_code = c.code;
        }
      } else {
        all_exited = false;
      }
    }
    // Output still open after every rank exited belongs to processes they left behind.
    if (all_exited && all_exited_at == Clock::time_point()) all_exited_at = Clock::now();
    if (all_exited && (fds.empty() || Clock::now() - all_exited_at > std::chrono::seconds(2)))
      break;
    if (terminating && !killed &&
        std::chrono::duration<double>(Clock::now() - term_sent).count() > o.grace_s) {
      signal_all(SIGKILL);
      killed = true;
    }
  }
  for (Child& c : children) {
    forward_lines(c.out_partial, stdout, c.rank, true);
    forward_lines(c.err_partial, stderr, c.rank, true);
    if (c.out_fd >= 0) ::close(c.out_fd);
    if (c.err_fd >= 0) ::close(c.err_fd);
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return result;
}

std::string current_executable() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) throw Error("cannot find the tessera executable (/proc/self/exe)");
  return std::string(path, static_cast<size_t>(n));
}

}  // namespace tessera::dist
