// metrics.jsonl across a killed run: a record the kill cut short stays on a line of its own, so
// the resumed run's first record is whole, not glued to the fragment and lost.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "common/scratch_dir.h"
#include "common/tiny_run.h"
#include "tessera/obs/metrics.h"

namespace tessera::testing {
namespace {

TEST(MetricsWriter, ARunAfterAKilledOneStartsOnALineOfItsOwn) {
  ScratchDir dir;
  const std::string path = (dir / "metrics.jsonl").string();
  {
    MetricsWriter first(path, "a");
    first.write({{"iteration", 1}, {"lm_loss", 2.5}});
  }
  std::ofstream(path, std::ios::app) << R"({"iteration": 2, "lm_lo)";  // the kill
  {
    MetricsWriter resumed(path, "b");
    resumed.write({{"iteration", 2}, {"lm_loss", 2.25}});
  }
  std::ifstream in(path);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  EXPECT_NE(text.find("\n{\"iteration\":2,\"lm_loss\":2.25,\"run_id\":\"b\"}\n"), std::string::npos) << text;
  const auto lines = metrics_lines(dir / "metrics.jsonl");  // the fragment skipped
  ASSERT_EQ(lines.size(), 2u) << text;
  EXPECT_EQ(lines[1]["lm_loss"].get<double>(), 2.25);

  // A file that ends a line gets no empty one.
  { MetricsWriter again(path, "c"); }
  std::ifstream after(path);
  const std::string unchanged{std::istreambuf_iterator<char>(after), {}};
  EXPECT_EQ(unchanged, text);
}

}  // namespace
}  // namespace tessera::testing
