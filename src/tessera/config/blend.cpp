#include "tessera/config/blend.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

std::vector<BlendEntry> parse_blend(const std::string& text, const std::string& key,
                                    const std::string& origin) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string w; in >> w;) words.push_back(w);
  // Prefixes are the words at odd positions of "w1 p1 w2 p2 ...", or the one word.
  for (size_t i = words.size() == 1 ? 0 : 1; i < words.size(); i += 2)
    if (words[i].ends_with(".bin") || words[i].ends_with(".idx"))
      throw ConfigError(
          origin, key, text,
          fmt::format("dataset prefixes without the .bin/.idx extension, got '{}'", words[i]));
  if (words.size() == 1) return {BlendEntry{1.0, words[0]}};
  if (words.empty() || words.size() % 2 != 0)
    throw ConfigError(origin, key, text,
                      fmt::format("a data prefix, or pairs of weight and prefix "
                                  "(\"0.7 prefixA 0.3 prefixB\"); got {} words",
                                  words.size()));
  std::vector<BlendEntry> blend;
  double total = 0;
  for (size_t i = 0; i < words.size(); i += 2) {
    char* end = nullptr;
    const double w = std::strtod(words[i].c_str(), &end);
    if (*end != '\0' || !std::isfinite(w) || !(w > 0))
      throw ConfigError(origin, key, text,
                        fmt::format("a positive number as the weight of prefix '{}', got '{}'",
                                    words[i + 1], words[i]));
    blend.push_back({w, words[i + 1]});
    total += w;
  }
  for (auto& b : blend) b.weight /= total;
  return blend;
}

bool is_text_corpus_path(const std::string& train_data_path) {
  // PREFIX.bin or PREFIX.idx given for PREFIX is a blend, which parse_blend then rejects.
  const std::string ext = std::filesystem::path(train_data_path).extension().string();
  std::error_code ec;  // a name the file system refuses is no corpus
  return std::filesystem::exists(train_data_path, ec) && ext != ".bin" && ext != ".idx";
}

}  // namespace tessera
