// What make_run_setup derives for the model's runtime from the data keys.
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "common/scratch_dir.h"
#include "tessera/data/chat.h"
#include "tessera/run/run_setup.h"

namespace tessera {
namespace {

// The output head runs on the loss rows alone (head_on_loss_rows) for chat data whose loss mask
// leaves tokens out, wrapped as well as packed, in a blend too; not for data without roles, nor
// when the mask keeps every token.
TEST(RunSetupRuntime, MaskedChatDataPutsTheHeadOnTheLossRows) {
  testing::ScratchDir dir;
  const std::string chat = (dir / "chat").string(), plain = (dir / "plain").string();
  // Validation asks for the files to exist; the setup reads none of them.
  for (const std::string& file : {chat + ".bin", chat + ".idx", plain + ".bin", plain + ".idx", chat_roles_prefix(chat) + ".idx"})
    std::ofstream(file) << "";
  const auto head_on_loss_rows = [](const std::string& data) {
    const Experiment e = testing::experiment_from_yaml("model: tiny_llama\n" + data);
    return make_run_setup(e, {1, DType::F32, 0}, [] { return int64_t{512}; }).runtime.head_on_loss_rows;
  };
  EXPECT_TRUE(head_on_loss_rows("data_path: " + chat + "\n"));
  EXPECT_TRUE(head_on_loss_rows("data_path: 0.5 " + plain + " 0.5 " + chat + "\n"));
  EXPECT_FALSE(head_on_loss_rows("data_path: " + plain + "\n"));
  EXPECT_FALSE(head_on_loss_rows("data_path: " + chat + "\nloss_mask: all\n"));
  EXPECT_FALSE(head_on_loss_rows("mock_data: true\n"));
}

}  // namespace
}  // namespace tessera
