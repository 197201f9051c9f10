#pragma once
// Host work spread over threads: body(i) for every i in [0, count), each index taken by one
// thread (the caller's among them), at most max_threads threads (0: one per hardware thread).
// The first exception a body throws stops the indices not yet taken and is rethrown.
#include <cstddef>
#include <functional>

namespace tessera {

void parallel_for(size_t count, const std::function<void(size_t)>& body, size_t max_threads = 0);

}  // namespace tessera
