#pragma once
// A rank's parameter layout against the one-device layout of the same model: tests of split
// models (tensor, expert parallelism) compare a rank's elements with one model's.
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/model/param_layout.h"

namespace tessera::testing {

// Calls f(local, whole, p) for every element of every parameter p in `layout` (a rank's):
// its offset in that layout's flat buffer and in the one-device layout's.
inline void for_each_placed_element(
    const ParamLayout& layout,
    const std::function<void(int64_t local, int64_t whole, const ParamInfo& p)>& f) {
  for (const ParamInfo& p : layout.params)
    p.for_each_run(0, p.numel(), [&](int64_t begin, int64_t count, int64_t full_begin) {
      for (int64_t i = 0; i < count; ++i)
        f(p.offset + begin + i, p.full_offset + full_begin + i, p);
    });
}

// The rank's part of one model's flat values (alignment gaps zero).
inline std::vector<float> placed_part(const ParamLayout& layout, const std::vector<float>& whole) {
  std::vector<float> part(static_cast<size_t>(layout.total), 0.0f);
  for_each_placed_element(
      layout, [&](int64_t local, int64_t w, const ParamInfo&) { part[local] = whole[w]; });
  return part;
}

}  // namespace tessera::testing
