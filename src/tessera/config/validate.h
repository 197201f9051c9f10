#pragma once
#include "tessera/config/config.h"

namespace tessera {

// Cross-key checks (divisibility, ranges, impossible combinations). Throws ConfigError
// naming the file or command line that set the offending key.
// world_size: the ranks of the job, which tensor, pipeline and context parallelism divide.
void validate_experiment(const Experiment& e, int world_size);

}  // namespace tessera
