#pragma once
// Kernel categories and the ONE table of rules that assigns them (kernel_categories.cpp).
//
// A kernel is classified by the first rule, in table order, whose pattern matches its name
// (case-insensitive). Only when no kernel-name rule matches are the rules on the name of
// the CPU op that launched it tried. Kernels that match nothing are "unclassified" and are
// listed by name in the report's `unclassified` sheet, never folded into another category.
// To teach the analyser a new library, add a row to kRules; docs/report.md explains the order.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace tessera::analysis {

enum class Category : uint8_t {
  kGemm,
  kAttentionFwd,
  kAttentionBwd,
  kNormalization,
  kElementwise,
  kReduction,
  kOptimizer,
  kCommunication,
  kMemcpy,
  kMemset,
  kOther,
  kUnclassified,
};
inline constexpr int kNumCategories = 12;

std::string_view category_name(Category c);  // "GEMM", "attention_fwd", ...

enum class RuleField : uint8_t { kKernel, kOp };
enum class RuleMatch : uint8_t { kContains, kPrefix };

struct CategoryRule {
  RuleField field;
  RuleMatch match;
  std::string_view pattern;  // lower case
  std::string_view also;     // a second lower-case substring that must occur too ("" = none)
  Category category;
  std::string_view source;  // the library or reason, for docs and the kernels sheet
};

std::span<const CategoryRule> category_rules();

struct Classification {
  Category category = Category::kUnclassified;
  int rule = -1;  // index into category_rules(), -1 when unclassified
};

// `op_name` is the launching CPU op (empty when unknown).
Classification classify_kernel(std::string_view kernel_name, std::string_view op_name);

// "kernel contains 'nvjet'", for the kernels sheet; "" for -1.
std::string describe_rule(int rule);

}  // namespace tessera::analysis
