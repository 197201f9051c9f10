#include "tessera/train/stop_signal.h"

#include <csignal>

namespace tessera {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  // A second signal while stopping means "now": end the process as the default action
  // would (raise is async-signal-safe, and the shell sees 128 + sig).
  if (g_stop_signal) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int pending_stop_signal() {
  return g_stop_signal;
}

}  // namespace tessera
