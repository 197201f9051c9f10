// DeepSeek's YaRN RoPE (model/rope.h): the inverse frequencies, the cos/sin factor and the
// softmax scale against transformers' formulas (tests/model/yarn_reference.py, float64) for
// DeepSeek-V3's, DeepSeek-V2-Lite's and a small configuration whose ramp lies inside the RoPE
// dims; and the values derivable by hand: the bands YaRN keeps and divides, factor 1 being
// plain RoPE, mscale(40, 1) = 1 + 0.1 ln 40.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

ModelSpec yarn_spec(int64_t rope_dim, double base, double factor, int64_t original, double mscale,
                    double mscale_all_dim) {
  ModelSpec s;
  s.family = "deepseek";
  s.head_dim = rope_dim;
  s.rotary_base = base;
  s.mla = {true, 0, 16, 128, rope_dim, 128};
  s.yarn = {true, factor, original, 32.0, 1.0, mscale, mscale_all_dim};
  return s;
}

TEST(YarnRope, MatchesTransformersFormulas) {
  const std::vector<ModelSpec> specs = {yarn_spec(64, 10000, 40, 4096, 1.0, 1.0),      // V3
                                        yarn_spec(64, 10000, 40, 4096, 0.707, 0.707),  // V2-Lite
                                        yarn_spec(16, 500, 6, 64, 0.8, 0.9),
                                        yarn_spec(8, 10000, 4, 64, 1.0, 0.0)};
  nlohmann::json configs = nlohmann::json::array();
  for (const ModelSpec& s : specs)
    configs.push_back({{"rotary_base", s.rotary_base},
                       {"mla", {{"rope", s.mla.rope_dim}, {"qk", s.mla.qk_head_dim}}},
                       {"yarn",
                        {{"factor", s.yarn.factor},
                         {"original", s.yarn.original_max_position_embeddings},
                         {"beta_fast", s.yarn.beta_fast},
                         {"beta_slow", s.yarn.beta_slow},
                         {"mscale", s.yarn.mscale},
                         {"mscale_all_dim", s.yarn.mscale_all_dim}}}});
  const std::filesystem::path in = std::filesystem::temp_directory_path() /
                                   ("tessera_yarn_" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << configs.dump();
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                                      "/model/yarn_reference.py " + in.string() + " 2>/dev/null");
  std::filesystem::remove(in);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json ref = nlohmann::json::parse(r.output);
  ASSERT_EQ(ref.size(), specs.size());
  for (size_t c = 0; c < specs.size(); ++c) {
    SCOPED_TRACE("config " + std::to_string(c));
    const ModelSpec& s = specs[c];
    const std::vector<double> inv = rope_inverse_frequencies(s);
    const std::vector<double> want = ref[c]["inv_freq"].get<std::vector<double>>();
    ASSERT_EQ(inv.size(), want.size());
    for (size_t i = 0; i < inv.size(); ++i) EXPECT_NEAR(inv[i], want[i], 1e-12 * want[i]) << i;
    const double factor = ref[c]["table_factor"].get<double>();
    EXPECT_NEAR(yarn_table_scale(s.yarn), factor, 1e-14);
    EXPECT_NEAR(mla_softmax_scale(s), ref[c]["softmax_scale"].get<double>(), 1e-14);
    // The table: cos then sin of position t times each frequency, times the factor.
    const int64_t T = 300, half = s.head_dim / 2;
    const std::vector<float> table = rope_table(s, T);
    for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{77}, T - 1})
      for (int64_t i = 0; i < half; ++i) {
        EXPECT_NEAR(table[t * 2 * half + i], std::cos(t * want[i]) * factor, 2e-6);
        EXPECT_NEAR(table[t * 2 * half + half + i], std::sin(t * want[i]) * factor, 2e-6);
      }
  }
}

// The rotation counts over the original context decide the bands: pair i turns
// original * base^(-2i/d) / (2 pi) times. At d 64, base 10000, 4096 positions: pairs below
// floor(d ln(4096 / (32 * 2 pi)) / (2 ln 10000)) = 10 make more than 32 turns and keep their
// frequency; pairs from ceil(d ln(4096 / (2 pi)) / (2 ln 10000)) = 23 make fewer than 1 and are
// divided by the factor; a linear ramp lies between.
TEST(YarnRope, KeepsFastFrequenciesAndDividesSlowOnes) {
  const ModelSpec s = yarn_spec(64, 10000, 40, 4096, 1.0, 1.0);
  ModelSpec plain = s;
  plain.yarn.enabled = false;
  const std::vector<double> inv = rope_inverse_frequencies(s),
                            base = rope_inverse_frequencies(plain);
  for (int i = 0; i <= 10; ++i) EXPECT_DOUBLE_EQ(inv[i], base[i]) << i;
  for (int i = 23; i < 32; ++i) EXPECT_DOUBLE_EQ(inv[i], base[i] / 40) << i;
  for (int i = 11; i < 23; ++i) {
    const double ramp = (i - 10) / 13.0;  // (i - low) / (high - low)
    EXPECT_NEAR(inv[i], base[i] / 40 * ramp + base[i] * (1 - ramp), 1e-15) << i;
  }
  // mscale(40, 1) = 1 + 0.1 ln 40; V3's table factor is 1 and its softmax scale that squared.
  EXPECT_NEAR(yarn_mscale(40, 1.0), 1.3688879454113936, 1e-15);
  EXPECT_DOUBLE_EQ(yarn_table_scale(s.yarn), 1.0);
  EXPECT_NEAR(mla_softmax_scale(s), std::pow(1.3688879454113936, 2) / std::sqrt(192.0), 1e-15);
  EXPECT_DOUBLE_EQ(yarn_mscale(1.0, 0.707), 1.0);  // no extension, no scaling
}

TEST(YarnRope, FactorOneIsPlainRope) {
  ModelSpec s = yarn_spec(16, 10000, 1.0, 64, 1.0, 0.0);
  ModelSpec plain = s;
  plain.yarn.enabled = false;
  EXPECT_EQ(rope_table(s, 50), rope_table(plain, 50));
  EXPECT_DOUBLE_EQ(mla_softmax_scale(s), 1.0 / std::sqrt(144.0));
}

}  // namespace
}  // namespace tessera
