// `tessera preprocess` on JSON lines: the input is the .jsonl file, tokenized with the
// byte-level tokenizer into an indexed dataset under the scratch directory.
#include "fuzz/fuzz_support.h"
#include "tessera/data/preprocess.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = fresh_dir("preprocess");
  write_file(dir / "in.jsonl", as_text(data, size));
  PreprocessOptions options;
  options.inputs = {(dir / "in.jsonl").string()};
  options.output_prefix = (dir / "out" / "p").string();
  options.workers = 1;
  refusal_or_success([&] { preprocess(options); });
  return 0;
}
