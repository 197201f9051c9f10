// Experiment files a careless or hostile user writes. `extends:` reaching a file more than
// once: each file is loaded once, where it is first reached, so a chain of files that each
// extend the next twice loads in linear time (it took 2^n loads before), and a diamond's shared
// base does not undo what one side overrode. A key of megabytes is refused at once, without a
// quadratic search for the nearest known key.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/scratch_dir.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

std::string write(const ScratchDir& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir / name) << text;
  return (dir / name).string();
}

TEST(Extends, AChainThatExtendsEachFileTwiceLoadsEachFileOnce) {
  ScratchDir dir;
  constexpr int kFiles = 31;
  for (int i = 0; i + 1 < kFiles; ++i)
    write(dir, "f" + std::to_string(i) + ".yaml",
          "extends: [f" + std::to_string(i + 1) + ".yaml, f" + std::to_string(i + 1) + ".yaml]\n");
  write(dir, "f" + std::to_string(kFiles - 1) + ".yaml",
        "model: tiny_llama\nmock_data: true\nlr: 0.005\n");
  LoadOptions o;
  o.config_path = (dir / "f0.yaml").string();
  const auto start = std::chrono::steady_clock::now();
  const Experiment e = load_experiment(o);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  EXPECT_DOUBLE_EQ(e.training.lr, 0.005);
}

TEST(Extends, ADiamondsSharedBaseDoesNotUndoAnOverride) {
  ScratchDir dir;
  write(dir, "base.yaml", "model: tiny_llama\nmock_data: true\nlr: 0.001\nmin_lr: 0.0\n");
  write(dir, "fast.yaml", "extends: base.yaml\nlr: 0.002\n");
  write(dir, "floor.yaml", "extends: base.yaml\nmin_lr: 0.0001\n");
  LoadOptions o;
  o.config_path = write(dir, "exp.yaml", "extends: [fast.yaml, floor.yaml]\nseed: 7\n");
  const Experiment e = load_experiment(o);
  EXPECT_DOUBLE_EQ(e.training.lr, 0.002);  // fast.yaml's, not base.yaml's again through floor
  EXPECT_DOUBLE_EQ(e.training.min_lr, 0.0001);
  EXPECT_EQ(e.training.seed, 7);
  EXPECT_EQ(e.origin.at("lr"), (dir / "fast.yaml").string() + ":2");

  // A cycle through the same files is still named as one.
  write(dir, "loop.yaml", "extends: [fast.yaml, loop.yaml]\n");
  o.config_path = (dir / "loop.yaml").string();
  try {
    load_experiment(o);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("loop.yaml -> " + (dir / "loop.yaml").string() + " loops"),
              std::string::npos)
        << e.what();
  }
}

TEST(HostileConfig, AnUnknownKeyOfMegabytesIsRefusedAtOnce) {
  ScratchDir dir;
  LoadOptions o;
  o.config_path = write(dir, "exp.yaml", "model: tiny_llama\nmock_data: true\n");
  // YAML limits plain keys to 1024 bytes; an explicit key and the command line do not.
  for (const std::string& where : {std::string("file"), std::string("command line")}) {
    SCOPED_TRACE(where);
    LoadOptions hostile = o;
    if (where == "file")
      hostile.config_path =
          write(dir, "long.yaml", "model: tiny_llama\n? " + std::string(4 << 20, 'k') + "\n: 1\n");
    else
      hostile.cli_overrides = {"--" + std::string(4 << 20, 'k'), "1"};
    const auto start = std::chrono::steady_clock::now();
    try {
      load_experiment(hostile);
      ADD_FAILURE() << "expected a ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.expected(), "a known key (`tessera train --help` lists them)");
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  }
  // A near miss still gets its suggestion.
  o.config_path = write(dir, "typo.yaml", "model: tiny_llama\nmock_data: true\ntrian_iters: 3\n");
  try {
    load_experiment(o);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.expected(), "a known key; did you mean 'train_iters'?");
  }
}

}  // namespace
}  // namespace tessera::testing
