#pragma once
// Stop strings (transformers' generate(stop_strings=...), vLLM's `stop`): a sequence being
// generated ends at the token after which its text holds one of them. The text and the tokens
// keep the stop string, as transformers returns them.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/data/tokenizer.h"

namespace tessera {

class StopStrings {
 public:
  StopStrings() = default;
  // stops: non-empty strings.
  StopStrings(const Tokenizer& tokenizer, std::vector<std::string> stops);

  bool empty() const { return stops_.empty(); }
  const std::vector<std::string>& strings() const { return stops_; }
  // Whether the text of `ids` (a completion so far, checked after each token it gains, so an
  // earlier stop would have ended it) now holds a stop string. Decodes only the last tokens
  // that can hold one: thread-safe and independent of the completion's length.
  bool stopped(std::span<const int32_t> ids) const;

 private:
  const Tokenizer* tokenizer_ = nullptr;
  std::vector<std::string> stops_;
  size_t window_ = 0;  // tokens decoded: enough for the longest stop string
};

}  // namespace tessera
