// `tessera preprocess --chat` end to end: conversations and prompt/completion lines become a
// token dataset and an aligned role dataset; bad conversations and over-long samples are
// refused with exit 2 naming the line, and nothing is written; truncate and drop are counted.
#include <algorithm>
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data_fixtures.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/data/chat.h"
#include "tessera/data/indexed_dataset.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::run_tessera;
using testing::ScratchDir;

const char* const kLines[] = {
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})",
    R"({"prompt": "Capital of France?", "completion": " Paris."})",
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today, my friend? Ask me anything at all, I am here to help."}]})",
};

std::set<std::string> files_under(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) out.insert(f.path().string());
  return out;
}

std::vector<int32_t> read_document(const IndexedDataset& d, uint64_t i) {
  std::vector<int32_t> out(static_cast<size_t>(d.sequence_length(i)));
  d.read(i, 0, out.size(), out.data());
  return out;
}

void write_lines(const fs::path& path, const std::vector<std::string>& lines) {
  std::ofstream out(path);
  for (const auto& l : lines) out << l << "\n";
}

TEST(ChatPreprocess, WritesTokensAndTheirRolesAsTheChatTemplateRendersThem) {
  ScratchDir dir;
  write_lines(dir / "chat.jsonl", {kLines[0], kLines[1], kLines[2]});
  const auto r = run_tessera("preprocess --input " + (dir / "chat.jsonl").string() + " --output-prefix " +
                             (dir / "out" / "sft").string() + " --tokenizer-model qwen3 --chat --workers 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "_chat_document.bin/.idx: 3 documents")) << r.output;
  EXPECT_TRUE(contains(r.output, "_chat_document_roles.bin/.idx: the role of each token")) << r.output;

  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = "qwen3";
  const auto tokenizer = make_tokenizer(data);
  const ChatFormat chat(tokenizer_json_path("qwen3"), *tokenizer);
  const std::string prefix = (dir / "out" / "sft_chat_document").string();
  const IndexedDataset tokens(prefix, tokenizer->vocab_size()), roles(chat_roles_prefix(prefix));
  EXPECT_EQ(roles.dtype(), TokenDType::UInt8);
  ASSERT_EQ(tokens.documents(), 3u);
  ASSERT_EQ(roles.documents(), 3u);
  for (uint64_t d = 0; d < 3; ++d) {
    const ChatSample expected = chat.encode(nlohmann::ordered_json::parse(kLines[d]), "line");
    EXPECT_EQ(read_document(tokens, d), expected.ids) << d;
    const std::vector<int32_t> got_roles = read_document(roles, d);
    EXPECT_EQ(std::vector<uint8_t>(got_roles.begin(), got_roles.end()), expected.roles) << d;
  }
  // The first conversation's assistant tokens are its answer and closing token.
  const std::vector<int32_t> ids = read_document(tokens, 0), r0 = read_document(roles, 0);
  std::vector<int32_t> answer;
  for (size_t k = 0; k < ids.size(); ++k)
    if (token_role(static_cast<uint8_t>(r0[k])) == TokenRole::Assistant) answer.push_back(ids[k]);
  EXPECT_EQ(tokenizer->decode(answer), "4<|im_end|>");
}

TEST(ChatPreprocess, BadConversationsExitTwoNamingTheLineAndWriteNothing) {
  ScratchDir dir;
  const std::set<std::string> before_files = [&] {
    write_lines(dir / "unknown_role.jsonl", {kLines[0], R"({"messages": [{"role": "bot", "content": "x"}]})"});
    write_lines(dir / "ends_on_user.jsonl", {kLines[1], kLines[0], R"({"messages": [{"role": "user", "content": "x"}]})"});
    write_lines(dir / "not_json.jsonl", {kLines[0], "{\"messages\": ["});
    write_lines(dir / "text.jsonl", {R"({"text": "plain"})"});
    return files_under(dir.path());
  }();
  for (const auto& [file, parts] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"unknown_role.jsonl", {"unknown_role.jsonl:2: messages[0].role is \"bot\""}},
           {"ends_on_user.jsonl", {"ends_on_user.jsonl:3: the conversation ends with a 'user' message"}},
           {"not_json.jsonl", {"not_json.jsonl:2: invalid JSON"}},
           {"text.jsonl", {"text.jsonl:1: neither 'messages' nor 'prompt' and 'completion'"}}}) {
    SCOPED_TRACE(file);
    const auto r = run_tessera("preprocess --input " + (dir / file).string() + " --output-prefix " +
                               (dir / "out" / "sft").string() + " --tokenizer-model qwen3 --chat");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    for (const auto& part : parts) EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;
    EXPECT_EQ(files_under(dir.path()), before_files);
  }
  // Chat needs a tokenizer with a chat template, and JSON lines.
  auto r = run_tessera("preprocess --input " + (dir / "text.jsonl").string() + " --output-prefix " +
                       (dir / "out" / "x").string() + " --chat");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'chat'")) << r.output;
  r = run_tessera("preprocess --input " + (dir / "text.jsonl").string() + " --output-prefix " +
                  (dir / "out" / "x").string() + " --tokenizer-model llama2 --chat");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "no chat template")) << r.output;
  // Options that would do nothing are refused: fields to read with --chat, limits without it.
  r = run_tessera("preprocess --input " + (dir / "text.jsonl").string() + " --output-prefix " +
                  (dir / "out" / "x").string() + " --tokenizer-model qwen3 --chat --json-keys text");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "no --json-keys with --chat")) << r.output;
  r = run_tessera("preprocess --input " + (dir / "text.jsonl").string() + " --output-prefix " +
                  (dir / "out" / "x").string() + " --overlong drop");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'overlong'")) << r.output;
  EXPECT_EQ(files_under(dir.path()), before_files);
}

