// The command line of `tessera train`: the input is its arguments, one per line, read as
// configuration overrides over a small experiment (the option syntax every command shares,
// core/command_line.h, then the loader's keys, values and validation).
#include "fuzz/fuzz_support.h"
#include "tessera/config/config.h"
#include "tessera/core/command_line.h"

using namespace tessera;
using namespace tessera::fuzz;

namespace {

const fs::path& base_experiment() {
  static const fs::path file = [] {
    const fs::path f = scratch_dir() / "base.yaml";
    write_file(f,
               "model: tiny_llama\nmock_data: true\nvocab_size: 64\nnum_layers: 2\n"
               "hidden_size: 32\nseq_length: 16\nmicro_batch_size: 2\nglobal_batch_size: 4\n"
               "train_iters: 4\nlr_warmup_iters: 1\neval_interval: 0\ndevice: cpu\n");
    return f;
  }();
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args;
  for (std::string_view arg : split(as_text(data, size), "\n", 64)) {
    parse_command_line_option(arg);
    args.emplace_back(arg);
  }
  LoadOptions options;
  options.config_path = base_experiment().string();
  options.cli_overrides = args;
  refusal_or_success([&] { load_experiment(options); });
  return 0;
}
