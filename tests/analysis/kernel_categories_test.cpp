// The category rules on real kernel names from cuBLAS/cuBLASLt, cuDNN, FlashAttention, PyTorch,
// NCCL, Triton / torch.compile, ROCm libraries and Tessera's own kernels; rules of a
// --categories file before them, and what a bad file says.
#include <chrono>

#include <gtest/gtest.h>

#include "tessera/analysis/kernel_categories.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/core/error.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

struct Case {
  const char* kernel;
  const char* op;
  Category expected;
};

const Case kCases[] = {
    // cuBLASLt / cuBLAS / CUTLASS / Tensile
    {"nvjet_sm90_tst_64x8_64x16_1x2_h_bz_NNT", "", Category::kGemm},
    {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "",
     Category::kGemm},
    {"ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "", Category::kGemm},
    {"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>",
     "", Category::kGemm},
    {"void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "", Category::kGemm},
    {"Cijk_Alik_Bljk_BBS_BH_MT256x256x64_MI16x16x16x1_SN_1LDSB1", "", Category::kGemm},
    {"triton_tem_fused_mm_0", "", Category::kGemm},
    // attention
    {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "",
     Category::kAttentionFwd},
    {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "",
     Category::kAttentionBwd},
    {"void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "",
     Category::kAttentionBwd},
    {"void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "",
     Category::kAttentionFwd},
    {"void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "",
     Category::kAttentionBwd},
    {"fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "", Category::kAttentionFwd},
    {"attention_forward_kernel", "", Category::kAttentionFwd},
    {"attention_backward_kernel", "", Category::kAttentionBwd},
    // communication
    {"ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "",
     Category::kCommunication},
    {"ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "",
     Category::kCommunication},
    // optimizer before elementwise: fused Adam runs inside multi_tensor_apply_kernel
    {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>",
     "", Category::kOptimizer},
    {"adamw_kernel", "", Category::kOptimizer},
    {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::"
     "BinaryOpScalarFunctor<float, 1, 1, 0>, std::plus<float>, float>",
     "", Category::kElementwise},
    // normalisation
    {"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, true>", "",
     Category::kNormalization},
    {"rmsnorm_forward_kernel", "", Category::kNormalization},
    {"rmsnorm_backward_kernel", "", Category::kNormalization},
    {"triton_per_fused__fused_rms_norm__to_copy_embedding_0", "", Category::kNormalization},
    {"void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float>",
     "", Category::kNormalization},
    // reductions
    {"void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>", "",
     Category::kReduction},
    {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper"
     "<float, at::native::sum_functor<float, float, float>>>>",
     "", Category::kReduction},
    {"cross_entropy_kernel", "", Category::kReduction},
    {"triton_red_fused_sum_3", "", Category::kReduction},
    // elementwise
    {"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
     "", Category::kElementwise},
    {"void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}>>",
     "", Category::kElementwise},
    {"triton_poi_fused__to_copy_add_mul_neg_slice_slice_backward_5", "", Category::kElementwise},
    {"swiglu_forward_kernel", "", Category::kElementwise},
    {"void tessera::cuda::rope_kernel<__nv_bfloat16>(...)", "", Category::kElementwise},
    {"void tessera::cuda::(anonymous namespace)::copy_columns_kernel<uint4>(uint4*, long, ...)", "",
     Category::kElementwise},
    // other
    {"void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, "
     "long>",
     "", Category::kOther},
    {"embedding_forward_kernel", "", Category::kOther},
    {"void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)", "",
     Category::kOther},
    // op fallbacks for unknown kernel names
    {"my_custom_kernel_v3", "aten::mm", Category::kGemm},
    {"my_custom_kernel_v3", "aten::_flash_attention_backward", Category::kAttentionBwd},
    {"my_custom_kernel_v3", "aten::_fused_rms_norm", Category::kNormalization},
    // nothing matches: unclassified, never guessed
    {"my_custom_kernel_v3", "", Category::kUnclassified},
    {"my_custom_kernel_v3", "aten::my_op", Category::kUnclassified},
};

TEST(KernelCategories, RulesClassifyKnownLibraries) {
  for (const Case& c : kCases) {
    Classification got = classify_kernel(c.kernel, c.op);
    EXPECT_EQ(category_name(got.category), category_name(c.expected))
        << c.kernel << " / " << c.op << " matched: " << describe_rule(got.rule);
  }
}

TEST(KernelCategories, RuleTableIsLowerCaseAndDocumented) {
  for (const CategoryRule& r : category_rules()) {
    for (char ch : r.pattern) EXPECT_FALSE(ch >= 'A' && ch <= 'Z') << r.pattern;
    for (char ch : r.also) EXPECT_FALSE(ch >= 'A' && ch <= 'Z') << r.also;
    EXPECT_FALSE(r.source.empty()) << r.pattern;
    EXPECT_NE(r.category, Category::kUnclassified);
  }
  EXPECT_EQ(describe_rule(-1), "");
  EXPECT_EQ(describe_rule(classify_kernel("nvjet_x", "").rule), "kernel starts with 'nvjet'");
}

using testing::test_dir;
using testing::write_file;

TEST(UserCategories, RulesComeBeforeTheBuiltInOnes) {
  const auto dir = test_dir();
  const std::string file = write_file(dir / "cats.yaml",
                                      "# mine\n"
                                      "rules:\n"
                                      "  - kernel: '^nvjet_sm90_a$'\n"
                                      "    category: other\n"
                                      "  - {kernel: 'MYSTERY', category: Reduction}\n");
  const auto rules = load_category_rules(file);
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].origin, file + ":3");
  EXPECT_EQ(rules[1].origin, file + ":5");
  // The user rule overrides the built-in GEMM rule; regexes are case-insensitive and search.
  Classification a = classify_kernel("nvjet_sm90_a", "", rules);
  EXPECT_EQ(a.category, Category::kOther);
  EXPECT_EQ(describe_rule(a.rule, rules), file + ":3: kernel matches '^nvjet_sm90_a$'");
  Classification b = classify_kernel("nvjet_sm90_ab", "", rules);
  EXPECT_EQ(b.category, Category::kGemm);
  EXPECT_EQ(describe_rule(b.rule, rules), "kernel starts with 'nvjet'");
  EXPECT_EQ(classify_kernel("a_mystery_kernel", "", rules).category, Category::kReduction);

  // Through a trace: the categories and kernels sheets follow the user's rules.
  testing::TraceBuilder t(dir);
  t.kernel("nvjet_sm90_a", 0, 10).kernel("nvjet_sm90_b", 10, 10).kernel("mystery_kernel", 20, 1);
  const TraceData d = TraceData::load(t.write("t.json"), false, rules);
  const Table kernels = kernels_table(d);
  for (size_t r = 0; r < kernels.rows.size(); ++r) {
    const std::string name = std::get<std::string>(kernels.rows[r][kernels.column("name")]);
    const std::string category = std::get<std::string>(kernels.rows[r][kernels.column("category")]);
    const std::string rule = std::get<std::string>(kernels.rows[r][kernels.column("rule")]);
    if (name == "nvjet_sm90_a") {
      EXPECT_EQ(category, "other");
      EXPECT_EQ(rule, file + ":3: kernel matches '^nvjet_sm90_a$'");
    } else if (name == "nvjet_sm90_b") {
      EXPECT_EQ(category, "GEMM");
    } else {
      EXPECT_EQ(category, "reduction");
      EXPECT_EQ(rule, file + ":5: kernel matches 'MYSTERY'");
    }
  }
  EXPECT_TRUE(unclassified_table(d).rows.empty());
}

TEST(UserCategories, JsonAndTheShippedExample) {
  const auto dir = test_dir();
  const std::string json = write_file(
      dir / "cats.json", R"({"rules": [{"kernel": "flash_fwd_splitkv", "category": "GEMM"}]})");
  const auto rules = load_category_rules(json);
  ASSERT_EQ(rules.size(), 1u);
  EXPECT_EQ(classify_kernel("flash_fwd_splitkv_kernel", "", rules).category, Category::kGemm);
  const auto example = load_category_rules(std::string(TESSERA_TESTS_DIR) +
                                           "/../configs/kernel_categories.example.yaml");
  ASSERT_EQ(example.size(), 3u);
  EXPECT_EQ(classify_kernel("my_fused_rmsnorm_silu_kernel", "", example).category,
            Category::kNormalization);
  EXPECT_EQ(classify_kernel("void te::cast_transpose_kernel<bf16>", "", example).category,
            Category::kMemcpy);
}

// A pattern that backtracks exponentially ((a+)+$ on a name of 40 a's and a '!' would take
// 2^40 steps) stops at PCRE2's match limit with an error naming the rule and the kernel, at
// once, instead of hanging the report.
TEST(UserCategories, ABacktrackingPatternStopsAtTheMatchLimitNamingTheRule) {
  const auto dir = test_dir();
  const std::string file = write_file(dir / "cats.yaml",
                                      "rules:\n"
                                      "  - kernel: '^nvjet'\n"
                                      "    category: GEMM\n"
                                      "  - kernel: '(a+)+$'\n"
                                      "    category: other\n");
  const auto rules = load_category_rules(file);
  EXPECT_EQ(classify_kernel("aaaa", "", rules).category, Category::kOther);  // matches quickly
  const std::string kernel = std::string(40, 'a') + "!";
  const auto start = std::chrono::steady_clock::now();
  try {
    classify_kernel(kernel, "", rules);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(file + ":4: key 'rules[1].kernel' has value '(a+)+$'"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("on kernel '" + kernel + "' it exceeds them"), std::string::npos)
        << message;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

// Every problem names the file and the line, and what was expected.
TEST(UserCategories, BadFilesNameFileLineAndProblem) {
  const auto dir = test_dir();
  struct Case {
    const char* text;
    const char* says;
  } cases[] = {
      {"rules:\n  - kernel: [unclosed\n", "c.yaml:3: key '(syntax)'"},
      {"- kernel: x\n", "c.yaml:1: key '(document)'"},
      {"rules:\n  - kernel: x\n    category: fast\n",
       "c.yaml:3: key 'rules[0].category' has value 'fast': expected one of GEMM, attention_fwd, "
       "attention_bwd, normalization, elementwise, reduction, optimizer, communication, memcpy, "
       "memset, other"},
      {"rules:\n  - kernel: x\n    category: unclassified\n",
       "c.yaml:3: key 'rules[0].category' has value 'unclassified'"},
      {"rules:\n  - kernel: 'a('\n    category: other\n",
       "c.yaml:2: key 'rules[0].kernel' has value 'a(': expected a regular expression "
       "(PCRE2 syntax, as Perl's), but it is not one: missing closing parenthesis at offset 2"},
      {"rules:\n  - category: other\n",
       "c.yaml:2: key 'rules[0].kernel' has value '(missing)': expected a regular expression"},
      {"rules:\n  - kernel: x\n", "c.yaml:2: key 'rules[0].category' has value '(missing)'"},
      {"rules:\n  - kernel: x\n    category: other\n    op: aten::mm\n",
       "c.yaml:4: key 'rules[0].op' has value 'aten::mm': expected only the keys 'kernel', "
       "'category'"},
      {"rules:\n  - kernel: x\n    kernel: y\n    category: other\n",
       "c.yaml:3: key 'rules[0].kernel' has value 'y': expected each key once"},
      {"rules:\n  - kernel: ''\n    category: other\n",
       "c.yaml:2: key 'rules[0].kernel' has value '': expected a non-empty string"},
      {"rules:\n  - just a string\n", "c.yaml:2: key 'rules[0]' has value 'just a string'"},
      {"rules: nvjet\n", "c.yaml:1: key 'rules' has value 'nvjet': expected a list of rules"},
      {"rule:\n  - kernel: x\n", "c.yaml:1: key 'rule'"},
      {"{}\n", "c.yaml:1: key 'rules' has value '(missing)'"},
  };
  for (const Case& c : cases) {
    const std::string file = write_file(dir / "c.yaml", c.text);
    try {
      load_category_rules(file);
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(file.substr(0, file.size() - 6) + c.says),
                std::string::npos)
          << c.text << "\n"
          << e.what();
    }
  }
  EXPECT_THROW(load_category_rules((dir / "missing.yaml").string()), ConfigError);
}

}  // namespace
}  // namespace tessera::analysis
