// The output-location checks commands run before their work: what they accept, the reason they
// give otherwise (naming the path at fault), and that they create nothing.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/scratch_dir.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

void touch(const fs::path& p) {
  std::ofstream(p) << "x";
}

TEST(OutputPath, ExistingOrCreatableDirectoriesPassAndNothingIsCreated) {
  ScratchDir dir;
  EXPECT_EQ(output_directory_problem(dir.path()), std::nullopt);
  EXPECT_EQ(output_directory_problem(dir / "new/deeper/out"), std::nullopt);
  EXPECT_EQ(output_directory_problem(dir / "new/"), std::nullopt);
  EXPECT_EQ(output_file_problem(dir / "new/logits.safetensors"), std::nullopt);
  EXPECT_FALSE(fs::exists(dir / "new"));
}

TEST(OutputPath, DirectoryUnderARegularFileNamesTheFile) {
  ScratchDir dir;
  touch(dir / "notes.txt");
  const std::string file = (dir / "notes.txt").string();
  EXPECT_EQ(output_directory_problem(dir / "notes.txt/out"),
            file + " is a regular file, not a directory");
  EXPECT_EQ(output_directory_problem(dir / "notes.txt/a/b"),
            file + " is a regular file, not a directory");
  EXPECT_EQ(output_directory_problem(dir / "notes.txt"),
            file + " is a regular file, not a directory");
  EXPECT_EQ(output_file_problem(dir / "notes.txt/logits.safetensors"),
            file + " is a regular file, not a directory");
  EXPECT_EQ(output_directory_problem("/dev/null/out"),
            "/dev/null is a special file, not a directory");
  EXPECT_FALSE(fs::is_directory(dir / "notes.txt"));
}

TEST(OutputPath, FileChecksRejectDirectoriesAndMissingNames) {
  ScratchDir dir;
  EXPECT_EQ(output_file_problem(dir.path()), dir.path().string() + " is a directory");
  EXPECT_EQ(output_file_problem(dir / "out/"),
            (dir / "out/").string() + " ends in '/': no file name");
  EXPECT_EQ(output_file_problem(""), "the path is empty");
  EXPECT_EQ(output_directory_problem(""), "the path is empty");
}

TEST(OutputPath, BrokenSymbolicLinkIsNamed) {
  ScratchDir dir;
  fs::create_symlink(dir / "gone", dir / "link");
  EXPECT_EQ(output_directory_problem(dir / "link"),
            (dir / "link").string() + " is a symbolic link to nothing");
}

TEST(OutputPath, ReadOnlyDirectoryIsNotWritable) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may write into a read-only directory";
  ScratchDir dir;
  fs::create_directories(dir / "ro");
  fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_EQ(output_directory_problem(dir / "ro/out"),
            (dir / "ro").string() + " is not writable: Permission denied");
  fs::permissions(dir / "ro", fs::perms::owner_all);
}

TEST(OutputPath, RequireThrowsAConfigErrorNamingKeyValueAndReason) {
  ScratchDir dir;
  touch(dir / "f");
  const std::string value = (dir / "f/out").string();
  try {
    require_output_directory(value, "command line", "to-hf");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "to-hf");
    EXPECT_EQ(e.value(), value);
    EXPECT_EQ(std::string(e.what()),
              "command line: key 'to-hf' has value '" + value +
                  "': expected a directory that can be created and written (" +
                  (dir / "f").string() + " is a regular file, not a directory)");
  }
  EXPECT_THROW(require_output_file(dir / "f/x.bin", "command line", "out"), ConfigError);
  EXPECT_NO_THROW(require_output_file(dir / "x.bin", "command line", "out"));
  EXPECT_NO_THROW(require_output_directory(dir / "d", "command line", "o"));
}

}  // namespace
}  // namespace tessera
