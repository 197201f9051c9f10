#include "tessera/data/text_corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace fs = std::filesystem;
namespace {

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open for reading", p.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool is_brown_file_name(const std::string& name) {
  // ca01 ... cr09: category letter and two digits.
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' &&
         std::isdigit(static_cast<unsigned char>(name[2])) &&
         std::isdigit(static_cast<unsigned char>(name[3]));
}

bool attaches_left(std::string_view w) {
  return w == "." || w == "," || w == ";" || w == ":" || w == "?" || w == "!" || w == ")" ||
         w == "''" || w == "'" || w == "'s" || w == "n't";
}

std::string normalise_document(std::string text) {
  text.erase(std::remove(text.begin(), text.end(), '\r'), text.end());
  return text;
}

}  // namespace

bool looks_like_brown(std::string_view text) {
  // Most whitespace-separated tokens of a tagged file contain a '/' followed by a tag.
  size_t tokens = 0, tagged = 0, pos = 0;
  while (pos < text.size() && tokens < 200) {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
    const size_t start = pos;
    while (pos < text.size() && !std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
    if (pos == start) break;
    const std::string_view tok = text.substr(start, pos - start);
    ++tokens;
    const size_t slash = tok.rfind('/');
    if (slash != std::string_view::npos && slash > 0 && slash + 1 < tok.size()) ++tagged;
  }
  return tokens >= 5 && tagged * 10 >= tokens * 9;
}

std::string brown_to_text(std::string_view tagged) {
  std::string out;
  std::istringstream lines{std::string(tagged)};
  std::string line;
  bool quote_open = false;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tok, sentence;
    bool glue_next = false;
    while (words >> tok) {
      const size_t slash = tok.rfind('/');
      std::string w = slash == std::string::npos || slash == 0 ? tok : tok.substr(0, slash);
      // Brown's `` and '' quotes become plain double quotes.
      if (w == "``" || w == "''") {
        quote_open = w == "``";
        w.assign(1, '"');
      }
      const bool left = attaches_left(tok.substr(0, slash)) && !sentence.empty();
      if (!sentence.empty() && !left && !glue_next) sentence += ' ';
      sentence += w;
      glue_next = w == "(" || (w == "\"" && quote_open);
    }
    if (!sentence.empty()) out += sentence + "\n";
  }
  return out;
}

std::vector<std::string> list_text_files(const std::string& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file()) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  const bool brown_dir = std::any_of(files.begin(), files.end(), [](const fs::path& p) {
    return is_brown_file_name(p.filename().string());
  });
  std::vector<std::string> out;
  for (const auto& f : files) {
    // In the Brown distribution only the cXNN files are text; the rest is metadata.
    const bool text = brown_dir ? is_brown_file_name(f.filename().string())
                                : f.extension() == ".txt" || f.extension() == ".text";
    if (text) out.push_back(f.string());
  }
  if (out.empty())
    throw DataError(fmt::format(
        "{}: no text documents found (expected Brown corpus files ca01..cr09 or *.txt files)",
        dir));
  return out;
}

std::string read_text_document(const std::string& file) {
  std::string text = normalise_document(read_all(file));
  return looks_like_brown(text) ? brown_to_text(text) : text;
}

std::vector<std::string> load_text_documents(const std::string& path) {
  std::vector<std::string> docs;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const std::string& f : list_text_files(path)) {
      std::string text = read_text_document(f);
      if (!text.empty()) docs.push_back(std::move(text));
    }
    if (docs.empty()) throw DataError(fmt::format("{}: the text files hold no text", path));
    return docs;
  }
  if (!fs::is_regular_file(path, ec))
    throw DataError(fmt::format("{}: no such file or directory (train_data_path)", path));
  const std::string text = read_text_document(path);
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    if (end > start) docs.push_back(text.substr(start, end - start));
    start = end + 2;
  }
  if (docs.empty()) throw DataError(fmt::format("{}: the file holds no text", path));
  return docs;
}

}  // namespace tessera
