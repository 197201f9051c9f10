#pragma once
#include <string>
#include <vector>

namespace tessera::bench {

// `tessera bench comm`: NCCL collectives over a size sweep, checked then timed, with
// nccl-tests' algorithm and bus bandwidth. Runs as one rank of `tessera launch` (or alone).
int comm_bench_command(const std::vector<std::string>& args);

// nccl-tests' bus bandwidth factor of a collective on n ranks: all_reduce 2(n-1)/n,
// all_gather / reduce_scatter / all_to_all (n-1)/n, broadcast 1.
double bus_bandwidth_factor(const std::string& collective, int n);

}  // namespace tessera::bench
