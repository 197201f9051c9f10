#pragma once
// Kernel categories and the ONE table of rules that assigns them (kernel_categories.cpp).
//
// A kernel is classified by the first rule, in table order, whose pattern matches its name
// (case-insensitive). Only when no kernel-name rule matches are the rules on the name of
// the CPU op that launched it tried. Kernels that match nothing are "unclassified" and are
// listed by name in the report's `unclassified` sheet, never folded into another category.
// To teach the analyser a new library, add a row to kRules; docs/report.md explains the order.
//
// Users add their own rules with `tessera report --categories FILE`: regular expressions on
// the kernel name, tried in file order before every built-in rule.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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

// A --categories rule's regular expression, compiled with PCRE2 (kept out of this header).
struct CompiledPattern;

// A rule of a --categories file.
struct UserCategoryRule {
  std::string pattern;  // as written
  // PCRE2, case-insensitive, searched anywhere in the kernel name, under match and depth
  // limits: a pattern that backtracks exponentially ((a+)+$) stops with an error naming it
  // instead of hanging the report.
  std::shared_ptr<const CompiledPattern> regex;
  Category category;
  std::string origin;  // "FILE:LINE", for the kernels sheet
  std::string key;     // "rules[3].kernel", for messages
};

// Reads a --categories file (YAML, or JSON, which is YAML too; format in docs/report.md).
// Throws ConfigError (exit 2) naming the file, the line and the problem.
std::vector<UserCategoryRule> load_category_rules(const std::string& path);

struct Classification {
  Category category = Category::kUnclassified;
  // -1 when unclassified; else user rules are numbered first (0 .. U-1), then category_rules()
  // (U + index).
  int rule = -1;
};

// `op_name` is the launching CPU op (empty when unknown). Throws ConfigError naming the user
// rule whose pattern exceeds PCRE2's match or depth limit on `kernel_name`.
Classification classify_kernel(std::string_view kernel_name, std::string_view op_name,
                               std::span<const UserCategoryRule> user_rules = {});

// "kernel contains 'nvjet'", "my.yaml:3: kernel matches '^fused_'", for the kernels sheet;
// "" for -1. `user_rules` as given to classify_kernel.
std::string describe_rule(int rule, std::span<const UserCategoryRule> user_rules = {});

}  // namespace tessera::analysis
