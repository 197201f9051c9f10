#pragma once
// Counts, inside the MoE blocks' forward and backward ranges ("moe_block*"), the grouped GEMMs
// and the copies to the host: whether a layer waits for its routing.
#include <string_view>

#include "tessera/ops/op_observer.h"

namespace tessera::testing {

class MoeHostCopies final : public OpObserver {
 public:
  void op_begin(const char* name, const OpArgs& /*args*/) override {
    if (depth_ == 0) return;
    const std::string_view op = name;
    downloads += op == "download";
    grouped += op.starts_with("grouped_matmul");
  }
  void op_end() override {}
  void range_begin(const char* name) override {
    depth_ += std::string_view(name).starts_with("moe_block") || depth_ > 0;
  }
  void range_end() override { depth_ -= depth_ > 0; }
  int downloads = 0, grouped = 0;

 private:
  int depth_ = 0;
};

}  // namespace tessera::testing
