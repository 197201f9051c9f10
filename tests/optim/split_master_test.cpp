// Split master weights (core/split_master.h): the two halves hold every fp32 value exactly,
// the high half is the bf16 rounding to nearest with ties away from zero, and the key's rules.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"
#include "tessera/core/split_master.h"
#include "tessera/optim/adamw_optimizer.h"

namespace tessera::testing {
namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Checks one fp32 bit pattern; returns whether it was an exact halfway case.
bool check_pattern(uint32_t bits) {
  const uint16_t high = split_master_high(bits), low = split_master_low(bits);
  const uint32_t back = split_master_join(high, low);
  const float f = float_of(bits);
  if (std::isnan(f)) {
    EXPECT_TRUE(std::isnan(float_of(back))) << std::hex << bits;
    EXPECT_TRUE(std::isnan(bf16_bits_to_float(high))) << std::hex << bits;
    return false;
  }
  EXPECT_EQ(back, bits) << std::hex << bits;
  const bool tie = (bits & 0xffffu) == 0x8000u;
  if (!tie) {
    EXPECT_EQ(high, float_to_bf16_bits(f)) << std::hex << bits;
  } else {
    // Halfway: the neighbour of larger magnitude, whatever round-to-nearest-even picks.
    EXPECT_EQ(high, static_cast<uint16_t>((bits >> 16) + 1)) << std::hex << bits;
    EXPECT_GT(std::abs(bf16_bits_to_float(high)), std::abs(f)) << std::hex << bits;
  }
  return tie;
}

TEST(SplitMaster, HalvesHoldEveryFp32ValueExactly) {
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min(),
                            inf,
                            -inf,
                            std::nanf(""),
                            -std::nanf("")};
  for (float f : specials) check_pattern(bits_of(f));
  // The carry crossing into the exponent, and into infinity from the largest finite values.
  for (uint32_t b : {0x3f7f8000u, 0x3f7fffffu, 0x7f7f8000u, 0x7f7fffffu, 0xff7fffffu, 0x00008000u,
                     0x80008000u, 0x7f800001u, 0xffffffffu})
    check_pattern(b);
  // Every low half of a few high halves, and random patterns.
  int64_t ties = 0;
  for (uint32_t high : {0x0000u, 0x3c23u, 0x3c24u, 0xbf80u, 0x7f7fu})
    for (uint32_t low = 0; low <= 0xffffu; ++low) ties += check_pattern((high << 16) | low);
  EXPECT_EQ(ties, 5);
  std::mt19937 rng(7);
  for (int i = 0; i < 2'000'000; ++i) check_pattern(rng());
}

TEST(SplitMaster, ItSplitsOnlyAnFp32CopyBesideBf16Parameters) {
  OptimizerDtypes d;
  EXPECT_TRUE(d.split_master);
  EXPECT_TRUE(AdamWOptimizer::splits_master(DType::BF16, d, false));
  EXPECT_TRUE(AdamWOptimizer::splits_master(DType::BF16, d, true));
  // fp32 parameters are the master (unsharded) or the copy is fp32 like them (sharded).
  EXPECT_FALSE(AdamWOptimizer::splits_master(DType::F32, d, false));
  EXPECT_FALSE(AdamWOptimizer::splits_master(DType::F32, d, true));
  EXPECT_EQ(AdamWOptimizer::state_bytes(1000, DType::BF16, d, false), 2000u + 4096u + 4000u);
  d.split_master = false;
  EXPECT_FALSE(AdamWOptimizer::splits_master(DType::BF16, d, false));
  EXPECT_EQ(AdamWOptimizer::state_bytes(1000, DType::BF16, d, false), 4000u + 4096u + 4000u);
  OptimizerDtypes bf16_params{DType::BF16, DType::F32, DType::F32};
  EXPECT_FALSE(AdamWOptimizer::splits_master(DType::BF16, bf16_params, true));
  // The key reaches the optimizer's dtypes.
  const Experiment e = experiment_from_yaml("model: tiny_llama\nmock_data: true\n"
                                            "store_param_remainders: false\n");
  EXPECT_FALSE(OptimizerDtypes::from(e.training).split_master);
  // A value that is not a bool is refused by name.
  try {
    experiment_from_yaml("model: tiny_llama\nmock_data: true\nstore_param_remainders: half\n");
    ADD_FAILURE() << "store_param_remainders: half was accepted";
  } catch (const ConfigError& err) {
    EXPECT_EQ(err.key(), "store_param_remainders");
    EXPECT_NE(std::string(err.what()).find("half"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace tessera::testing
