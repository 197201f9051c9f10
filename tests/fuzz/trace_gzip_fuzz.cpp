// A gzip-compressed trace (.json.gz). An input that starts with the gzip magic bytes is the file
// itself (a damaged or hostile stream for the inflater); any other input is the JSON, which
// is compressed first, so that the mutations of the trace reach the reader behind zlib.
#include <zlib.h>

#include "fuzz/trace_fuzz.h"

using namespace tessera::fuzz;

namespace {

std::string gzip(std::string_view text) {
  z_stream z{};
  deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, text.size()) + 32, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = as_text(data, size);
  const fs::path file = scratch_dir() / "trace.json.gz";
  const bool raw = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  write_file(file, raw ? std::string(input) : gzip(input));
  report_trace(file);
  return 0;
}
