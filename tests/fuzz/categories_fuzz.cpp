// A `tessera report --categories` file (YAML or JSON rules with regular expressions): the input
// is the file; accepted rules then classify kernel names, among them one on which a pattern
// that backtracks exponentially would hang without PCRE2's limits.
#include "fuzz/fuzz_support.h"
#include "tessera/analysis/kernel_categories.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path file = scratch_dir() / "cats.yaml";
  write_file(file, as_text(data, size));
  static const std::string kKernels[] = {
      "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
      "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
      std::string(40, 'a') + "!", ""};
  refusal_or_success([&] {
    const std::vector<analysis::UserCategoryRule> rules =
        analysis::load_category_rules(file.string());
    for (const std::string& kernel : kKernels) {
      const analysis::Classification c = analysis::classify_kernel(kernel, "aten::mm", rules);
      analysis::describe_rule(c.rule, rules);
    }
  });
  return 0;
}
