// Charts: axes and labels, SVG well-formed with the expected series and points (checked by
// Python's XML parser), PNG a valid zlib stream whose pixels are the rasterised chart.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "png_reader.h"
#include "tessera/viz/chart.h"
#include "tessera/viz/png.h"
#include "tessera/viz/raster.h"
#include "tessera/viz/svg.h"

namespace tessera::viz {
namespace {

namespace fs = std::filesystem;

std::string run_capture(const std::string& command) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << command << "\n" << out;
  return out;
}

Chart sample_chart() {
  Chart c;
  c.title = "Training loss <&>";
  c.x_label = "iteration";
  c.y_label = "lm loss";
  Series a{"llama \"a\"", {}, 0, false}, b{"qwen", {}, 1, false},
      v{"qwen (validation)", {}, 1, true};
  for (int i = 1; i <= 50; ++i) a.points.push_back({double(i), 6.0 * std::exp(-i / 20.0) + 2});
  for (int i = 1; i <= 7; ++i) b.points.push_back({10.0 * i, 5.0 - 0.3 * i});
  v.points = {{20, 4.6}, {40, 4.1}, {60, 3.5}};
  c.series = {a, b, v};
  return c;
}

TEST(Chart, NiceAxesAndLabels) {
  const Axis a = nice_axis(0.13, 9.7, 5);
  EXPECT_DOUBLE_EQ(a.lo, 0);
  EXPECT_DOUBLE_EQ(a.hi, 10);
  EXPECT_EQ(a.ticks.size(), 6u);  // 0, 2, ..., 10
  const Axis b = nice_axis(2.03, 5.61, 6);
  EXPECT_LE(b.lo, 2.03);
  EXPECT_GE(b.hi, 5.61);
  EXPECT_EQ(tick_label(52000, 10000), "52k");
  EXPECT_EQ(tick_label(2.5, 0.5), "2.5");
  EXPECT_EQ(tick_label(1200000, 200000), "1.2M");
  EXPECT_EQ(tick_label(0, 0.1), "0");
  EXPECT_EQ(tick_label(150, 50), "150");
  const Axis flat = nice_axis(3, 3, 5);  // one value still gets a range
  EXPECT_LT(flat.lo, 3);
  EXPECT_GT(flat.hi, 3);
}

TEST(Chart, CountAxesHaveWholeTicks) {
  // Iterations 1..3 would get ticks 0.2 apart; a count never goes below steps of 1.
  EXPECT_LT(nice_axis(1, 3, 8).ticks[1] - nice_axis(1, 3, 8).ticks[0], 1);
  for (const auto& [lo, hi] : {std::pair{1.0, 1.0}, {1.0, 3.0}, {1.0, 5.0}, {10.0, 17.0}}) {
    const Axis a = nice_axis(lo, hi, 8, 1);
    ASSERT_GE(a.ticks.size(), 2u) << lo << ".." << hi;
    EXPECT_LE(a.lo, lo);
    EXPECT_GE(a.hi, hi);
    for (double t : a.ticks) EXPECT_EQ(t, std::round(t)) << lo << ".." << hi;
    EXPECT_EQ(tick_label(a.ticks[1], a.ticks[1] - a.ticks[0]).find('.'), std::string::npos);
  }
  EXPECT_EQ(nice_axis(1, 5000, 8, 1).ticks, nice_axis(1, 5000, 8).ticks);  // long runs: as before
  Chart c;
  c.x_whole = true;
  c.series = {{"a", {{1, 2}, {2, 3}, {3, 1}}}};
  for (double t : layout_chart(c, 800, 450).x.ticks) EXPECT_EQ(t, std::round(t));
}

TEST(Chart, DecimationKeepsSpikes) {
  std::vector<Point> pts;
  for (int i = 0; i < 100000; ++i) pts.push_back({double(i), i == 51234 ? 100.0 : 1.0});
  const std::vector<Point> d = decimate(pts, 2000);
  EXPECT_LE(d.size(), 2000u);
  double peak = 0;
  for (const Point& p : d) peak = std::max(peak, p.y);
  EXPECT_EQ(peak, 100.0);
  for (size_t i = 1; i < d.size(); ++i) EXPECT_LT(d[i - 1].x, d[i].x);
}

TEST(Svg, WellFormedWithEverySeriesAndPoint) {
  const fs::path file =
      fs::temp_directory_path() / ("tessera_chart_" + std::to_string(getpid()) + ".svg");
  std::ofstream(file) << render_svg(sample_chart());
  // Python's XML parser rejects anything not well-formed (bad escaping, unclosed tags).
  const std::string script =
      "import sys, xml.etree.ElementTree as E\n"
      "r = E.parse(sys.argv[1]).getroot()\n"
      "ns = '{http://www.w3.org/2000/svg}'\n"
      "assert r.tag == ns + 'svg', r.tag\n"
      "s = [p for p in r.iter(ns + 'polyline') if p.get('class') == 'series']\n"
      "print(' '.join(str(len(p.get('points').split())) for p in s))\n"
      "print(sum(1 for _ in r.iter(ns + 'circle')))\n"
      "print([t.text for t in r.iter(ns + 'text') if t.get('class') == 'title'][0])\n";
  const std::string out =
      run_capture(std::string(TESSERA_PYTHON) + " -c \"" + script + "\" " + file.string());
  fs::remove(file);
  EXPECT_EQ(out, "50 7 3\n10\nTraining loss <&>\n");  // markers only on short series
}

TEST(Png, ValidStreamAndTheRasterisedPixels) {
  Chart c;
  c.title = "flat";
  c.series = {Series{"one", {{0, 0.5}, {10, 0.5}}, 2, false},
              Series{"low", {{0, 0}, {10, 0.2}}, 0, true}};
  const Image img = render_raster(c, 400, 300, 2);
  const std::vector<uint8_t> bytes = encode_png(img);
  const test::DecodedPng png = test::decode_png(bytes);  // CRCs, zlib stream, filters
  ASSERT_EQ(png.width, 800);
  ASSERT_EQ(png.height, 600);
  ASSERT_EQ(png.rgb, img.rgb);
  EXPECT_EQ(png.r(0, 0), 255);  // background
  // The flat series crosses the middle of the plot area in its palette colour.
  const ChartLayout l = layout_chart(c, 400, 300);
  const int x = static_cast<int>((l.left + l.right) / 2 * 2), y = static_cast<int>(l.py(0.5) * 2);
  const Rgb want = palette(2);
  EXPECT_EQ(png.r(x, y), want.r);
  EXPECT_EQ(png.g(x, y), want.g);
  EXPECT_EQ(png.b(x, y), want.b);
  // Title text is drawn (some dark pixels in the title band).
  int dark = 0;
  for (int yy = 0; yy < static_cast<int>(l.top * 2); ++yy)
    for (int xx = 0; xx < png.width; ++xx) dark += png.r(xx, yy) < 100;
  EXPECT_GT(dark, 20);
}

}  // namespace
}  // namespace tessera::viz
