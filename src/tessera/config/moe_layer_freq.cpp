#include "tessera/config/moe_layer_freq.h"

#include <cctype>
#include <charconv>

#include <fmt/format.h>

namespace tessera {
namespace {

// A recursive-descent reader of  list ('*' count)? ('+' list ('*' count)?)*  where list is
// '[' digit (',' digit)* ']', optionally inside one pair of parentheses.
class ListReader {
 public:
  explicit ListReader(std::string_view text) : s_(text) {}

  std::optional<std::vector<bool>> read() {
    std::vector<bool> out;
    skip_space();
    const bool paren = eat('(');
    do {
      std::vector<bool> term;
      if (!list(term)) return std::nullopt;
      if (eat('*')) {
        int64_t n = 0;
        if (!number(n) || n < 0) return std::nullopt;
        std::vector<bool> repeated;
        for (int64_t i = 0; i < n; ++i) repeated.insert(repeated.end(), term.begin(), term.end());
        term = std::move(repeated);
      }
      out.insert(out.end(), term.begin(), term.end());
    } while (eat('+'));
    if (paren && !eat(')')) return std::nullopt;
    skip_space();
    if (pos_ != s_.size()) return std::nullopt;
    return out;
  }

 private:
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool number(int64_t& n) {
    skip_space();
    const char* begin = s_.data() + pos_;
    const auto [end, ec] = std::from_chars(begin, s_.data() + s_.size(), n);
    if (ec != std::errc() || end == begin) return false;
    pos_ += static_cast<size_t>(end - begin);
    return true;
  }
  bool list(std::vector<bool>& out) {
    if (!eat('[')) return false;
    do {
      int64_t v = 0;
      if (!number(v) || (v != 0 && v != 1)) return false;
      out.push_back(v == 1);
    } while (eat(','));
    return eat(']');
  }

  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

std::optional<std::vector<bool>> parse_moe_layer_freq(std::string_view text, int64_t num_layers,
                                                      std::string* error) {
  int64_t every = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), every);
  if (ec == std::errc() && end == text.data() + text.size()) {
    if (every < 1) {
      *error = "a positive interval (1: every layer is MoE) or a list of 0/1 per layer";
      return std::nullopt;
    }
    std::vector<bool> moe(static_cast<size_t>(std::max<int64_t>(num_layers, 0)));
    for (size_t i = 0; i < moe.size(); ++i) moe[i] = static_cast<int64_t>(i) % every == 0;
    return moe;
  }
  std::optional<std::vector<bool>> moe = ListReader(text).read();
  if (!moe) {
    *error =
        "an interval N (every Nth layer is MoE) or Megatron's list of 0/1 per layer, e.g. "
        "[1,0,1,0] or [0]*3+[1]*27";
    return std::nullopt;
  }
  if (static_cast<int64_t>(moe->size()) != num_layers) {
    // A preset's list is written for its full depth; proxies with fewer layers (the seed's
    // "--num_layers 3 --moe_layer_freq 1") say which of their layers are MoE.
    *error = fmt::format(
        "a list of one 0/1 entry per layer: num_layers is {}, the list has {} (with fewer "
        "layers than the preset, set moe_layer_freq too, e.g. --moe_layer_freq 1 for every "
        "layer MoE)",
        num_layers, moe->size());
    return std::nullopt;
  }
  return moe;
}

}  // namespace tessera
