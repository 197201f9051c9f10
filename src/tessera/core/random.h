#pragma once
// Counter-based random numbers: value i of a stream is a pure function of (seed, i), so
// initialisation and mock data are identical on every backend, thread count and sharding.
// Usable from device code: GPU kernels draw the same values (core/host_device.h).
#include <cmath>
#include <cstdint>

#include "tessera/core/host_device.h"

namespace tessera {

TS_HOST_DEVICE uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// 64 random bits for element `index` of stream `seed`.
TS_HOST_DEVICE uint64_t random_bits(uint64_t seed, uint64_t index) {
  return splitmix64(splitmix64(seed) ^ (index * 0xD2B74407B1CE6E93ull));
}

// Standard normal for element `index`: Box-Muller on the two 32-bit halves, computed in
// double so host and device results agree after rounding to float.
TS_HOST_DEVICE float random_normal(uint64_t seed, uint64_t index) {
  const uint64_t bits = random_bits(seed, index);
  const double u1 = (static_cast<double>(bits >> 32) + 1.0) * (1.0 / 4294967296.0);  // (0, 1]
  const double u2 = static_cast<double>(bits & 0xffffffffull) * (1.0 / 4294967296.0);  // [0, 1)
  return static_cast<float>(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

// Uniform integer in [0, n) for element `index` (n < 2^32; bias below 2^-32 * n).
TS_HOST_DEVICE uint32_t random_below(uint64_t seed, uint64_t index, uint32_t n) {
  return static_cast<uint32_t>(((random_bits(seed, index) >> 32) * n) >> 32);
}

// Gumbel noise -log(-log(u)) for id `id` of step `step` of sampling stream `stream` (a
// sequence being generated): argmax of logit / temperature + noise over the ids draws from
// softmax(logits / temperature) (the Gumbel-max trick), the same draw on every backend. u is
// uniform in (0, 1) from 24 bits; computed in double so host and device agree after rounding.
TS_HOST_DEVICE float gumbel_noise(uint64_t seed, int64_t stream, int64_t step, int64_t vocab, int64_t id) {
  const uint64_t bits = random_bits(random_bits(seed, static_cast<uint64_t>(stream)),
                                    static_cast<uint64_t>(step) * static_cast<uint64_t>(vocab) + static_cast<uint64_t>(id));
  const double u = (static_cast<double>(bits >> 40) + 0.5) * (1.0 / 16777216.0);
  return static_cast<float>(-log(-log(u)));
}

}  // namespace tessera
