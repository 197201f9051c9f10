#pragma once
// Helpers of the reference tests: random non-zero inputs in double, finite differences
// (all_nonzero and relative_error come from common/test_tensors.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/test_tensors.h"

namespace tessera::test {

// Uniform in [-scale, scale] but never within scale/100 of zero: a zero input can hide a
// missing term (ggml test-backend-ops rule). Values are float-representable, so the float
// and double code under comparison see identical inputs.
inline std::vector<double> random_values(size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::uniform_real_distribution<double> magnitude(0.01 * scale, scale);
  std::bernoulli_distribution negative(0.5);
  std::vector<double> v(n);
  for (double& x : v) {
    x = static_cast<float>(negative(rng) ? -magnitude(rng) : magnitude(rng));
  }
  return v;
}

// Token ids in [0, limit) with every id of a small vocabulary likely to repeat.
inline std::vector<int32_t> random_ids(size_t n, int32_t limit, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> id(0, limit - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = id(rng);
  return v;
}

inline std::vector<double> nan_values(size_t n) {
  return std::vector<double>(n, std::numeric_limits<double>::quiet_NaN());
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double acc = 0;
  for (size_t i = 0; i < a.size(); ++i) acc += a[i] * b[i];
  return acc;
}

// Central differences of loss() with respect to every element of x, which loss() reads; x is
// restored afterwards.
inline std::vector<double> numerical_gradient(std::vector<double>& x,
                                              const std::function<double()>& loss) {
  constexpr double h = 1e-6;
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double plus = loss();
    x[i] = saved - h;
    const double minus = loss();
    x[i] = saved;
    grad[i] = (plus - minus) / (2 * h);
  }
  return grad;
}

// Expects analytic == base + numeric elementwise, where base is what an accumulating gradient
// held before the backward call (zeros for overwriting ones).
//
// Tolerance: with h = 1e-6 the central difference has truncation error ~h^2 |f'''| / 6 and
// rounding error ~eps |L| / h ~ 2e-10 |L|; with the O(1..10) losses here a correct gradient
// matches to 1e-10..3e-8 (measured; the worst is attention with peaked softmaxes), while a
// wrong or missing term shows up at the scale of the gradient itself. 1e-6 of the gradient's
// scale (its largest element, at least 1) leaves two orders of magnitude on either side.
inline void expect_gradient(const std::vector<double>& analytic, const std::vector<double>& base,
                            const std::vector<double>& numeric, const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double scale = 1.0;
  for (double g : numeric) scale = std::max(scale, std::abs(g));
  const double tol = 1e-6 * scale;
  int failures = 0;
  for (size_t i = 0; i < numeric.size() && failures < 5; ++i) {
    const double got = analytic[i] - base[i];
    if (!(std::abs(got - numeric[i]) <= tol)) {
      ADD_FAILURE() << what << "[" << i << "]: analytic " << got << " vs numeric " << numeric[i];
      ++failures;
    }
  }
}

inline void expect_gradient(const std::vector<double>& analytic, const std::vector<double>& numeric,
                            const std::string& what) {
  expect_gradient(analytic, std::vector<double>(numeric.size(), 0.0), numeric, what);
}

}  // namespace tessera::test
