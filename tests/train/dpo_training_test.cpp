// objective dpo through the command: preference pairs preprocessed with a chat template, a DPO
// run from a checkpoint's weights reports TRL's statistics (its first step compares the policy
// with itself: loss ln 2, rewards 0), validates on held-out pairs, and lowers its loss on pairs
// it sees again; what it does not run is refused by name. A reference from another checkpoint
// (reference_load) is the same precomputed or as a frozen copy, and a frozen copy of it
// resumes.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "common/tiny_run.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// Yes-or-no questions as preference pairs (chosen the right answer, rejected the other),
// `repeats` times, preprocessed with qwen3's chat template into dir/p_preference_document.
void preprocess_pairs(const ScratchDir& dir,
                      const std::vector<std::pair<std::string, std::string>>& qa, int repeats) {
  {
    std::ofstream out(dir / "pairs.jsonl");
    for (int repeat = 0; repeat < repeats; ++repeat)
      for (const auto& [q, a] : qa)
        out << nlohmann::json{{"prompt", {{{"role", "user"}, {"content", q}}}},
                              {"chosen", {{{"role", "assistant"}, {"content", a}}}},
                              {"rejected",
                               {{{"role", "assistant"}, {"content", a == "yes" ? "no" : "yes"}}}}}
                   .dump()
            << "\n";
  }
  const RunResult r =
      run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() +
                  " --output-prefix " + (dir / "p").string() + " --tokenizer-model qwen3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

const std::vector<std::pair<std::string, std::string>> kFourQuestions = {
    {"Is tennis a sport?", "yes"}, {"Is jazz a sport?", "no"}, {"Is golf a sport?", "yes"}, {"Is a piano a sport?", "no"}};

// The tiny model the runs train, in dir's workspace.
std::string tiny_model(const ScratchDir& dir) {
  return "train --device cpu --model tiny_llama --tokenizer_model qwen3 --num_layers 1 "
         "--hidden_size 32 "
         "--ffn_hidden_size 64 --num_attention_heads 2 --num_query_groups 1 --seq_length 24 "
         "--log_progress false --train_data_path null --workspace " +
         dir.path().string() + " --work_group g --user_name u";
}

TEST(DpoTraining, ReportsTrlStatisticsValidatesAndLearnsFromPairs) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(preprocess_pairs(dir,
                                           {{"Is tennis a sport?", "yes"},
                                            {"Is a piano a sport?", "no"},
                                            {"Is golf a sport?", "yes"},
                                            {"Is jazz a sport?", "no"},
                                            {"Is hockey a sport?", "yes"},
                                            {"Is a violin a sport?", "no"}},
                                           4));
  const std::string model = tiny_model(dir);
  RunResult r;
  r = run_tessera(model + " --train_iters 1 --lr_warmup_iters 0 --mock_data true --save " +
                  (dir / "start").string() + " --exp_name start");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string dpo = model + " --objective dpo --finetune --load " + (dir / "start").string() +
                          " --data_path " + (dir / "p_preference_document").string() +
                          " --split 75,25,0 --micro_batch_size 1 --global_batch_size 6 "
                          "--lr 3e-3 --lr_warmup_iters 0 --log_interval 1 --dpo_beta 0.5";
  r = run_tessera(
      dpo +
      " --train_iters 36 --eval_interval 36 --eval_iters 1 --tensorboard_dir tb --exp_name dpo");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 18 training pairs over 12 epochs, 6 validation pairs: each computed once, and kept.
  EXPECT_NE(r.output.find(
                "dpo: reference log-probabilities of the 24 pairs this run reads: 24 computed with "
                "the checkpoint"),
            std::string::npos)
      << r.output;
  fs::path kept;
  for (const auto& f : fs::directory_iterator(dir.path()))
    if (f.path().filename().string().starts_with("p_preference_document_reference_"))
      kept = f.path();
  ASSERT_FALSE(kept.empty()) << "no reference log-probabilities beside the dataset";
  EXPECT_NE(r.output.find("dpo validation: loss"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loss tokens"), std::string::npos) << r.output;  // pairs, not positions
  std::vector<nlohmann::json> steps;
  bool validated = false;
  for (const auto& j : metrics_lines(dir / "g" / "u" / "dpo" / "metrics.jsonl")) {
    if (j.contains("rewards/accuracies")) steps.push_back(j);
    validated = validated || j.contains("eval_rewards/accuracies");
  }
  ASSERT_EQ(steps.size(), 36u);
  EXPECT_TRUE(validated);
  // Step 1: the policy is the reference.
  EXPECT_NEAR(steps[0]["lm_loss"].get<double>(), std::log(2.0), 1e-5);
  EXPECT_NEAR(steps[0]["rewards/chosen"].get<double>(), 0.0, 1e-5);
  EXPECT_NEAR(steps[0]["rewards/margins"].get<double>(), 0.0, 1e-5);
  for (const char* key : {"rewards/rejected", "logps/chosen", "logps/rejected"})
    EXPECT_TRUE(steps[0].contains(key)) << key;
  // The 18 training pairs come round every 3 steps (an epoch, each in its own order): by the
  // twelfth epoch their loss is below ln 2 and the chosen answers gain on the rejected ones.
  double late_loss = 0, late_margin = 0;
  for (size_t i = 33; i < 36; ++i)
    late_loss += steps[i]["lm_loss"].get<double>() / 3,
        late_margin += steps[i]["rewards/margins"].get<double>() / 3;
  std::printf("dpo: steps 34-36 loss %.4f (ln 2 = 0.6931), rewards/margins %.4f\n", late_loss,
              late_margin);
  EXPECT_LT(late_loss, std::log(2.0) - 0.05);
  EXPECT_GT(late_margin, 0.1);

  // TensorBoard carries TRL's statistics as metrics.jsonl has them, and tessera plot draws them.
  fs::path events;
  for (const auto& f : fs::recursive_directory_iterator(dir / "g" / "u" / "dpo"))
    if (f.path().filename().string().starts_with("events.out.tfevents")) events = f.path();
  ASSERT_FALSE(events.empty());
  const RunResult read = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                                     "/obs/read_tfevents.py " + events.string());
  ASSERT_EQ(read.exit_code, 0) << read.output;
  std::map<std::pair<std::string, int64_t>, double> tb;
  const nlohmann::json events_read = nlohmann::json::parse(read.output);
  for (const auto& e : events_read["events"])
    if (e.contains("scalars"))
      tb[{e["scalars"][0][0].get<std::string>(), e["step"].get<int64_t>()}] = e["scalars"][0][1];
  for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                          "rewards/margins", "logps/chosen", "logps/rejected"}) {
    ASSERT_EQ(tb.count({key, 36}), 1u) << key;
    EXPECT_EQ(tb.at({key, 36}),
              static_cast<double>(static_cast<float>(steps[35][key].get<double>())))
        << key;
  }
  const RunResult plot =
      run_command(std::string(TESSERA_BINARY) + " plot " + (dir / "g" / "u" / "dpo").string() +
                  " -o " + (dir / "plots").string());
  ASSERT_EQ(plot.exit_code, 0) << plot.output;
  EXPECT_TRUE(fs::exists(dir / "plots" / "dpo_rewards.svg")) << plot.output;

  // SimPO-style (per-token log-probabilities, no reference) with RPO's term: no reference
  // passes, and the policy still learns the pairs.
  r = run_tessera(dpo +
                  " --train_iters 6 --eval_interval 0 --dpo_length_normalize --dpo_reference_free "
                  "--dpo_rpo_alpha 0.5 --exp_name simpo");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dpo: reference-free"), std::string::npos) << r.output;

  // Two data-parallel ranks (threads) train like one: each takes every other pair of a step,
  // and the statistics are summed over both.
  const auto losses = [&](const std::string& name) {
    std::vector<double> out;
    for (const auto& j : metrics_lines(dir / "g" / "u" / name / "metrics.jsonl"))
      if (j.contains("rewards/accuracies")) out.push_back(j["lm_loss"].get<double>());
    return out;
  };
  // A later run from the same reference reads them all; two ranks computing them into a file
  // of their own (every other pair each) give the same values.
  r = run_tessera(dpo + " --train_iters 3 --eval_interval 0 --exp_name one");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(": 0 computed with the checkpoint"), std::string::npos) << r.output;
  r = run_tessera(dpo +
                  " --train_iters 3 --eval_interval 0 --nproc_per_node 2 --exp_name two "
                  "--dpo_reference_logps " +
                  (dir / "two.logps").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> one = losses("one"), two = losses("two");
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(two[i], one[i], 1e-5 * one[i]) << "iteration " << i + 1;
  auto values = [](const fs::path& file) {  // after the header line
    std::ifstream in(file, std::ios::binary);
    std::string header;
    std::getline(in, header);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  // Pairs computed in both files hold the same values; how many were compared.
  auto same_values = [&](const fs::path& a_file, const fs::path& b_file) {
    const std::string a_values = values(a_file), b_values = values(b_file);
    EXPECT_EQ(a_values.size(), 24u * 16);
    EXPECT_EQ(b_values.size(), 24u * 16);
    int compared = 0;
    for (size_t p = 0; p < 24 && 16 * p + 16 <= std::min(a_values.size(), b_values.size()); ++p) {
      double a[2], b[2];
      std::memcpy(a, a_values.data() + 16 * p, 16);
      std::memcpy(b, b_values.data() + 16 * p, 16);
      if (std::isnan(b[0])) continue;
      ++compared;
      EXPECT_EQ(a[0], b[0]) << b_file << " pair " << p;
      EXPECT_EQ(a[1], b[1]) << b_file << " pair " << p;
    }
    return compared;
  };
  // The two-rank run computed its own: the 18 training pairs of its 3 steps (one epoch) and
  // the 6 validation pairs.
  EXPECT_EQ(same_values(kept, dir / "two.logps"), 24);

  // LoRA on the same weights: its reference is the base with the adapters at zero (B starts
  // at zero), whose log-probabilities, computed into a file of its own, are the base's.
  r = run_tessera(
      model + " --objective dpo --lora_rank 4 --lora_alpha 8 --pretrained_checkpoint " +
      (dir / "start").string() + " --data_path " + (dir / "p_preference_document").string() +
      " --split 75,25,0 --micro_batch_size 1 --global_batch_size 6 --lr 3e-3 --lr_warmup_iters 0 "
      "--log_interval 1 --dpo_beta 0.5 --train_iters 3 --eval_interval 0 --exp_name lora "
      "--dpo_reference_logps " +
      (dir / "lora.logps").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(same_values(kept, dir / "lora.logps"), 24);
  const std::vector<double> lora = losses("lora");
  ASSERT_EQ(lora.size(), 3u);
  EXPECT_NEAR(lora[0], std::log(2.0), 1e-6);  // step 1: the policy is its reference

  // ZeRO-1, FSDP, TP 2 with sequence parallelism and CP 2 on two thread ranks, from a fresh
  // initialisation (two query groups, which tensor parallelism splits), each computing the
  // reference into a file of its own: the losses of one rank. Megatron pads the vocabulary to
  // a multiple of make_vocab_size_divisible_by x TP: 256 x 1 and 128 x 2 give every run the
  // same padded vocabulary, hence the same model.
  const std::string fresh =
      model + " --objective dpo --num_query_groups 2 --data_path " +
      (dir / "p_preference_document").string() +
      " --split 75,25,0 --micro_batch_size 1 --global_batch_size 6 --lr 3e-3 "
      "--lr_warmup_iters 0 --log_interval 1 --dpo_beta 0.5 --train_iters 3 --eval_interval 0";
  for (const auto& [name, keys] :
       {std::pair{"fresh_one", "--make_vocab_size_divisible_by 256"},
        std::pair{"fresh_zero1",
                  "--make_vocab_size_divisible_by 256 --use_distributed_optimizer true"},
        std::pair{"fresh_fsdp", "--make_vocab_size_divisible_by 256 --use_torch_fsdp2 true"},
        std::pair{"fresh_tp2",
                  "--make_vocab_size_divisible_by 128 --tensor_model_parallel_size 2 "
                  "--sequence_parallel true"},
        std::pair{"fresh_cp2", "--make_vocab_size_divisible_by 256 --context_parallel_size 2"}}) {
    r = run_tessera(fresh + " --exp_name " + name +
                    (std::string(name) == "fresh_one" ? " " : " --nproc_per_node 2 ") + keys +
                    " --dpo_reference_logps " + (dir / (std::string(name) + ".logps")).string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  // A frozen copy of the reference on the device (one rank, and ZeRO-1's shards of it) gives
  // the precomputed log-probabilities' losses.
  for (const auto& [name, keys] :
       {std::pair{"fresh_copy", ""},
        std::pair{"fresh_copy_zero1", "--nproc_per_node 2 --use_distributed_optimizer true"},
        std::pair{"fresh_copy_cp2", "--nproc_per_node 2 --context_parallel_size 2"}}) {
    r = run_tessera(
        fresh +
        " --make_vocab_size_divisible_by 256 --dpo_precompute_ref_log_probs false --exp_name " +
        name + " " + keys);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("dpo: a frozen copy of the reference"), std::string::npos) << r.output;
  }
  const std::vector<double> fresh_one = losses("fresh_one");
  ASSERT_EQ(fresh_one.size(), 3u);
  for (const char* name :
       {"fresh_zero1", "fresh_fsdp", "fresh_tp2", "fresh_cp2", "fresh_copy", "fresh_copy_zero1", "fresh_copy_cp2"}) {
    const std::vector<double> other = losses(name);
    ASSERT_EQ(other.size(), 3u) << name;
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(other[i], fresh_one[i], 1e-5 * fresh_one[i]) << name << " iteration " << i + 1;
  }

  // Pipeline stages (4 layers): a pair is one micro-batch of its two answers, scored on the
  // last stage after its head's forward, whose backward then takes the answers' pulls; 1F1B,
  // interleaved, and with context parallelism (whose second rank holds none of the answers'
  // rows), with RPO's term and length-normalised log-probabilities, validation included. The
  // losses and validation of one rank.
  const std::string staged = model + " --objective dpo --num_layers 4 --num_query_groups 2 --data_path " +
                             (dir / "p_preference_document").string() +
                             " --split 75,25,0 --micro_batch_size 1 --global_batch_size 6 --lr 3e-3 "
                             "--lr_warmup_iters 0 --log_interval 1 --dpo_beta 0.5 --train_iters 3 "
                             "--eval_interval 3 --eval_iters 1 --dpo_rpo_alpha 0.3 --dpo_length_normalize true "
                             "--make_vocab_size_divisible_by 256";
  const auto validation = [&](const std::string& name) {
    for (const auto& j : metrics_lines(dir / "g" / "u" / name / "metrics.jsonl"))
      if (j.contains("eval_loss_dpo")) return j["eval_loss_dpo"].get<double>();
    return -1.0;
  };
  for (const auto& [name, keys] :
       {std::pair{"staged_one", ""},
        std::pair{"staged_pp2", "--nproc_per_node 2 --pipeline_model_parallel_size 2"},
        std::pair{"staged_vpp2",
                  "--nproc_per_node 2 --pipeline_model_parallel_size 2 --num_layers_per_virtual_pipeline_stage 1"},
        std::pair{"staged_pp2_cp2",
                  "--nproc_per_node 4 --pipeline_model_parallel_size 2 --context_parallel_size 2"}}) {
    r = run_tessera(staged + " --exp_name " + name + " " + keys + " --dpo_reference_logps " +
                    (dir / (std::string(name) + ".logps")).string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::vector<double> staged_one = losses("staged_one");
  ASSERT_EQ(staged_one.size(), 3u);
  ASSERT_GT(validation("staged_one"), 0.0);
  for (const char* name : {"staged_pp2", "staged_vpp2", "staged_pp2_cp2"}) {
    const std::vector<double> other = losses(name);
    ASSERT_EQ(other.size(), 3u) << name;
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(other[i], staged_one[i], 1e-5 * staged_one[i]) << name << " iteration " << i + 1;
    EXPECT_NEAR(validation(name), validation("staged_one"), 1e-5 * validation("staged_one")) << name;
  }
  // A frozen copy of the reference over the stages (each holds its layers' starting weights and
  // swaps them in for a forward-only pass of the step's pairs through the stages): the losses
  // and validation of the precomputed log-probabilities.
  r = run_tessera(staged + " --exp_name staged_copy --nproc_per_node 2 --pipeline_model_parallel_size 2 "
                           "--dpo_precompute_ref_log_probs false");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dpo: a frozen copy of the reference"), std::string::npos) << r.output;
  const std::vector<double> staged_copy = losses("staged_copy");
  ASSERT_EQ(staged_copy.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(staged_copy[i], staged_one[i], 1e-5 * staged_one[i]) << "staged_copy iteration " << i + 1;
  EXPECT_NEAR(validation("staged_copy"), validation("staged_one"), 1e-5 * validation("staged_one"));

  // Resumed: its checkpoint records the reference, whose log-probabilities are read back, and
  // it continues as the run that was not stopped.
  r = run_tessera(dpo + " --train_iters 6 --eval_interval 0 --save " + (dir / "dpo_ckpt").string() +
                  " --save_interval 3 --exit_interval 3 --exp_name stopped");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string resume =
      model + " --objective dpo --load " + (dir / "dpo_ckpt").string() + " --data_path " +
      (dir / "p_preference_document").string() +
      " --split 75,25,0 --micro_batch_size 1 --global_batch_size 6 --lr 3e-3 "
      "--lr_warmup_iters 0 --log_interval 1 --dpo_beta 0.5 --train_iters 6 "
      "--eval_interval 0 --exp_name stopped";
  r = run_tessera(resume);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(": 0 computed with the checkpoint"), std::string::npos) << r.output;
  r = run_tessera(dpo + " --train_iters 6 --eval_interval 0 --exp_name straight");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> resumed = losses("stopped"), straight = losses("straight");
  ASSERT_EQ(resumed.size(), 6u);
  ASSERT_EQ(straight.size(), 6u);
  for (size_t i = 3; i < 6; ++i)
    EXPECT_NEAR(resumed[i], straight[i], 1e-6 * straight[i]) << "iteration " << i + 1;
  // Without the file a resumed run cannot have them: refused naming it, nothing trained.
  fs::rename(kept, dir / "aside.logps");
  r = run_tessera(resume + " --train_iters 9");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find(kept.string() + ": no reference log-probabilities of"), std::string::npos)
      << r.output;
  fs::rename(dir / "aside.logps", kept);

  // A damaged file, or one of another dataset content, is refused by name.
  fs::resize_file(dir / "two.logps", fs::file_size(dir / "two.logps") - 8);
  r = run_tessera(dpo + " --train_iters 1 --eval_interval 0 --exp_name cut --dpo_reference_logps " +
                  (dir / "two.logps").string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("the file is damaged or was cut short"), std::string::npos) << r.output;
  {
    std::ofstream more(dir / "pairs.jsonl", std::ios::app);
    more << nlohmann::json{{"prompt", "Is chess a sport?"}, {"chosen", "yes"}, {"rejected", "no"}}
                .dump()
         << "\n";
  }
  ASSERT_EQ(run_tessera("preprocess --preference --input " + (dir / "pairs.jsonl").string() +
                        " --output-prefix " + (dir / "p").string() + " --tokenizer-model qwen3")
                .exit_code,
            0);
  r = run_tessera(dpo + " --train_iters 1 --eval_interval 0 --exp_name changed");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find(kept.string() + ": reference log-probabilities computed for the dataset"),
            std::string::npos)
      << r.output;

  // Data that is not preference pairs is refused naming the file.
  r = run_tessera(dpo + " --train_iters 2 --data_path " +
                  (dir / "p_preference_document_roles").string() + " --exp_name notpairs");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("objective dpo trains on preference pairs"), std::string::npos)
      << r.output;

  // So are conversations, whose documents have roles too and come in an even count here.
  {
    std::ofstream out(dir / "chat.jsonl");
    for (const auto& [q, a] : kFourQuestions)
      out << nlohmann::json{{"messages", {{{"role", "user"}, {"content", q}}, {{"role", "assistant"}, {"content", a}}}}}
                 .dump()
          << "\n";
  }
  ASSERT_EQ(run_tessera("preprocess --chat --input " + (dir / "chat.jsonl").string() + " --output-prefix " +
                        (dir / "c").string() + " --tokenizer-model qwen3")
                .exit_code,
            0);
  r = run_tessera(dpo + " --train_iters 2 --data_path " + (dir / "c_chat_document").string() +
                  " --exp_name conversations");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find((dir / "c_chat_document").string() + ": documents 0 and 1 (pair 0) differ at token "),
            std::string::npos)
      << r.output;

  // Refused by name: several sequences per micro-batch.
  r = run_tessera(dpo +
                  " --train_iters 2 --micro_batch_size 2 --global_batch_size 4 --exp_name mbs");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("key 'micro_batch_size' has value '2': expected 1 with objective dpo"),
            std::string::npos)
      << r.output;
}

