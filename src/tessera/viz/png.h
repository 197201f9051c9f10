#pragma once
// PNG encoding of an RGB image (8 bits per channel, no interlace, one zlib stream), so that
// charts need no image library.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "tessera/viz/raster.h"

namespace tessera::viz {

std::vector<uint8_t> encode_png(const Image& image);
// Throws DataError when the file cannot be written.
void write_png(const Image& image, const std::filesystem::path& file);

}  // namespace tessera::viz
