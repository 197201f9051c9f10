// A plain-JSON trace (Chrome trace format, as Tessera and the PyTorch profiler write it): the
// input is the file.
#include "fuzz/trace_fuzz.h"

using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path file = scratch_dir() / "trace.json";
  write_file(file, as_text(data, size));
  report_trace(file);
  return 0;
}
