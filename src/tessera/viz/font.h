#pragma once
// A 5x8 bitmap font for printable ASCII, drawn for the PNG charts (SVG text is left to the
// viewer's fonts). Rows top to bottom; bit 4 is the leftmost column. Capitals and digits use
// rows 0-6 (the baseline is under row 6); descenders reach row 7.
#include <cstdint>

namespace tessera::viz {

inline constexpr int kGlyphWidth = 5, kGlyphHeight = 8, kGlyphAdvance = 6;

// The 8 rows of `c`; characters outside ' '..'~' draw as '?'.
const uint8_t* glyph(char c);

}  // namespace tessera::viz
