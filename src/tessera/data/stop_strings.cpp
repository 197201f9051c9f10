#include "tessera/data/stop_strings.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace tessera {

// Every ordinary token decodes to one byte or more; a few more tokens than the longest stop
// string's bytes absorb special tokens and characters split across tokens.
constexpr size_t kSpareTokens = 8;

StopStrings::StopStrings(const Tokenizer& tokenizer, std::vector<std::string> stops)
    : tokenizer_(&tokenizer), stops_(std::move(stops)) {
  for (const std::string& s : stops_) {
    if (s.empty()) throw std::invalid_argument("a stop string is empty");
    window_ = std::max(window_, s.size() + kSpareTokens);
  }
}

bool StopStrings::stopped(std::span<const int32_t> ids) const {
  if (stops_.empty() || ids.empty()) return false;
  const size_t n = std::min(ids.size(), window_);
  const std::string text = tokenizer_->decode(std::vector<int32_t>(ids.end() - n, ids.end()));
  return std::any_of(stops_.begin(), stops_.end(),
                     [&](const std::string& s) { return text.find(s) != std::string::npos; });
}

}  // namespace tessera
