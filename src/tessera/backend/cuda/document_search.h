#pragma once
// Where a packed document ends, by a 32-way search: one warp's lanes probe 32 positions a round,
// three rounds at T = 8192 where a bisection makes thirteen dependent loads (the warpgroup
// attention backward, attention_common.cuh's document_end_warp). Host and device code share
// it, so that a CPU test checks it against a scan.
#include "tessera/core/host_device.h"

namespace tessera::cuda {

// One past the last query of key j's document: the first i in (j, T) whose document starts
// after j (starts never decrease along the sequence), else T. probe(lo, step, hi) returns the
// bits of the lanes l < 32 with lo + l * step < hi whose position's document starts after j.
template <class Probe>
TS_HOST_DEVICE int document_end_search(int j, int T, Probe probe) {
  int lo = j + 1, hi = T;  // the end lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 31) / 32;
    const unsigned past = probe(lo, step, hi);
    if (past == 0) {
      // The end lies after the last probed position: lanes at or past hi probed nothing.
      const int probed = (hi - 1 - lo) / step < 31 ? (hi - 1 - lo) / step : 31;
      lo += probed * step + 1;
    } else {
#if defined(__CUDA_ARCH__)
      const int first = __ffs(static_cast<int>(past)) - 1;
#else
      const int first = __builtin_ctz(past);
#endif
      hi = lo + first * step;
      if (first > 0) lo += (first - 1) * step + 1;
    }
  }
  return hi;
}

}  // namespace tessera::cuda
