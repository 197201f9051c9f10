#pragma once
// Live allocations and their high-water mark, for backends' memory_stats(). Thread-safe:
// allocations may come from any host thread.
#include <algorithm>
#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "tessera/core/error.h"

namespace tessera {

class AllocationTracker {
 public:
  void add(void* ptr, size_t bytes) {
    std::lock_guard lock(mutex_);
    sizes_.emplace(ptr, bytes);
    allocated_ += bytes;
    peak_ = std::max(peak_, allocated_);
  }
  // Forgets ptr; a pointer the tracker never saw is a bug in the caller.
  void remove(void* ptr) {
    std::lock_guard lock(mutex_);
    auto it = sizes_.find(ptr);
    TS_CHECK(it != sizes_.end(), "release of {}, which this backend did not allocate", ptr);
    allocated_ -= it->second;
    sizes_.erase(it);
  }
  size_t allocated() const {
    std::lock_guard lock(mutex_);
    return allocated_;
  }
  size_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard lock(mutex_);
    peak_ = allocated_;
  }
  // Calls free_fn(ptr) for every live allocation and forgets them all (backend teardown).
  template <class FreeFn>
  void release_all(FreeFn free_fn) {
    std::lock_guard lock(mutex_);
    for (auto& [ptr, bytes] : sizes_) free_fn(ptr);
    sizes_.clear();
    allocated_ = 0;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  size_t allocated_ = 0;
  size_t peak_ = 0;
};

}  // namespace tessera
