#pragma once
// SIGINT/SIGTERM set a flag that the trainer polls between micro-batches, so a stop
// request ends the run at a clean point (logs and metrics flushed) instead of mid-write.
namespace tessera {

void install_stop_signal_handlers();
// The signal number received since installation (0 if none).
int pending_stop_signal();

}  // namespace tessera
