#pragma once
// Host work spread over threads: body(i) for every i in [0, count), each index taken in order
// by the next free thread (the caller's among them), at most max_threads threads (0: one per
// hardware thread). An exception stops the indices not yet taken; the one of the lowest index
// that failed is rethrown (every earlier index has run: the first bad item is reported,
// however the threads were timed).
#include <cstddef>
#include <functional>

namespace tessera {

void parallel_for(size_t count, const std::function<void(size_t)>& body, size_t max_threads = 0);

}  // namespace tessera