TEST(ChatPreprocess, OverlongSamplesAreRefusedTruncatedOrDroppedAndCounted) {
  ScratchDir dir;
  write_lines(dir / "chat.jsonl", {kLines[0], kLines[1], kLines[2]});
  const std::string base = "preprocess --input " + (dir / "chat.jsonl").string() + " --tokenizer-model qwen3 --chat --seq-length 30";
  // The third conversation is longer than 30 tokens; the others are not.
  auto r = run_tessera(base + " --output-prefix " + (dir / "refused").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "chat.jsonl:3: the sample has")) << r.output;
  EXPECT_TRUE(contains(r.output, "more than --seq-length 30; choose --overlong truncate")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "refused_chat_document.bin"));

  r = run_tessera(base + " --overlong truncate --output-prefix " + (dir / "cut").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "samples over --seq-length 30: 1 truncated, 0 dropped")) << r.output;
  const IndexedDataset cut((dir / "cut_chat_document").string());
  ASSERT_EQ(cut.documents(), 3u);
  EXPECT_EQ(cut.sequence_length(2), 30);
  EXPECT_EQ(IndexedDataset(chat_roles_prefix((dir / "cut_chat_document").string())).sequence_length(2), 30);

  r = run_tessera(base + " --overlong drop --output-prefix " + (dir / "kept").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "samples over --seq-length 30: 0 truncated, 1 dropped")) << r.output;
  EXPECT_EQ(IndexedDataset((dir / "kept_chat_document").string()).documents(), 2u);
}

