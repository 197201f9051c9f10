#pragma once
// A strict PNG reader for the tests: checks the signature and every chunk's CRC, inflates the
// IDAT stream (zlib verifies its Adler-32), undoes all five scanline filters and returns RGB
// pixels. 8-bit RGB and RGBA only, no interlace: what our writer and Chromium's screenshots
// produce.
#include <zlib.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessera::viz::test {

struct DecodedPng {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  int r(int x, int y) const { return rgb[(static_cast<size_t>(y) * width + x) * 3]; }
  int g(int x, int y) const { return rgb[(static_cast<size_t>(y) * width + x) * 3 + 1]; }
  int b(int x, int y) const { return rgb[(static_cast<size_t>(y) * width + x) * 3 + 2]; }
};

inline uint32_t be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3];
}

inline DecodedPng decode_png(const std::vector<uint8_t>& png) {
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (png.size() < 8 || !std::equal(kSignature, kSignature + 8, png.begin()))
    throw std::runtime_error("not a PNG signature");
  DecodedPng img;
  int color_type = -1;
  std::vector<uint8_t> idat;
  bool ended = false;
  for (size_t at = 8; at + 12 <= png.size() && !ended;) {
    const uint32_t len = be32(&png[at]);
    if (at + 12 + len > png.size()) throw std::runtime_error("truncated chunk");
    const std::string type(png.begin() + at + 4, png.begin() + at + 8);
    const uint8_t* data = &png[at + 8];
    const uLong crc = crc32(0L, &png[at + 4], len + 4);
    if (crc != be32(data + len)) throw std::runtime_error("bad CRC in chunk " + type);
    if (type == "IHDR") {
      img.width = static_cast<int>(be32(data));
      img.height = static_cast<int>(be32(data + 4));
      color_type = data[9];
      if (data[8] != 8 || (color_type != 2 && color_type != 6) || data[12] != 0)
        throw std::runtime_error("unsupported PNG format");
    } else if (type == "IDAT") {
      idat.insert(idat.end(), data, data + len);
    } else if (type == "IEND") {
      ended = true;
    }
    at += 12 + len;
  }
  if (!ended || color_type < 0) throw std::runtime_error("missing IHDR or IEND");
  const int channels = color_type == 6 ? 4 : 3;
  const size_t stride = static_cast<size_t>(img.width) * channels;
  std::vector<uint8_t> raw((stride + 1) * img.height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, idat.data(), idat.size()) != Z_OK || raw_size != raw.size())
    throw std::runtime_error("IDAT is not a complete zlib stream of the image size");

  std::vector<uint8_t> prev(stride, 0), cur(stride);
  img.rgb.resize(static_cast<size_t>(img.width) * img.height * 3);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = raw[y * (stride + 1)];
    const uint8_t* in = &raw[y * (stride + 1) + 1];
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= static_cast<size_t>(channels) ? cur[i - channels] : 0;
      const int b = prev[i];
      const int c = i >= static_cast<size_t>(channels) ? prev[i - channels] : 0;
      int pred = 0;
      switch (filter) {
        case 0:
          pred = 0;
          break;
        case 1:
          pred = a;
          break;
        case 2:
          pred = b;
          break;
        case 3:
          pred = (a + b) / 2;
          break;
        case 4: {
          const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
          pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
          break;
        }
        default:
          throw std::runtime_error("bad filter type");
      }
      cur[i] = static_cast<uint8_t>(in[i] + pred);
    }
    for (int x = 0; x < img.width; ++x)
      for (int k = 0; k < 3; ++k)
        img.rgb[(static_cast<size_t>(y) * img.width + x) * 3 + k] = cur[x * channels + k];
    std::swap(prev, cur);
  }
  return img;
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace tessera::viz::test
