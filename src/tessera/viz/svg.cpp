#include "tessera/viz/svg.h"

#include <cmath>

#include <fmt/format.h>

#include "tessera/analysis/writers.h"

namespace tessera::viz {

using analysis::html_escape;
namespace {

constexpr size_t kMarkersUpTo = 40;  // short series also get a dot per point

std::string num(double v) {
  return fmt::format("{:.1f}", v);
}

}  // namespace

std::string render_svg(const Chart& chart, double width, double height) {
  const ChartLayout l = layout_chart(chart, width, height);
  using L = ChartLayout;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" viewBox=\"0 0 {0} {1}\" "
      "width=\"{0}\" height=\"{1}\" font-family=\"sans-serif\" font-size=\"{2}\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"#ffffff\"/>\n",
      num(width), num(height), L::kFontSize);
  s += fmt::format(
      "<text class=\"title\" x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" "
      "font-weight=\"bold\">{}</text>\n",
      num(width / 2), num(12 + L::kTitleSize), L::kTitleSize, html_escape(chart.title));

  const double xstep = l.x.ticks.size() > 1 ? l.x.ticks[1] - l.x.ticks[0] : 1;
  const double ystep = l.y.ticks.size() > 1 ? l.y.ticks[1] - l.y.ticks[0] : 1;
  s += "<g class=\"grid\" stroke=\"#e6e6e6\" stroke-width=\"1\">\n";
  for (double t : l.x.ticks)
    s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\"/>\n", num(l.px(t)),
                     num(l.top), num(l.bottom));
  for (double t : l.y.ticks)
    s += fmt::format("<line x1=\"{1}\" y1=\"{0}\" x2=\"{2}\" y2=\"{0}\"/>\n", num(l.py(t)),
                     num(l.left), num(l.right));
  s += "</g>\n";
  s += fmt::format(
      "<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
      "stroke=\"#888888\"/>\n",
      num(l.left), num(l.top), num(l.right - l.left), num(l.bottom - l.top));
  s += "<g class=\"ticks\" fill=\"#444444\">\n";
  for (double t : l.x.ticks)
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", num(l.px(t)),
                     num(l.bottom + 6 + L::kFontSize), html_escape(tick_label(t, xstep)));
  for (double t : l.y.ticks)
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", num(l.left - 6),
                     num(l.py(t) + L::kFontSize * 0.35), html_escape(tick_label(t, ystep)));
  s += "</g>\n";
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                   num((l.left + l.right) / 2), num(l.bottom + 12 + 2 * L::kFontSize),
                   html_escape(chart.x_label));
  s += fmt::format(
      "<text x=\"{0}\" y=\"{1}\" text-anchor=\"middle\" transform=\"rotate(-90 {0} {1})\">{2}"
      "</text>\n",
      num(12 + L::kFontSize), num((l.top + l.bottom) / 2), html_escape(chart.y_label));

  for (const Series& series : chart.series) {
    const std::string color = hex_color(palette(series.color));
    std::string points;
    size_t count = 0;
    for (const Point& p : series.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
      if (count++) points += ' ';
      points += fmt::format("{:.1f},{:.1f}", l.px(p.x), l.py(p.y));
    }
    s += fmt::format(
        "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{}\" "
        "stroke-width=\"2\" stroke-linejoin=\"round\"{} points=\"{}\"><title>{}</title>"
        "</polyline>\n",
        html_escape(series.name), color, series.dashed ? " stroke-dasharray=\"6 4\"" : "", points,
        html_escape(series.name));
    if (count > kMarkersUpTo) continue;
    for (const Point& p : series.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
      s += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"2.5\" fill=\"{}\"/>\n", num(l.px(p.x)),
                       num(l.py(p.y)), color);
    }
  }

  s += "<g class=\"legend\">\n";
  for (const LegendEntry& e : l.legend) {
    const Series& series = chart.series[e.series];
    s += fmt::format(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"{}/>\n"
        "<text x=\"{}\" y=\"{}\">{}</text>\n",
        num(e.x), num(e.y), num(e.x + L::kSwatch), num(e.y), hex_color(palette(series.color)),
        series.dashed ? " stroke-dasharray=\"6 4\"" : "", num(e.x + L::kSwatch + 6),
        num(e.y + L::kFontSize * 0.35), html_escape(series.name));
  }
  s += "</g>\n</svg>\n";
  return s;
}

}  // namespace tessera::viz
