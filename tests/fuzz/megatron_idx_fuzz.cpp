// A Megatron indexed dataset (data/indexed_dataset.h), as training and preprocessing open it.
// The input's first two bytes give the size of PREFIX.bin (filled with a byte pattern), the
// rest is PREFIX.idx. An accepted dataset has the start of each of its first sequences read.
#include <algorithm>

#include "fuzz/fuzz_support.h"
#include "tessera/data/indexed_dataset.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const fs::path dir = scratch_dir();
  const size_t bin_bytes = data[0] | (static_cast<size_t>(data[1]) << 8);
  std::string bin(bin_bytes, '\0');
  for (size_t i = 0; i < bin.size(); ++i) bin[i] = static_cast<char>(i * 7);
  write_file(dir / "d.bin", bin);
  write_file(dir / "d.idx", as_text(data + 2, size - 2));
  refusal_or_success([&] {
    const IndexedDataset ds((dir / "d").string(), /*vocab=*/256);
    std::vector<int32_t> tokens(64);
    for (uint64_t seq = 0; seq < std::min<uint64_t>(ds.sequences(), 4); ++seq) {
      const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(ds.sequence_length(seq)), 64);
      ds.read(seq, 0, n, tokens.data());
    }
    for (uint64_t d = 0; d <= std::min<uint64_t>(ds.documents(), 4); ++d) ds.document_start(d);
  });
  return 0;
}
