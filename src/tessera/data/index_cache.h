#pragma once
// Sample-index caches, laid out as Megatron lays them out: in `dir`,
//   {hash}-{kind}-description.txt   everything the indices depend on, as text
//   {hash}-{kind}-{name}.npy        one file per array
// where hash is a digest of the description. An entry is used only when its description
// matches the wanted one exactly, so changed data, sequence length, seed, split or sample
// count all build new indices; a damaged entry is rebuilt.
#include <functional>
#include <string>
#include <vector>

#include "tessera/data/numpy_compat.h"

namespace tessera {

struct CachedIndices {
  std::vector<NpyArray> arrays;  // in the order of the names asked for
  std::string status;            // "loaded from ...", "built, saved in ...", or why not saved
};

// Loads the arrays `names` cached for `description`, or builds them with `build` and saves
// them (under temporary names, renamed when complete; the description last, so it marks a
// complete entry). When `dir` cannot be written the built arrays are used from memory.
// `valid` may reject loaded arrays that do not fit together (they are then rebuilt).
CachedIndices load_or_build_indices(const std::string& dir, const std::string& kind,
                                    const std::string& description,
                                    const std::vector<std::string>& names,
                                    const std::function<std::vector<NpyArray>()>& build,
                                    const std::function<bool(const std::vector<NpyArray>&)>& valid);

// 16 hex digits of FNV-1a over the text.
std::string description_hash(const std::string& text);

}  // namespace tessera
