#pragma once
#include "tessera/config/config.h"

namespace tessera {

// Cross-key checks (divisibility, ranges, impossible combinations). Throws ConfigError
// naming the file or command line that set the offending key.
void validate_experiment(const Experiment& e, int data_parallel_size);

}  // namespace tessera