// Training on chat data counts only the tokens loss_mask keeps: the iteration line and
// metrics.jsonl say how many; completion keeps fewer than assistant, all keeps every one.
// Validation on the held-out split takes the same mask.
// (The loss values themselves are tested at the model: Model.MaskedTargetsAddNothingToLossOrGradients.)
TEST(ChatPreprocess, TrainingCountsOnlyTheMaskedTokens) {
  ScratchDir dir;
  {
    std::ofstream out(dir / "chat.jsonl");
    // Two-turn conversations: completion (the last turn) keeps fewer tokens than assistant.
    for (int i = 0; i < 24; ++i)
      out << R"({"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."}, )"
             R"({"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red, like a rose."}]})"
          << "\n";
  }
  auto r = run_tessera("preprocess --input " + (dir / "chat.jsonl").string() + " --output-prefix " +
                       (dir / "sft").string() + " --tokenizer-model qwen3 --chat --workers 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, int64_t> loss_tokens;
  std::map<std::string, double> eval_loss;
  for (const std::string mask : {"assistant", "completion", "all"}) {
    SCOPED_TRACE(mask);
    r = testing::run_command(
        "OMP_NUM_THREADS=1 " + std::string(TESSERA_BINARY) +
        " train --model tiny_llama --device cpu --tokenizer_model qwen3 --num_layers 1 --hidden_size 16 "
        "--ffn_hidden_size 32 --num_attention_heads 2 --num_query_groups 1 --seq_length 32 "
        "--micro_batch_size 2 --global_batch_size 4 --train_iters 2 --lr 0.001 --lr_warmup_iters 0 "
        "--split 100,0,0 --train_data_path null --data_path " + (dir / "sft_chat_document").string() +
        " --loss_mask " + mask + " --workspace " + (dir / "ws").string() + " --work_group g --user_name u --exp_name " + mask);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream metrics(dir / "ws" / "g" / "u" / mask / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss_tokens")) loss_tokens[mask] = j["loss_tokens"];  // the last iteration's
    }
    const std::string info = testing::read_file(dir / "ws" / "g" / "u" / mask / "logs" / "pre_trainer" / "rank-0" / "info.log");
    EXPECT_EQ(contains(info, "| loss tokens: "), mask != "all") << info;
  }
  EXPECT_EQ(loss_tokens["all"], 4 * 32);
  EXPECT_GT(loss_tokens["assistant"], 0);
  EXPECT_LT(loss_tokens["completion"], loss_tokens["assistant"]);
  EXPECT_LT(loss_tokens["assistant"], loss_tokens["all"]);
  // Validation of the same (starting) weights on the held-out split, under each mask: the
  // losses differ by what they average over.
  for (const std::string mask : {"assistant", "completion", "all"}) {
    r = testing::run_command(
        "OMP_NUM_THREADS=1 " + std::string(TESSERA_BINARY) +
        " train --model tiny_llama --device cpu --tokenizer_model qwen3 --num_layers 1 --hidden_size 16 "
        "--ffn_hidden_size 32 --num_attention_heads 2 --num_query_groups 1 --seq_length 32 "
        "--micro_batch_size 2 --global_batch_size 4 --train_iters 2 --lr_warmup_iters 0 --skip_train "
        "--eval_interval 1 --eval_iters 2 --split 80,20,0 --train_data_path null --data_path " +
        (dir / "sft_chat_document").string() + " --loss_mask " + mask + " --workspace " +
        (dir / "ws").string() + " --work_group g --user_name u --exp_name eval_" + mask);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream metrics(dir / "ws" / "g" / "u" / ("eval_" + mask) / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("eval_lm_loss")) eval_loss[mask] = j["eval_lm_loss"];
    }
  }
  ASSERT_EQ(eval_loss.size(), 3u);
  EXPECT_NE(eval_loss["assistant"], eval_loss["all"]);
  EXPECT_NE(eval_loss["completion"], eval_loss["assistant"]);
}

// Conversations packed whole (bfd) train on the CPU backend with positions and attention per
// document, the log giving the packing efficiency; what packing does not compose with yet is
// refused naming the key.
TEST(ChatPreprocess, PackedConversationsTrainWithinTheirDocuments) {
  ScratchDir dir;
  {
    std::ofstream out(dir / "chat.jsonl");
    for (int i = 0; i < 8; ++i)
      for (const char* line : kLines) out << line << "\n";
  }
  auto r = run_tessera("preprocess --input " + (dir / "chat.jsonl").string() + " --output-prefix " +
                       (dir / "sft").string() + " --tokenizer-model qwen3 --chat --workers 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string args =
      " train --model tiny_llama --device cpu --tokenizer_model qwen3 --num_layers 1 --hidden_size 16 "
      "--ffn_hidden_size 32 --num_attention_heads 2 --num_query_groups 1 --seq_length 64 "
      "--micro_batch_size 2 --global_batch_size 2 --train_iters 2 --lr_warmup_iters 0 "
      "--split 100,0,0 --train_data_path null --data_path " + (dir / "sft_chat_document").string() +
      " --packing_strategy bfd --reset_position_ids --reset_attention_mask --workspace " +
      (dir / "ws").string() +
      " --work_group g --user_name u";
  r = testing::run_command("OMP_NUM_THREADS=1 " + std::string(TESSERA_BINARY) + args + " --exp_name packed");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "| loss tokens: ")) << r.output;
  EXPECT_TRUE(contains(r.output, "% of them real tokens (packing efficiency)")) << r.output;
  EXPECT_TRUE(contains(r.output, "| real tokens per rank (tokens/s/rank): ")) << r.output;
  const auto metrics = testing::read_file(dir / "ws" / "g" / "u" / "packed" / "metrics.jsonl");
  EXPECT_TRUE(contains(metrics, "\"packing_efficiency\":0.")) << metrics;
  EXPECT_TRUE(contains(metrics, "\"real_tokens_per_s_per_gpu\":")) << metrics;
  r = run_tessera(args + " --exp_name mla --model tiny_mla --num_query_groups 2 --moe_layer_freq 1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'reset_position_ids' has value 'true': expected false with multi_latent_attention")) << r.output;
}

