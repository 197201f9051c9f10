#pragma once
// A line chart (series of (x, y) points over shared axes) and its layout in abstract units,
// which both renderers draw from: SVG (1 unit = 1 px) and the PNG rasteriser (1 unit =
// `scale` px). Keeping one layout means the two outputs show the same picture.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::viz {

struct Point {
  double x = 0, y = 0;
};

struct Series {
  std::string name;           // legend text
  std::vector<Point> points;  // sorted by x; non-finite points are skipped
  int color = 0;              // index into the palette: runs keep their colour across charts
  bool dashed = false;        // secondary series of a run (validation loss, allocated memory)
};

struct Chart {
  std::string title, x_label, y_label;
  std::vector<Series> series;
  bool y_from_zero = false;  // throughput and memory: include 0 so ratios read correctly
  bool x_whole = false;      // x counts something (iterations): ticks 1 apart at least
};

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};
// Colour-blind-safe palette (Okabe-Ito, without yellow); wraps around.
Rgb palette(int index);
std::string hex_color(Rgb c);  // "#0072b2"

struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
};

// "nice" ticks (1, 2, 5 x 10^k) covering [lo, hi], about `target` of them, never closer than
// `min_step` (1 for a count, so that a 3-iteration run has no tick at 1.5).
Axis nice_axis(double lo, double hi, int target, double min_step = 0);
// Tick label: "0.5", "120", "52k", "1.2M", "1e-05".
std::string tick_label(double v, double step);

struct LegendEntry {
  double x = 0, y = 0;  // left end of the swatch, vertical centre
  int series = 0;
};

// Layout constants and the mapping from data to chart units.
struct ChartLayout {
  static constexpr double kCharWidth = 6.5;  // average glyph advance of the body font
  static constexpr double kFontSize = 11;    // body text height (ticks, labels, legend)
  static constexpr double kTitleSize = 14;
  static constexpr double kSwatch = 22;  // legend line length

  double width = 800, height = 450;
  double left = 0, right = 0, top = 0, bottom = 0;  // the plot area
  Axis x, y;
  std::vector<LegendEntry> legend;

  double px(double v) const { return left + (v - x.lo) / (x.hi - x.lo) * (right - left); }
  double py(double v) const { return bottom - (v - y.lo) / (y.hi - y.lo) * (bottom - top); }
};

ChartLayout layout_chart(const Chart& chart, double width, double height);

// At most `max_points` points per series, keeping each bucket's minimum and maximum so that
// spikes survive (a 100k-iteration run stays a few thousand points).
std::vector<Point> decimate(const std::vector<Point>& points, size_t max_points);

}  // namespace tessera::viz
