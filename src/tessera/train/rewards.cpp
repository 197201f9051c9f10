#include "tessera/train/rewards.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"

namespace tessera {
namespace {

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// The value of a number written as answers write them ("$1,000.50", "-3", "2.0"), or nullopt.
std::optional<double> number_value(std::string_view s) {
  std::string digits;
  for (char c : s)
    if (c != ',' && c != '$') digits += c;
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

std::optional<std::string> extract_answer(std::string_view completion, AnswerFormat format,
                                          const std::regex* pattern) {
  switch (format) {
    case AnswerFormat::Boxed: {
      const size_t at = completion.rfind("\\boxed{");
      if (at == std::string_view::npos) return std::nullopt;
      int depth = 1;
      const size_t begin = at + 7;
      for (size_t i = begin; i < completion.size(); ++i) {
        depth += completion[i] == '{' ? 1 : completion[i] == '}' ? -1 : 0;
        if (depth == 0) return std::string(trim(completion.substr(begin, i - begin)));
      }
      return std::nullopt;  // never closed
    }
    case AnswerFormat::Hash: {
      const size_t at = completion.rfind("####");
      if (at == std::string_view::npos) return std::nullopt;
      std::string_view rest = completion.substr(at + 4);
      rest = rest.substr(0, rest.find('\n'));
      return std::string(trim(rest));
    }
    case AnswerFormat::Regex: {
      if (!pattern) throw Error("extract_answer: the regex format needs a pattern");
      std::match_results<std::string_view::const_iterator> m;
      if (!std::regex_search(completion.begin(), completion.end(), m, *pattern)) return std::nullopt;
      return std::string(trim(m.size() > 1 ? std::string_view(&*m[1].first, static_cast<size_t>(m[1].length()))
                                           : std::string_view(&*m[0].first, static_cast<size_t>(m[0].length()))));
    }
  }
  return std::nullopt;
}

bool answers_match(std::string_view given, std::string_view expected) {
  auto normal = [](std::string_view s) {
    s = trim(s);
    if (!s.empty() && s.back() == '.') s.remove_suffix(1);
    return trim(s);
  };
  given = normal(given), expected = normal(expected);
  const auto a = number_value(given), b = number_value(expected);
  if (a && b) return *a == *b;
  return given == expected;
}

double overlong_penalty(int64_t length, int64_t max_length, int64_t cache) {
  if (cache < 0 || cache > max_length) throw Error(fmt::format("overlong cache {} of {}", cache, max_length));
  if (length <= max_length - cache) return 0.0;
  if (length <= max_length) return static_cast<double>((max_length - cache) - length) / static_cast<double>(cache);
  return -1.0;
}

std::vector<double> command_rewards(const std::string& command, const std::vector<RewardQuery>& queries,
                                    double timeout_seconds) {
  std::string input;
  for (const RewardQuery& q : queries)
    // A sampled completion may end inside a character: its broken bytes are sent as U+FFFD.
    input += nlohmann::json{{"prompt", q.prompt}, {"completion", q.completion}, {"answer", q.answer}}
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
             "\n";
  int in_pipe[2], out_pipe[2], err_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
    throw Error(fmt::format("reward command '{}': cannot make pipes: {}", command, std::strerror(errno)));
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(fmt::format("reward command '{}': cannot fork: {}", command, std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);  // its own group, so that a timeout kills its children too
    ::dup2(in_pipe[0], 0), ::dup2(out_pipe[1], 1), ::dup2(err_pipe[1], 2);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(in_pipe[0]), ::close(out_pipe[1]), ::close(err_pipe[1]);
  ::fcntl(in_pipe[1], F_SETFL, O_NONBLOCK);
  // A command that exits without reading its input: the write's SIGPIPE is blocked on this
  // thread, then consumed, so that it neither kills the process nor stays pending.
  sigset_t pipe_signal, previous;
  ::sigemptyset(&pipe_signal);
  ::sigaddset(&pipe_signal, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_signal, &previous);
  std::string out, err;
  size_t written = 0;
  int to_child = in_pipe[1];
  if (input.empty()) ::close(to_child), to_child = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  bool out_open = true, err_open = true, timed_out = false;
  while (out_open || err_open) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[3] = {{out_open ? out_pipe[0] : -1, POLLIN, 0}, {err_open ? err_pipe[0] : -1, POLLIN, 0},
                     {to_child, POLLOUT, 0}};
    if (::poll(fds, 3, static_cast<int>(std::min<int64_t>(left.count(), 1000))) < 0 && errno != EINTR) break;
    char buffer[65536];
    for (int k = 0; k < 2; ++k) {
      if (fds[k].fd < 0 || !(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = ::read(fds[k].fd, buffer, sizeof buffer);
      if (n > 0) {
        (k == 0 ? out : err).append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EAGAIN) {
        (k == 0 ? out_open : err_open) = false;
      }
    }
    if (to_child >= 0 && (fds[2].revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t n = ::write(to_child, input.data() + written, input.size() - written);
      if (n > 0) written += static_cast<size_t>(n);
      if ((n < 0 && errno != EAGAIN) || written == input.size()) ::close(to_child), to_child = -1;
    }
  }
  if (to_child >= 0) ::close(to_child);
  const timespec now{0, 0};
  while (::sigtimedwait(&pipe_signal, nullptr, &now) > 0) {
  }
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  ::close(out_pipe[0]), ::close(err_pipe[0]);
  if (timed_out) ::kill(-pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const std::string tail = err.size() > 2000 ? "..." + err.substr(err.size() - 2000) : err;
  const std::string said = tail.empty() ? "" : fmt::format("; its standard error ends:\n{}", tail);
  if (timed_out)
    throw Error(fmt::format("reward command '{}' did not finish within {} s (killed){}", command,
                            timeout_seconds, said));
  if (WIFSIGNALED(status))
    throw Error(fmt::format("reward command '{}' was killed by signal {}{}", command, WTERMSIG(status), said));
  if (WEXITSTATUS(status) != 0)
    throw Error(fmt::format("reward command '{}' exited with code {}{}", command, WEXITSTATUS(status), said));
  std::vector<double> rewards;
  size_t at = 0;
  for (size_t line = 1; at < out.size(); ++line) {
    const size_t end = std::min(out.find('\n', at), out.size());
    const std::string text(trim(std::string_view(out).substr(at, end - at)));
    at = end + 1;
    char* stop = nullptr;
    const double v = std::strtod(text.c_str(), &stop);
    if (text.empty() || stop != text.c_str() + text.size() || !std::isfinite(v))
      throw Error(fmt::format("reward command '{}': line {} of its output is '{}'; expected a finite number "
                              "(one reward per completion){}", command, line, text, said));
    rewards.push_back(v);
  }
  if (rewards.size() != queries.size())
    throw Error(fmt::format("reward command '{}' wrote {} rewards for {} completions{}", command,
                            rewards.size(), queries.size(), said));
  return rewards;
}

}  // namespace tessera
