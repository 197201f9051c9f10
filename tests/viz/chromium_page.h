#pragma once
// A page as headless Chromium lays it out: a probe script measures the laid-out DOM and
// Chromium's --dump-dom hands its answer back; a screenshot shows the same page to a person.
// The report page has no scripts of its own, so the probe runs in a copy of it (a script
// appended to the body runs after everything above it is in the DOM, and reading layout
// properties lays the page out first). Only local files are opened, nothing is installed.
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "png_reader.h"

namespace tessera::viz::test {

struct ProbedPage {
  nlohmann::json probe;  // what the probe expression evaluated to; null when it did not run
  std::string output;    // Chromium's output, for failure messages
  DecodedPng screenshot;
};

inline std::string chromium_command(const std::filesystem::path& profile, int width, int height) {
  // Flags that keep a headless Chromium off the network; --no-sandbox because tests run as root.
  return "timeout 180 chromium --headless --no-sandbox --disable-gpu --disable-quic "
         "--no-first-run --disable-background-networking --disable-component-update "
         "--disable-sync --enable-logging=stderr --v=0 --user-data-dir=" +
         profile.string() + " --window-size=" + std::to_string(width) + "," +
         std::to_string(height) + " ";
}

// --dump-dom escapes attribute values (& " and non-breaking spaces, and < > in older
// versions); the probe's JSON needs them back.
inline std::string unescape_attribute(const std::string& s) {
  static const std::pair<std::string, std::string> kEntities[] = {
      {"&quot;", "\""}, {"&lt;", "<"},        {"&gt;", ">"},
      {"&#39;", "'"},   {"&nbsp;", "\u00a0"}, {"&amp;", "&"}};
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    bool replaced = false;
    for (const auto& [entity, text] : kEntities) {
      if (s.compare(i, entity.size(), entity) == 0) {
        out += text;
        i += entity.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += s[i];
  }
  return out;
}

// Opens `page` in a `width` x `height` window: evaluates the JavaScript function body
// `probe_body` (it returns a JSON-serialisable value) in a copy of the page, and saves a
// screenshot of the page itself to `screenshot`.
inline ProbedPage probe_page(const std::filesystem::path& page, const std::string& probe_body,
                             int width, int height, const std::filesystem::path& screenshot) {
  namespace fs = std::filesystem;
  ProbedPage result;
  const fs::path dir = screenshot.parent_path();
  const fs::path copy = dir / (page.stem().string() + ".probe.html");
  std::ifstream in(page);
  std::string html{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const size_t body_end = html.rfind("</body>");
  if (body_end == std::string::npos) {
    ADD_FAILURE() << page << " has no </body>";
    return result;
  }
  html.insert(body_end,
              "<script>document.documentElement.setAttribute('data-probe', "
              "JSON.stringify((() => {" +
                  probe_body + "})()));</script>\n");
  std::ofstream(copy) << html;

  const std::string chromium = chromium_command(dir / "chromium-profile", width, height);
  const testing::RunResult dom =
      testing::run_command(chromium + "--dump-dom file://" + fs::absolute(copy).string());
  result.output = dom.output;
  EXPECT_EQ(dom.exit_code, 0) << dom.output;
  EXPECT_EQ(dom.output.find("Uncaught"), std::string::npos) << dom.output;  // probe errors
  const std::string marker = "data-probe=\"";
  const size_t at = dom.output.find(marker);
  if (at == std::string::npos) {
    ADD_FAILURE() << "the probe did not run:\n" << dom.output;
  } else {
    const size_t begin = at + marker.size(), end = dom.output.find('"', begin);
    result.probe = nlohmann::json::parse(unescape_attribute(dom.output.substr(begin, end - begin)),
                                         nullptr, false);
    EXPECT_FALSE(result.probe.is_discarded()) << dom.output.substr(begin, end - begin);
  }

  const testing::RunResult shot = testing::run_command(
      chromium + "--screenshot=" + screenshot.string() + " file://" + fs::absolute(page).string());
  EXPECT_EQ(shot.exit_code, 0) << shot.output;
  if (fs::exists(screenshot)) {
    result.screenshot = decode_png(read_file(screenshot.string()));
    EXPECT_EQ(result.screenshot.width, width);
  } else {
    ADD_FAILURE() << "no screenshot at " << screenshot << ":\n" << shot.output;
  }
  return result;
}

}  // namespace tessera::viz::test
