#pragma once
// A Megatron data blend as the data keys hold it: "w1 prefix1 w2 prefix2 ..." or one prefix.
// Parsed here, with the configuration, so that validation names a bad value before any file
// is read; data/blended_dataset.h builds the blended dataset from it.
#include <string>
#include <vector>

namespace tessera {

struct BlendEntry {
  double weight = 1;  // normalised: the weights of a blend sum to 1
  std::string prefix;
};

// Parses a blend value of config key `key` (set at `origin`, e.g. "exp.yaml:7"). Throws
// ConfigError naming the key and the offending token for a weight that is not a positive
// number, or a weight without a prefix.
std::vector<BlendEntry> parse_blend(const std::string& text, const std::string& key,
                                    const std::string& origin);

// Whether train_data_path names text (an existing file or directory) rather than a blend;
// an existing PREFIX.bin or PREFIX.idx counts as a (mistyped) blend, not as text.
bool is_text_corpus_path(const std::string& train_data_path);

}  // namespace tessera
