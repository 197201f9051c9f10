// `cmake --install`: the tree it writes runs without the source checkout after being moved.
// The build is installed into a scratch prefix, the prefix is moved elsewhere, and the installed
// binary runs from another directory with $TESSERA_ROOT pointing nowhere, so the checkout this
// test was built from is never its data root: the default experiment trains on the installed
// dataset and tokenizer, and every shipped tokenizer name resolves in the install. Files taken
// away from the install, or an empty $TESSERA_HOME, fail with messages naming the paths searched.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/config/tokenizer_model.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::run_command;
using testing::RunResult;
using testing::ScratchDir;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Install, MovedTreeRunsFromAnyDirectoryWithoutTheCheckout) {
  ScratchDir scratch;
  const fs::path first = scratch / "first";
  const RunResult install = run_command(std::string(TESSERA_CMAKE_COMMAND) + " --install " +
                                        TESSERA_BUILD_DIR + " --prefix " + first.string());
  ASSERT_EQ(install.exit_code, 0) << install.output;

  // Relocatable: nothing in the tree names where it was installed.
  const fs::path prefix = scratch / "moved" / "tessera";
  fs::create_directories(prefix.parent_path());
  fs::rename(first, prefix);
  const fs::path share = prefix / "share" / "tessera";
  for (const char* f :
       {"bin/tessera", "share/tessera/configs/experiments/default.yaml",
        "share/tessera/configs/models/llama3.1_8B.yaml", "share/tessera/configs/gpus.yaml",
        "share/tessera/data/brown_llama3_text_document.bin",
        "share/tessera/data/brown_llama3_text_document.idx",
        "share/tessera/data/brown_llama3_text_document.meta.json", "share/doc/tessera/README.md",
        "share/doc/tessera/docs/cli.md", "share/doc/tessera/examples/slurm/pretrain.sbatch"})
    EXPECT_TRUE(fs::is_regular_file(prefix / f)) << f;
  for (const std::string& name : shipped_tokenizer_names())
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "LICENSE"})
      EXPECT_TRUE(fs::is_regular_file(share / "tokenizers" / name / f)) << name << "/" << f;

  // Run from an unrelated directory; $TESSERA_ROOT names no checkout, so a binary that looked
  // anywhere but its install would find nothing.
  const fs::path cwd = scratch / "elsewhere";
  fs::create_directories(cwd);
  const std::string env = "cd " + cwd.string() + " && env -u TESSERA_HOME -u TESSERA_DATA_DIR " +
                          "TESSERA_ROOT=" + (scratch / "no_checkout").string() + " ";
  const std::string tessera = (prefix / "bin" / "tessera").string();
  const auto run = [&](const std::string& args) { return run_command(env + tessera + " " + args); };

  RunResult r = run("--version");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "data root: " + share.string() + " (the install of " + tessera))
      << r.output;
  r = run("train --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "llama3.1_8B-pretrain")) << r.output;
  // The default experiment: planned (its tokenizer gives the vocabulary), then trained for two
  // iterations on its dataset in the install.
  r = run("memory --gpu H100");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r =
      run("train --train_iters 2 --lr_warmup_iters 1 --eval_interval 2 --eval_iters 1 "
          "--seq_length 64 --micro_batch_size 1 --global_batch_size 1 --log_interval 1 "
          "--workspace ws --work_group g --user_name u --exp_name e");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string info =
      read(cwd / "ws" / "g" / "u" / "e" / "logs" / "pre_trainer" / "rank-0" / "info.log");
  EXPECT_TRUE(contains(info, (share / "data" / "brown_llama3_text_document").string())) << info;
  EXPECT_TRUE(contains(info, "iteration        2/       2")) << info;

  // Every shipped tokenizer name resolves in the install.
  std::ofstream(cwd / "text.txt") << "The Fulton County Grand Jury said Friday an investigation.\n";
  for (const std::string& name : shipped_tokenizer_names()) {
    r = run("preprocess --input text.txt --output-prefix tok_" + name +
            " --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + name);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
  }

  // A file missing from the install: the error names it and the search, and the checkout is not
  // consulted instead.
  const fs::path qwen3 = share / "tokenizers" / "qwen3" / "tokenizer.json";
  fs::remove(qwen3);
  r =
      run("preprocess --input text.txt --output-prefix missing --tokenizer-type "
          "HuggingFaceTokenizer --tokenizer-model qwen3");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (const std::string& part :
       std::vector<std::string>{qwen3.string(), "$TESSERA_HOME (not set)",
                                "the install of " + tessera, "this install is incomplete"})
    EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;

  // $TESSERA_HOME replaces the install beside the binary: an empty one has nothing, and the
  // errors name what was looked for there.
  const fs::path empty = scratch / "empty_home";
  fs::create_directories(empty);
  const std::string home = "TESSERA_HOME=" + empty.string() + " ";
  r = run_command(env + home + tessera + " --version");
  EXPECT_TRUE(contains(r.output, "data root: " + empty.string() + " ($TESSERA_HOME)")) << r.output;
  r = run_command(env + home + tessera +
                  " train --mock_data true --tokenizer_type HuggingFaceTokenizer "
                  "--tokenizer_model llama3 --train_iters 1 --lr_warmup_iters 0 --workspace ws");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (const std::string& part :
       std::vector<std::string>{(empty / "tokenizers" / "llama3" / "tokenizer.json").string(),
                                "$TESSERA_HOME=" + empty.string(), "PREFIX/share/tessera"})
    EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;
  r = run_command(env + home + tessera + " train --workspace ws");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  for (const std::string& part :
       std::vector<std::string>{(empty / "data" / "brown_llama3_text_document.bin").string(),
                                "$TESSERA_HOME=" + empty.string()})
    EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;
}

}  // namespace
}  // namespace tessera
