#pragma once
// SIGINT/SIGTERM set a flag that the trainer polls between micro-batches (and between its
// set-up steps), so a stop request ends the run at a clean point (logs and metrics flushed)
// instead of mid-write. A second signal ends the process at once.
namespace tessera {

void install_stop_signal_handlers();
// The signal number received since installation (0 if none).
int pending_stop_signal();

}  // namespace tessera
