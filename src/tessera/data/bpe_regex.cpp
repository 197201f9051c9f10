#include "tessera/data/bpe_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

std::string pcre2_error_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

bool is_ascii_letter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

}  // namespace

std::string oniguruma_to_pcre2(std::string_view p) {
  std::string out;
  bool fold = false;        // inside (?i:...)
  std::vector<bool> folds;  // the fold state each open group restores when it closes
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's' || e == 'S') {
        // PCRE2's \s leaves out U+0085, which Oniguruma's includes.
        out += e == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
      } else {
        out += '\\';
        out += e;
        // \p{L}, \x{2581}: the braces hold names, not letters to fold.
        if ((e == 'p' || e == 'P' || e == 'x') && i + 1 < p.size() && p[i + 1] == '{') {
          const size_t close = p.find('}', i);
          out += p.substr(i + 1, close == std::string_view::npos ? close : close - i);
          i = close == std::string_view::npos ? p.size() : close;
        }
      }
      continue;
    }
    if (in_class) {
      out += c;
      if (c == ']') {
        in_class = false;
        if (fold) out += ')';
      }
      continue;
    }
    if (c == '[') {
      // A class inside (?i:...) keeps PCRE2's own caseless matching.
      out += fold ? "(?i:[" : "[";
      in_class = true;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ] is literal
    } else if (c == '(') {
      folds.push_back(fold);
      if (p.substr(i).starts_with("(?i:")) {
        out += "(?:";
        fold = true;
        i += 3;
      } else if (i + 1 < p.size() && p[i + 1] == '?') {
        // (?:, (?=, (?<=, (?<name>: copy the group's prefix unchanged.
        const size_t end = p.find_first_of(":=!>)", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() - 1 : end;
        out += p.substr(i, stop + 1 - i);
        i = stop;
      } else {
        out += c;
      }
    } else if (c == ')') {
      out += c;
      if (!folds.empty()) {
        fold = folds.back();
        folds.pop_back();
      }
    } else if (fold && is_ascii_letter(c)) {
      out += '[';
      out += static_cast<char>(c | 0x20);
      out += static_cast<char>(c & ~0x20);
      out += ']';
    } else {
      out += c;
    }
  }
  return out;
}

SplitRegex::SplitRegex(std::string_view oniguruma_pattern, const std::string& source) {
  const std::string pattern = oniguruma_to_pcre2(oniguruma_pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  if (!code)
    throw DataError(
        fmt::format("{}: pre-tokenizer regex '{}' does not compile ({} at offset {} of "
                    "its PCRE2 form '{}'): expected an Oniguruma pattern PCRE2 accepts",
                    source, oniguruma_pattern, pcre2_error_message(error), offset, pattern));
  // Without JIT support pcre2_match interprets the pattern: slower, same results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

SplitRegex::~SplitRegex() {
  pcre2_code_free(static_cast<pcre2_code*>(code_));
}

void SplitRegex::split(std::string_view text, std::vector<std::string_view>* pieces) const {
  struct FreeMatchData {
    void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
  };
  thread_local std::unique_ptr<pcre2_match_data, FreeMatchData> match(
      pcre2_match_data_create(1, nullptr));
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t last = 0;  // end of the last piece
  for (size_t from = 0; from < text.size();) {
    const int rc = pcre2_match(static_cast<const pcre2_code*>(code_), subject, text.size(), from, 0,
                               match.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0)
      throw DataError(fmt::format("pre-tokenizer regex failed on a text of {} bytes: {}",
                                  text.size(), pcre2_error_message(rc)));
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match.get());
    if (span[0] > last) pieces->push_back(text.substr(last, span[0] - last));
    last = span[0];
    if (span[1] > span[0]) {
      pieces->push_back(text.substr(span[0], span[1] - span[0]));
      last = from = span[1];
    } else {
      // An empty match: search again one character on (the whole UTF-8 sequence).
      from = span[0] + 1;
      while (from < text.size() && (static_cast<unsigned char>(text[from]) & 0xC0) == 0x80) ++from;
    }
  }
  if (last < text.size()) pieces->push_back(text.substr(last));
}

}  // namespace tessera
