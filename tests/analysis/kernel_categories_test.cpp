// The category rules on real kernel names from cuBLAS/cuBLASLt, cuDNN, FlashAttention, PyTorch,
// NCCL, Triton / torch.compile, ROCm libraries and Tessera's own kernels.
#include <gtest/gtest.h>

#include "tessera/analysis/kernel_categories.h"

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

}  // namespace
}  // namespace tessera::analysis
