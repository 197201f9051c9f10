#include "tessera/viz/chart.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace tessera::viz {

Rgb palette(int index) {
  static constexpr Rgb kColors[] = {{0x00, 0x72, 0xb2}, {0xd5, 0x5e, 0x00}, {0x00, 0x9e, 0x73},
                                    {0xcc, 0x79, 0xa7}, {0x56, 0xb4, 0xe9}, {0xe6, 0x9f, 0x00},
                                    {0x33, 0x33, 0x33}};
  constexpr int n = sizeof(kColors) / sizeof(kColors[0]);
  return kColors[((index % n) + n) % n];
}

std::string hex_color(Rgb c) {
  return fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b);
}

Axis nice_axis(double lo, double hi, int target, double min_step) {
  if (!(hi > lo)) {  // one value (or none): a unit-wide range around it
    const double pad = lo != 0 ? std::fabs(lo) * 0.1 : 1.0;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = std::max((norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag, min_step);
  Axis a;
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  for (int i = 0;; ++i) {
    const double t = a.lo + i * step;
    if (t > a.hi + step * 1e-6) break;
    a.ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  }
  return a;
}

std::string tick_label(double v, double step) {
  if (v == 0) return "0";
  const double big = std::max(std::fabs(v), step);
  double div = 1;
  const char* suffix = "";
  if (big >= 1e6 && step >= 1e5) {
    div = 1e6, suffix = "M";
  } else if (big >= 1e4 && step >= 1e3) {
    div = 1e3, suffix = "k";
  }
  const double s = step / div;
  if (s < 1e-4) return fmt::format("{:.1e}", v);
  const int decimals = s >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(s) - 1e-9));
  return fmt::format("{:.{}f}{}", v / div, decimals, suffix);
}

ChartLayout layout_chart(const Chart& chart, double width, double height) {
  ChartLayout l;
  l.width = width;
  l.height = height;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  double ymin = xmin, ymax = -xmin;
  for (const Series& s : chart.series) {
    for (const Point& p : s.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
      xmin = std::min(xmin, p.x), xmax = std::max(xmax, p.x);
      ymin = std::min(ymin, p.y), ymax = std::max(ymax, p.y);
    }
  }
  if (!std::isfinite(xmin)) xmin = 0, xmax = 1, ymin = 0, ymax = 1;  // no data: empty axes
  if (chart.y_from_zero) ymin = std::min(ymin, 0.0), ymax = std::max(ymax, 0.0);
  l.x = nice_axis(xmin, xmax, 8, chart.x_whole ? 1 : 0);
  l.y = nice_axis(ymin, ymax, 6);

  size_t tick_chars = 1;
  const double ystep = l.y.ticks.size() > 1 ? l.y.ticks[1] - l.y.ticks[0] : 1;
  for (double t : l.y.ticks) tick_chars = std::max(tick_chars, tick_label(t, ystep).size());
  const double margin = 12;
  l.left = margin + ChartLayout::kFontSize + 10 + tick_chars * ChartLayout::kCharWidth + 6;
  l.right = width - 20;
  l.top = margin + ChartLayout::kTitleSize + 14;

  // Legend entries flow left to right under the x-axis label, wrapping at the right edge.
  const double row_height = 16;
  double x = l.left, row = 0;
  for (size_t i = 0; i < chart.series.size(); ++i) {
    const double w =
        ChartLayout::kSwatch + 6 + chart.series[i].name.size() * ChartLayout::kCharWidth + 18;
    if (x > l.left && x + w > l.right) x = l.left, row += 1;
    l.legend.push_back({x, row, static_cast<int>(i)});
    x += w;
  }
  const double legend_height = chart.series.empty() ? 0 : (row + 1) * row_height;
  l.bottom = height - margin - legend_height - 2 * ChartLayout::kFontSize - 24;
  for (LegendEntry& e : l.legend)
    e.y = l.bottom + 2 * ChartLayout::kFontSize + 28 + e.y * row_height;
  return l;
}

std::vector<Point> decimate(const std::vector<Point>& points, size_t max_points) {
  if (points.size() <= max_points || max_points < 4) return points;
  const size_t buckets = max_points / 2;
  std::vector<Point> out;
  out.reserve(max_points);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t begin = b * points.size() / buckets, end = (b + 1) * points.size() / buckets;
    size_t lo = begin, hi = begin;
    for (size_t i = begin; i < end; ++i) {
      if (points[i].y < points[lo].y) lo = i;
      if (points[i].y > points[hi].y) hi = i;
    }
    out.push_back(points[std::min(lo, hi)]);
    if (lo != hi) out.push_back(points[std::max(lo, hi)]);
  }
  return out;
}

}  // namespace tessera::viz
