// Experiment YAML with `extends:`, as `tessera train --config` loads it. The input is up to four
// files, separated by lines "---8<---": the first is the experiment (f0.yaml), the others
// f1.yaml to f3.yaml, which its extends: (or theirs) can name.
#include "fuzz/fuzz_support.h"
#include "tessera/config/config.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = fresh_dir("config");
  const auto files = split(as_text(data, size), "\n---8<---\n", 4);
  for (size_t i = 0; i < files.size(); ++i)
    write_file(dir / ("f" + std::to_string(i) + ".yaml"), files[i]);
  LoadOptions options;
  options.config_path = (dir / "f0.yaml").string();
  refusal_or_success([&] { load_experiment(options); });
  return 0;
}
