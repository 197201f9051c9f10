#include "tessera/viz/raster.h"

#include <algorithm>
#include <cmath>

#include "tessera/viz/font.h"

namespace tessera::viz {
namespace {

constexpr Rgb kWhite{255, 255, 255}, kText{0x22, 0x22, 0x22}, kTicks{0x44, 0x44, 0x44};
constexpr Rgb kGrid{0xe6, 0xe6, 0xe6}, kFrame{0x88, 0x88, 0x88};
constexpr size_t kMarkersUpTo = 40;  // as in the SVG

// A filled disc of radius r centred at (x, y): the pen of thick lines and markers.
void stamp(Image& img, double x, double y, double r, Rgb c) {
  for (int py = static_cast<int>(std::floor(y - r)); py <= static_cast<int>(std::ceil(y + r)); ++py)
    for (int px = static_cast<int>(std::floor(x - r)); px <= static_cast<int>(std::ceil(x + r));
         ++px) {
      const double dx = px + 0.5 - x, dy = py + 0.5 - y;
      if (dx * dx + dy * dy <= r * r + 0.25) img.set(px, py, c);
    }
}

}  // namespace

Image::Image(int w, int h, Rgb fill) : width(w), height(h), rgb(static_cast<size_t>(w) * h * 3) {
  for (size_t i = 0; i < rgb.size(); i += 3)
    rgb[i] = fill.r, rgb[i + 1] = fill.g, rgb[i + 2] = fill.b;
}

void Image::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width || y >= height) return;
  const size_t i = (static_cast<size_t>(y) * width + x) * 3;
  rgb[i] = c.r, rgb[i + 1] = c.g, rgb[i + 2] = c.b;
}

void fill_rect(Image& img, double x0, double y0, double x1, double y1, Rgb c) {
  const int xa = static_cast<int>(std::lround(std::min(x0, x1)));
  const int xb = static_cast<int>(std::lround(std::max(x0, x1)));
  const int ya = static_cast<int>(std::lround(std::min(y0, y1)));
  const int yb = static_cast<int>(std::lround(std::max(y0, y1)));
  for (int y = ya; y < std::max(yb, ya + 1); ++y)
    for (int x = xa; x < std::max(xb, xa + 1); ++x) img.set(x, y, c);
}

void draw_polyline(Image& img, const std::vector<Point>& points, Rgb c, double thickness,
                   double dash) {
  const double r = thickness / 2, period = dash * 5 / 3;
  if (points.size() == 1) stamp(img, points[0].x, points[0].y, r, c);
  double travelled = 0;  // carries the dash phase across segments
  for (size_t i = 1; i < points.size(); ++i) {
    const Point a = points[i - 1], b = points[i];
    const double len = std::hypot(b.x - a.x, b.y - a.y);
    const int steps = std::max(1, static_cast<int>(std::ceil(len)));
    for (int s = 0; s <= steps; ++s) {
      const double t = static_cast<double>(s) / steps;
      if (dash <= 0 || std::fmod(travelled + t * len, period) < dash)
        stamp(img, a.x + t * (b.x - a.x), a.y + t * (b.y - a.y), r, c);
    }
    travelled += len;
  }
}

void draw_text(Image& img, double x, double y, const std::string& text, Rgb c, int dot,
               Anchor anchor, bool vertical) {
  const double width = (static_cast<double>(text.size()) * kGlyphAdvance - 1) * dot;
  const double start = anchor == Anchor::Start ? 0 : anchor == Anchor::Middle ? width / 2 : width;
  const double top = -(kGlyphHeight - 1) * dot;  // glyph row 0 relative to the baseline
  for (size_t i = 0; i < text.size(); ++i) {
    const uint8_t* rows = glyph(text[i]);
    for (int row = 0; row < kGlyphHeight; ++row)
      for (int col = 0; col < kGlyphWidth; ++col) {
        if (!(rows[row] >> (kGlyphWidth - 1 - col) & 1)) continue;
        const double along = (static_cast<double>(i) * kGlyphAdvance + col) * dot - start;
        const double across = top + row * dot;
        // Vertical text is the horizontal text turned 90 degrees counter-clockwise.
        const double px = vertical ? x + across : x + along;
        const double py = vertical ? y - along - dot : y + across;
        fill_rect(img, px, py, px + dot, py + dot, c);
      }
  }
}

Image render_raster(const Chart& chart, double width, double height, int scale) {
  const ChartLayout l = layout_chart(chart, width, height);
  using L = ChartLayout;
  const double k = scale;
  const double hair = std::max(1, scale / 2);
  Image img(static_cast<int>(width * k), static_cast<int>(height * k), kWhite);

  for (double t : l.x.ticks)
    fill_rect(img, l.px(t) * k, l.top * k, l.px(t) * k + hair, l.bottom * k, kGrid);
  for (double t : l.y.ticks)
    fill_rect(img, l.left * k, l.py(t) * k, l.right * k, l.py(t) * k + hair, kGrid);
  fill_rect(img, l.left * k, l.top * k, l.right * k, l.top * k + hair, kFrame);
  fill_rect(img, l.left * k, l.bottom * k, l.right * k + hair, l.bottom * k + hair, kFrame);
  fill_rect(img, l.left * k, l.top * k, l.left * k + hair, l.bottom * k, kFrame);
  fill_rect(img, l.right * k, l.top * k, l.right * k + hair, l.bottom * k, kFrame);

  draw_text(img, width / 2 * k, (12 + L::kTitleSize) * k, chart.title, kText, scale + scale / 2,
            Anchor::Middle);
  const double xstep = l.x.ticks.size() > 1 ? l.x.ticks[1] - l.x.ticks[0] : 1;
  const double ystep = l.y.ticks.size() > 1 ? l.y.ticks[1] - l.y.ticks[0] : 1;
  for (double t : l.x.ticks)
    draw_text(img, l.px(t) * k, (l.bottom + 6 + L::kFontSize) * k, tick_label(t, xstep), kTicks,
              scale, Anchor::Middle);
  for (double t : l.y.ticks)
    draw_text(img, (l.left - 6) * k, (l.py(t) + L::kFontSize * 0.35) * k, tick_label(t, ystep),
              kTicks, scale, Anchor::End);
  draw_text(img, (l.left + l.right) / 2 * k, (l.bottom + 12 + 2 * L::kFontSize) * k, chart.x_label,
            kText, scale, Anchor::Middle);
  draw_text(img, (12 + L::kFontSize) * k, (l.top + l.bottom) / 2 * k, chart.y_label, kText, scale,
            Anchor::Middle, true);

  for (const Series& s : chart.series) {
    std::vector<Point> px;
    for (const Point& p : s.points)
      if (std::isfinite(p.x) && std::isfinite(p.y)) px.push_back({l.px(p.x) * k, l.py(p.y) * k});
    const Rgb c = palette(s.color);
    draw_polyline(img, px, c, 2 * k, s.dashed ? 6 * k : 0);
    if (px.size() <= kMarkersUpTo)
      for (const Point& p : px) stamp(img, p.x, p.y, 2.5 * k, c);
  }
  for (const LegendEntry& e : l.legend) {
    const Series& s = chart.series[e.series];
    draw_polyline(img, {{e.x * k, e.y * k}, {(e.x + L::kSwatch) * k, e.y * k}}, palette(s.color),
                  2 * k, s.dashed ? 6 * k : 0);
    draw_text(img, (e.x + L::kSwatch + 6) * k, (e.y + L::kFontSize * 0.35) * k, s.name, kText,
              scale, Anchor::Start);
  }
  return img;
}

}  // namespace tessera::viz
