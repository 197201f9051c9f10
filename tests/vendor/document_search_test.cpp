// The warpgroup attention backward finds where each key block's last document ends by a 32-way
// search (backend/cuda/document_search.h), here with a loop standing in for the warp's lanes.
// Its first version skipped the positions between the last probe below hi and hi whenever no
// probe had passed the end: on long documents a key then saw the first queries of the next
// document (the end came out up to a step late: 32,616 for 32,615 in a sequence of 32,768).
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/backend/cuda/document_search.h"

namespace tessera::cuda {
namespace {

// Document starts per position of documents of these lengths, one after another.
std::vector<int32_t> starts_of(const std::vector<int>& lengths) {
  std::vector<int32_t> starts;
  for (int n : lengths) {
    const auto first = static_cast<int32_t>(starts.size());
    starts.insert(starts.end(), static_cast<size_t>(n), first);
  }
  return starts;
}

int searched_end(const std::vector<int32_t>& starts, int j) {
  const int T = static_cast<int>(starts.size());
  return document_end_search(j, T, [&](int lo, int step, int hi) {
    unsigned past = 0;
    for (int lane = 0; lane < 32; ++lane) {
      const int at = lo + lane * step;
      if (at < hi && starts[at] > j) past |= 1u << lane;
    }
    return past;
  });
}

int scanned_end(const std::vector<int32_t>& starts, int j) {
  int i = j + 1;
  while (i < static_cast<int>(starts.size()) && starts[i] <= j) ++i;
  return i;
}

TEST(DocumentSearch, FindsEveryKeysDocumentEnd) {
  // The layouts where the first version was late: long documents, and documents of 1024 in a
  // sequence of 8192 (bench attention's packed rows).
  for (const std::vector<int>& lengths :
       {std::vector<int>{7201, 25414, 153}, {25414, 7201, 153}, {2807, 265},
        std::vector<int>(8, 1024), {1, 1, 5000, 1}}) {
    const std::vector<int32_t> starts = starts_of(lengths);
    for (int j = 0; j < static_cast<int>(starts.size()); ++j)
      ASSERT_EQ(searched_end(starts, j), scanned_end(starts, j)) << "key " << j;
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int T = std::uniform_int_distribution<int>(1, 5000)(rng);
    std::vector<int> lengths;
    for (int used = 0; used < T;) {
      lengths.push_back(std::min(T - used, std::uniform_int_distribution<int>(1, T)(rng)));
      used += lengths.back();
    }
    const std::vector<int32_t> starts = starts_of(lengths);
    for (int j = 0; j < T; j += 1 + j % 13)
      ASSERT_EQ(searched_end(starts, j), scanned_end(starts, j)) << "T " << T << " key " << j;
  }
}

}  // namespace
}  // namespace tessera::cuda
