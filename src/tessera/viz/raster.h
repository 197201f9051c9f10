#pragma once
// A minimal software rasteriser for the PNG charts: an RGB image, thick (optionally dashed)
// lines, rectangles and bitmap text, and the chart drawn from the same layout as the SVG.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/viz/chart.h"

namespace tessera::viz {

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel

  Image(int w, int h, Rgb fill);
  void set(int x, int y, Rgb c);  // ignores pixels outside the image
};

enum class Anchor { Start, Middle, End };

// Drawing in pixel coordinates.
void fill_rect(Image& img, double x0, double y0, double x1, double y1, Rgb c);
// A line of `thickness` px through the points; dash > 0 draws dash px on, dash * 2/3 off.
void draw_polyline(Image& img, const std::vector<Point>& points, Rgb c, double thickness,
                   double dash = 0);
// Bitmap text with its baseline at y; `dot` px per font dot; vertical reads bottom to top.
void draw_text(Image& img, double x, double y, const std::string& text, Rgb c, int dot,
               Anchor anchor, bool vertical = false);

// The chart at `scale` pixels per layout unit (2 gives crisp text on high-density screens).
Image render_raster(const Chart& chart, double width, double height, int scale);

}  // namespace tessera::viz
