// The option syntax every command shares (core/command_line.h).
#include "tessera/core/command_line.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

TEST(CommandLine, DashesAndUnderscoresNameTheSameOption) {
  for (const char* arg : {"--num-gpus", "--num_gpus", "--num-gpus=8", "--num_gpus=8"}) {
    SCOPED_TRACE(arg);
    const auto o = parse_command_line_option(arg);
    ASSERT_TRUE(o.has_value());
    EXPECT_EQ(o->name, "num_gpus");
  }
  EXPECT_EQ(option_name("nproc-per-node"), "nproc_per_node");
}

TEST(CommandLine, AnInlineValueIsSplitAtTheFirstEqualsAndKeepsItsDashes) {
  const auto o = parse_command_line_option("--data-path=/data/my-corpus=v2");
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->name, "data_path");
  ASSERT_TRUE(o->value.has_value());
  EXPECT_EQ(*o->value, "/data/my-corpus=v2");

  const auto empty = parse_command_line_option("--exp_name=");
  ASSERT_TRUE(empty.has_value());
  EXPECT_EQ(empty->value, std::optional<std::string>(""));  // given, and empty
  EXPECT_FALSE(parse_command_line_option("--bf16")->value.has_value());
}

TEST(CommandLine, PositionalsShortOptionsAndTheEndOfOptionsAreNotOptions) {
  for (const char* arg : {"train", "-o", "-h", "-", "--", "-1", "a--b"}) {
    SCOPED_TRACE(arg);
    EXPECT_FALSE(parse_command_line_option(arg).has_value());
  }
}

}  // namespace
}  // namespace tessera
