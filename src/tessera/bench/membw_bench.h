#pragma once
// `tessera bench membw`: device-to-device copy bandwidth through the op API's copy(), counting
// the bytes read plus the bytes written, against the GPU's datasheet HBM bandwidth. Every copy
// is checked bit for bit (a small one against the CPU reference first).
#include <cstddef>
#include <string>
#include <vector>

#include "tessera/bench/measure.h"

namespace tessera::bench {

struct CopyResult {
  bool ok = false;
  std::string failure;
  Timing timing;
  double gbps = 0;  // 2 * bytes / median time (read + write)
  int sets = 0;
};

CopyResult run_copy(BenchContext& ctx, size_t bytes);

int membw_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
