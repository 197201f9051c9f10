#pragma once
// The profile_ranks key: "all", or comma-separated rank ids ("0", "0,3", spaces allowed), also
// as Megatron's list ("[0,1,2,3]").
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

struct ProfileRanks {
  bool all = false;
  std::vector<int64_t> ids;  // when !all: sorted, distinct, non-negative
  bool contains(int64_t rank) const {
    if (all) return true;
    for (int64_t r : ids)
      if (r == rank) return true;
    return false;
  }
};

// nullopt on anything else (empty, negative, repeated, non-numeric, trailing comma).
inline std::optional<ProfileRanks> parse_profile_ranks(std::string_view text) {
  auto trim = [](std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  };
  text = trim(text);
  if (text.size() >= 2 && text.front() == '[' && text.back() == ']')
    text = trim(text.substr(1, text.size() - 2));
  ProfileRanks r;
  if (text == "all") {
    r.all = true;
    return r;
  }
  if (text.empty()) return std::nullopt;
  while (true) {
    const size_t comma = text.find(',');
    const std::string_view item = trim(text.substr(0, comma));
    if (item.empty() || item.size() > 9) return std::nullopt;
    int64_t v = 0;
    for (const char c : item) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + (c - '0');
    }
    for (int64_t seen : r.ids)
      if (seen == v) return std::nullopt;
    r.ids.push_back(v);
    if (comma == std::string_view::npos) break;
    text = text.substr(comma + 1);
  }
  std::sort(r.ids.begin(), r.ids.end());
  return r;
}

}  // namespace tessera
