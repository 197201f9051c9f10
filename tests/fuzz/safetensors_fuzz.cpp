// A safetensors file as checkpoints and Hugging Face models are read (ckpt/safetensors.h):
// the input is the whole file. Every tensor an accepted header describes must lie inside it.
#include "fuzz/fuzz_support.h"
#include "tessera/ckpt/safetensors.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so that AddressSanitizer catches any read past the file.
  const std::vector<char> file(data, data + size);
  refusal_or_success([&] {
    const SafetensorsHeader header = parse_safetensors(file.data(), file.size(), "in.safetensors");
    for (const SafetensorsTensor& t : header.tensors) {
      const size_t bytes = t.nbytes();
      if (bytes == 0) continue;
      const char* begin = static_cast<const char*>(t.data);
      volatile char first = begin[0], last = begin[bytes - 1];
      (void)first;
      (void)last;
    }
  });
  return 0;
}
