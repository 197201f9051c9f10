#pragma once
// Charts as SVG written by hand: a standalone document that also works inline in HTML. Each
// series is one <polyline class="series"> (with a <title> for a hover tooltip), so tests and
// scripts can find the data in the markup.
#include <string>

#include "tessera/viz/chart.h"

namespace tessera::viz {

std::string render_svg(const Chart& chart, double width = 800, double height = 450);

}  // namespace tessera::viz
