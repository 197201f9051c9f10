// A Hugging Face tokenizer.json, as `--tokenizer_model PATH` and `convert --tokenizer` load it:
// the input is the file; an accepted tokenizer encodes text (special tokens, Unicode, bytes
// that are not UTF-8) and decodes the ids back.
#include "fuzz/fuzz_support.h"
#include "tessera/data/bpe_tokenizer.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path file = scratch_dir() / "tokenizer.json";
  write_file(file, as_text(data, size));
  refusal_or_success([&] {
    const BpeTokenizer tokenizer(file.string(), "fuzz");
    std::vector<int32_t> ids;
    tokenizer.encode(
        "The jury said it's 1234 times <|end_of_text|>  caf\xc3\xa9 \xe2\x96\x81x \xff\xfe", &ids);
    tokenizer.decode(ids);
  });
  return 0;
}
