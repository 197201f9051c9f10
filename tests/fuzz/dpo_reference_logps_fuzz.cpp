// A DPO run's reference log-probabilities beside its dataset (train/dpo_reference.h), as a run
// opens them: the input is the file, read for a dataset of 3 pairs, then written back and read
// again when it was accepted.
#include "fuzz/fuzz_support.h"
#include "tessera/train/dpo_reference.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path file = scratch_dir() / "pairs_reference.logps";
  write_file(file, as_text(data, size));
  const DpoReferenceKey key{"data/pairs", "00112233aabbccdd", 3, "the checkpoint ckpt/iter_0000010",
                            "8899aabbccddeeff", 64};
  refusal_or_success([&] {
    DpoReferenceLogps logps(file.string(), key);
    for (uint64_t pair = 0; pair < 3; ++pair)
      if (logps.has(pair)) logps.at(pair);
    logps.save();
    DpoReferenceLogps again(file.string(), key);
  });
  return 0;
}