TEST(DpoTraining, AReferenceFromAnotherCheckpoint) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(preprocess_pairs(dir, kFourQuestions, 1));
  const std::string model = tiny_model(dir);
  RunResult r;
  // Two models: the policy's start, and another one the reference.
  for (const auto& [name, seed] : {std::pair{"start", "1"}, std::pair{"other", "7"}}) {
    r = run_tessera(model + " --train_iters 2 --lr_warmup_iters 0 --mock_data true --seed " + seed +
                    " --save " + (dir / name).string() + " --exp_name " + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::string dpo = model + " --objective dpo --finetune --load " + (dir / "start").string() +
                          " --data_path " + (dir / "p_preference_document").string() +
                          " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --lr 3e-3 "
                          "--lr_warmup_iters 0 --log_interval 1 --dpo_beta 0.5 --eval_interval 0 "
                          "--train_iters 3 --reference_load " +
                          (dir / "other").string();
  const auto losses = [&](const std::string& name) {
    std::vector<double> out;
    for (const auto& j : metrics_lines(dir / "g" / "u" / name / "metrics.jsonl"))
      if (j.contains("rewards/accuracies")) out.push_back(j["lm_loss"].get<double>());
    return out;
  };
  r = run_tessera(dpo + " --exp_name precomputed");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("computed with the checkpoint " + (dir / "other").string()),
            std::string::npos)
      << r.output;
  const std::vector<double> precomputed = losses("precomputed");
  ASSERT_EQ(precomputed.size(), 3u);
  // The policy is not its reference at the first step: the loss is not ln 2.
  EXPECT_GT(std::abs(precomputed[0] - std::log(2.0)), 1e-4) << precomputed[0];

  // The frozen copy of the other checkpoint gives the same losses; stopped after two steps
  // (exit_interval) and resumed, it loads the reference again and continues them.
  r = run_tessera(dpo + " --dpo_precompute_ref_log_probs false --exp_name copy");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dpo: a frozen copy of the reference (the checkpoint"), std::string::npos)
      << r.output;
  const std::string cut =
      dpo + " --dpo_precompute_ref_log_probs false --exp_name cut --save " + (dir / "cut").string();
  r = run_tessera(cut + " --exit_interval 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(
      model + " --objective dpo --load " + (dir / "cut").string() + " --data_path " +
      (dir / "p_preference_document").string() +
      " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --lr 3e-3 --lr_warmup_iters 0 "
      "--log_interval 1 --dpo_beta 0.5 --eval_interval 0 --train_iters 3 "
      "--dpo_precompute_ref_log_probs "
      "false --exp_name cut --reference_load " +
      (dir / "other").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The frozen copy resumed with another reference: refused, naming both.
  r = run_tessera(
      model + " --objective dpo --load " + (dir / "cut").string() + " --data_path " +
      (dir / "p_preference_document").string() +
      " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --lr 3e-3 --lr_warmup_iters 0 "
      "--dpo_beta 0.5 --eval_interval 0 --train_iters 4 --dpo_precompute_ref_log_probs false "
      "--exp_name cut_other --reference_load " +
      (dir / "start").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("resume with the same reference"), std::string::npos) << r.output;
  std::vector<double> copy = losses("copy"), resumed = losses("cut");
  ASSERT_EQ(copy.size(), 3u);
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(copy[i], precomputed[i], 1e-5) << i;
    EXPECT_NEAR(resumed[i], copy[i], 1e-5) << i;
  }

  // Precomputed, stopped and resumed with another reference: refused, naming both.
  r = run_tessera(dpo + " --exp_name switched --exit_interval 1 --save " +
                  (dir / "switched").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(
      model + " --objective dpo --load " + (dir / "switched").string() + " --data_path " +
      (dir / "p_preference_document").string() +
      " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --lr 3e-3 --lr_warmup_iters 0 "
      "--dpo_beta 0.5 --eval_interval 0 --train_iters 3 --exp_name switched --reference_load " +
      (dir / "start").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("resume with the same reference"), std::string::npos) << r.output;

  // Refused: no reference to replace (reference-free), no starting weights of the policy's own.
  for (const std::string& bad :
       {dpo + " --dpo_reference_free --exp_name free",
        model + " --objective dpo --data_path " + (dir / "p_preference_document").string() +
            " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --train_iters 1 "
            "--lr_warmup_iters 0 "
            "--reference_load " +
            (dir / "other").string() + " --exp_name nostart",
        dpo + " --reference_load " + (dir / "nowhere").string() + " --exp_name nowhere"}) {
    r = run_tessera(bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("reference_load"), std::string::npos) << r.output;
  }
  // A reference of another model (wider layers) is refused before the run writes anything.
  r = run_tessera(model +
                  " --hidden_size 64 --train_iters 1 --lr_warmup_iters 0 --mock_data true --save " +
                  (dir / "wider").string() + " --exp_name wider");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(dpo + " --reference_load " + (dir / "wider").string() + " --exp_name mismatched");
  EXPECT_EQ(r.exit_code, 3) << r.output;  // a data error, named
  EXPECT_NE(r.output.find((dir / "wider").string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "mismatched" / "metrics.jsonl"));
}

// A pair in one sequence with its prompt once trains as its sides run apart: the same
// statistics at every step, the reference's log-probabilities and the frozen copy's included.
TEST(DpoTraining, SharedPromptTrainsAsTheSidesApart) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(preprocess_pairs(dir, kFourQuestions, 2));
  const std::string model = tiny_model(dir);
  RunResult r = run_tessera(model + " --train_iters 1 --lr_warmup_iters 0 --mock_data true --save " +
                            (dir / "start").string() + " --exp_name start");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string dpo = model + " --objective dpo --finetune --load " + (dir / "start").string() +
                          " --data_path " + (dir / "p_preference_document").string() +
                          " --split 100,0,0 --micro_batch_size 1 --global_batch_size 2 --lr 3e-3 "
                          "--lr_warmup_iters 0 --log_interval 1 --train_iters 4 --dpo_beta 0.5";
  for (const char* reference : {"true", "false"}) {
    std::map<std::string, std::vector<nlohmann::json>> steps;
    for (const char* shared : {"true", "false"}) {
      const std::string name = std::string("ref_") + reference + "_shared_" + shared;
      r = run_tessera(dpo + " --dpo_precompute_ref_log_probs " + reference + " --dpo_shared_prompt " +
                      shared + " --dpo_reference_logps " + (dir / (name + ".logps")).string() +
                      " --exp_name " + name);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(r.output.find("with its prompt once") != std::string::npos, shared == std::string("true"))
          << r.output;
      for (const auto& j : metrics_lines(dir / "g" / "u" / name / "metrics.jsonl"))
        if (j.contains("rewards/accuracies")) steps[shared].push_back(j);
    }
    ASSERT_EQ(steps["true"].size(), 4u);
    ASSERT_EQ(steps["false"].size(), 4u);
    for (size_t i = 0; i < 4; ++i)
      for (const char* key : {"lm_loss", "logps/chosen", "logps/rejected", "rewards/margins"}) {
        const double apart = steps["false"][i][key].get<double>();
        EXPECT_NEAR(steps["true"][i][key].get<double>(), apart, 1e-4 * std::max(1.0, std::abs(apart)))
            << key << " at step " << i + 1 << ", precomputed reference " << reference;
      }
  }
}

}  // namespace
}  // namespace tessera::testing
