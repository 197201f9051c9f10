#pragma once
// The regex of a Hugging Face `Split` pre-tokenizer (Llama 3's
// "(?i:'s|'t|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|..."), compiled with PCRE2 in UTF mode
// with Unicode properties and JIT. The patterns are written for Oniguruma (what the Rust
// library uses); they are translated the way @huggingface/tokenizers (JS) does it: \s and \S
// mean White_Space as Unicode defines it, and (?i:...) folds ASCII letters only.
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

class SplitRegex {
 public:
  // Throws DataError naming `source` when the pattern does not compile.
  SplitRegex(std::string_view oniguruma_pattern, const std::string& source);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // Appends to pieces each match and each non-empty stretch between matches, in order (the
  // "Isolated" behaviour), so the pieces concatenate to text. Invalid UTF-8 never matches:
  // its bytes end up in the stretches between matches.
  void split(std::string_view text, std::vector<std::string_view>* pieces) const;

 private:
  void* code_;  // pcre2_code_8, kept out of this header
};

// The PCRE2 form of an Oniguruma pattern (see above). Exposed for tests.
std::string oniguruma_to_pcre2(std::string_view pattern);

}  // namespace tessera
