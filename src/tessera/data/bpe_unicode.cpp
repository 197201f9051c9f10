#include "tessera/data/bpe_unicode.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace tessera::unicode {
namespace {

struct CanonicalDecomposition {
  char32_t code_point, first, second;
  bool recomposes;
};
struct CombiningClassRange {
  char32_t first, last;
  uint8_t combining_class;
};
#include "tessera/data/bpe_unicode_tables.inc"

// Hangul syllables decompose and compose arithmetically (Unicode chapter 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount;
constexpr char32_t kSCount = kLCount * kNCount;

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const auto* end = std::end(kCombiningClasses);
  const auto* it =
      std::upper_bound(std::begin(kCombiningClasses), end, cp,
                       [](char32_t c, const CombiningClassRange& r) { return c < r.first; });
  if (it == std::begin(kCombiningClasses)) return 0;
  --it;
  return cp <= it->last ? it->combining_class : 0;
}

const CanonicalDecomposition* find_decomposition(char32_t cp) {
  const auto* end = std::end(kCanonicalDecompositions);
  const auto* it = std::lower_bound(
      std::begin(kCanonicalDecompositions), end, cp,
      [](const CanonicalDecomposition& d, char32_t c) { return d.code_point < c; });
  return it != end && it->code_point == cp ? it : nullptr;
}

// The primary composite of (first, second), or 0.
char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount)
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 &&
      second > kTBase && second < kTBase + kTCount)
    return first + (second - kTBase);
  static const auto* const kComposites = [] {
    auto* m = new std::unordered_map<uint64_t, char32_t>;
    for (const auto& d : kCanonicalDecompositions)
      if (d.recomposes) (*m)[uint64_t{d.first} << 32 | d.second] = d.code_point;
    return m;
  }();
  const auto it = kComposites->find(uint64_t{first} << 32 | second);
  return it == kComposites->end() ? 0 : it->second;
}

struct Mark {
  char32_t cp;
  uint8_t combining_class;
};

// Appends the full canonical decomposition of cp, keeping combining marks in canonical order
// (a stable sort by combining class between starters).
void decompose(char32_t cp, std::vector<Mark>* out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out->push_back({kLBase + s / kNCount, 0});
    out->push_back({kVBase + s % kNCount / kTCount, 0});
    if (s % kTCount) out->push_back({kTBase + s % kTCount, 0});
    return;
  }
  if (const CanonicalDecomposition* d = find_decomposition(cp)) {
    decompose(d->first, out);
    if (d->second) decompose(d->second, out);
    return;
  }
  const Mark m{cp, combining_class(cp)};
  size_t at = out->size();
  if (m.combining_class)
    while (at > 0 && (*out)[at - 1].combining_class > m.combining_class) --at;
  out->insert(out->begin() + static_cast<ptrdiff_t>(at), m);
}

// Canonical composition (UAX #15) in place: each mark joins the last starter unless a mark
// of the same or higher class, or another starter, stands between them.
void compose(std::vector<Mark>* marks) {
  std::vector<Mark>& m = *marks;
  if (m.empty()) return;
  size_t starter = m[0].combining_class == 0 ? 0 : SIZE_MAX;
  uint8_t last_class = m[0].combining_class;
  size_t n = 1;
  for (size_t i = 1; i < m.size(); ++i) {
    const Mark c = m[i];
    if (starter != SIZE_MAX) {
      const bool blocked = n - 1 != starter && last_class >= c.combining_class;
      if (!blocked) {
        if (const char32_t composite = compose_pair(m[starter].cp, c.cp)) {
          m[starter].cp = composite;
          continue;
        }
      }
    }
    if (c.combining_class == 0) starter = n;
    last_class = c.combining_class;
    m[n++] = c;
  }
  m.resize(n);
}

}  // namespace

int decode_utf8(const char* p, const char* end, char32_t* cp) {
  const auto b0 = static_cast<unsigned char>(p[0]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  if (b0 < 0xC2 || b0 > 0xF4) return 0;
  const int n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  if (end - p < n) return 0;
  constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};  // shorter forms are overlong
  char32_t c = b0 & (0x7F >> n);
  for (int i = 1; i < n; ++i) {
    const auto b = static_cast<unsigned char>(p[i]);
    if ((b & 0xC0) != 0x80) return 0;
    c = c << 6 | (b & 0x3F);
  }
  if (c < kMin[n] || c > 0x10FFFF || (c >= 0xD800 && c < 0xE000)) return 0;
  *cp = c;
  return n;
}

void append_utf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | cp >> 6));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | cp >> 12));
    out->push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | cp >> 18));
    out->push_back(static_cast<char>(0x80 | (cp >> 12 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_trivially_nfc(std::string_view text) {
  return std::none_of(text.begin(), text.end(),
                      [](char c) { return static_cast<unsigned char>(c) >= 0xCC; });
}

void append_nfc(std::string_view text, std::string* out) {
  std::vector<Mark> marks;
  auto flush = [&] {
    compose(&marks);
    for (const Mark& m : marks) append_utf8(m.cp, out);
    marks.clear();
  };
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    char32_t cp;
    const int n = decode_utf8(p, end, &cp);
    if (n == 0) {
      flush();
      out->push_back(*p++);
      continue;
    }
    // A starter that no following character can compose with ends a run; flushing there
    // keeps the buffer short. ASCII is such a starter except before a combining mark, so
    // only flush on it once the next byte is ASCII too.
    if (cp < 0x80 && (p + 1 == end || static_cast<unsigned char>(p[1]) < 0x80)) {
      flush();
      out->push_back(static_cast<char>(cp));
      ++p;
      continue;
    }
    decompose(cp, &marks);
    p += n;
  }
  flush();
}

}  // namespace tessera::unicode