// Preference pairs (TRL's prompt, chosen, rejected): two documents per pair, the chosen answer
// then the rejected one after the same prompt tokens; bad pairs exit 2 naming line and field.
TEST(PreferencePreprocess, WritesEachPairAsTwoDocumentsSharingTheirPrompt) {
  ScratchDir dir;
  const std::vector<std::string> pairs = {
      R"({"prompt": "2+2?", "chosen": "4", "rejected": "5, or so"})",
      R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}], )"
      R"("chosen": [{"role": "assistant", "content": "Paris."}], "rejected": [{"role": "assistant", "content": "Lyon, I think."}]})"};
  write_lines(dir / "pairs.jsonl", pairs);
  auto r = run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() +
                       " --output-prefix " + (dir / "p").string() + " --tokenizer-model qwen3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "_preference_document.bin/.idx: 4 documents")) << r.output;
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = "qwen3";
  const auto tokenizer = make_tokenizer(data);
  const ChatFormat chat(tokenizer_json_path("qwen3"), *tokenizer);
  const std::string prefix = (dir / "p_preference_document").string();
  const IndexedDataset tokens(prefix), roles(chat_roles_prefix(prefix));
  ASSERT_EQ(tokens.documents(), 4u);
  for (size_t k = 0; k < pairs.size(); ++k) {
    const auto [chosen, rejected] = chat.encode_preference(nlohmann::ordered_json::parse(pairs[k]), "pair");
    EXPECT_EQ(read_document(tokens, 2 * k), chosen.ids) << k;
    EXPECT_EQ(read_document(tokens, 2 * k + 1), rejected.ids) << k;
    const auto chosen_roles = read_document(roles, 2 * k);
    // The prompt's tokens are the same on both sides: up to the first assistant token.
    size_t prompt = 0;
    while (token_role(static_cast<uint8_t>(chosen_roles[prompt])) != TokenRole::Assistant) ++prompt;
    EXPECT_GT(prompt, 0u);
    EXPECT_TRUE(std::equal(chosen.ids.begin(), chosen.ids.begin() + prompt, rejected.ids.begin())) << k;
    EXPECT_NE(chosen.ids, rejected.ids);
  }

  const std::set<std::string> before = files_under(dir.path());
  for (const auto& [line, part] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a", "chosen": "b"})", "pairs.jsonl:2: no 'rejected'"},
           {R"({"prompt": "a", "chosen": "b", "rejected": "b"})", "'chosen' and 'rejected' are the same"},
           {R"({"prompt": "a", "chosen": "", "rejected": "b"})", "pairs.jsonl:2: 'chosen' is empty"},
           {R"({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], "rejected": "c"})",
            "chosen holds a 'user' message"}}) {
    SCOPED_TRACE(line);
    write_lines(dir / "pairs.jsonl", {pairs[0], line});
    r = run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() +
                    " --output-prefix " + (dir / "bad" / "p").string() + " --tokenizer-model qwen3");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;
    EXPECT_EQ(files_under(dir.path()), before);
  }
  // A side longer than --seq-length: refused naming the side, or the pair dropped, counted.
  write_lines(dir / "pairs.jsonl", pairs);
  r = run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() + " --output-prefix " +
                  (dir / "long" / "p").string() + " --tokenizer-model qwen3 --seq-length 12");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "pairs.jsonl:2: the chosen side has")) << r.output;
  r = run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() + " --output-prefix " +
                  (dir / "long" / "p").string() + " --tokenizer-model qwen3 --seq-length 12 --overlong drop");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "2 documents")) << r.output;
  EXPECT_TRUE(contains(r.output, "0 truncated, 1 dropped")) << r.output;
}

}  // namespace
}  // namespace tessera
