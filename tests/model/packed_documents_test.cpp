// Packed documents (reset_position_ids + reset_attention_mask): a sequence of k documents gives
// the losses and gradients of the k documents run on their own, and without the two switches
// it does not (the documents see each other and sit at later positions).
#include <cmath>
#include <numeric>

#include <gtest/gtest.h>

#include "model/tiny_decoder.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/ops/op_observer.h"

namespace tessera {
namespace {


struct Result {
  float loss_sum = 0;
  std::vector<float> grads;
  double attention_flops = 0;  // the attention ops' costs, as the profiler reports them
};

// Sums the FLOPs the attention ops report.
class AttentionFlops : public OpObserver {
 public:
  void op_begin(const char* name, const OpArgs& args) override {
    if (std::string_view(name) != "attention_forward") return;
    for (const OpArg& a : args.items())
      if (std::string_view(a.key) == "op_flops") flops += a.d;
  }
  void op_end() override {}
  void range_begin(const char*) override {}
  void range_end() override {}
  double flops = 0;
};

// One micro-batch of `batch` sequences of `seq` tokens; positions null: no packing.
Result run(const ModelSpec& spec, int64_t batch, int64_t seq, const std::vector<int32_t>& tokens,
           const std::vector<int32_t>& targets, const std::vector<int32_t>* positions) {
  auto backend = make_cpu_backend();
  ModelRuntime rt;
  rt.micro_batch = batch;
  rt.seq_length = seq;
  rt.reset_position_ids = rt.reset_attention_mask = positions != nullptr;
  DecoderModel model(*backend, spec, rt);
  DeviceBuffer master(*backend, model.layout().total * sizeof(float), "master");
  const Tensor m = master.tensor(DType::F32, {model.layout().total});
  init_parameters(*backend, spec, model.layout(), m, 7);
  backend->copy(model.params(), m);
  model.set_batch(tokens.data(), targets.data(), positions ? positions->data() : nullptr);
  AttentionFlops flops;
  backend->set_op_observer(&flops);
  model.forward_backward(1.0f);
  backend->set_op_observer(nullptr);
  Result r;
  r.attention_flops = flops.flops;
  backend->download(&r.loss_sum, model.loss_sum());
  r.grads.resize(model.layout().total);
  backend->download(r.grads.data(), model.grads());
  return r;
}


TEST(PackedDocuments, GiveTheLossesAndGradientsOfTheDocumentsRunAlone) {
  const ModelSpec spec = tiny_decoder_spec();
  const std::vector<int64_t> lengths = {5, 7, 4, 8};  // two sequences of 12 tokens
  const int64_t T = 12;
  // Each document's tokens and next-token targets; its last token predicts nothing.
  std::vector<std::vector<int32_t>> doc_tokens, doc_targets;
  for (size_t d = 0; d < lengths.size(); ++d) {
    doc_tokens.emplace_back(), doc_targets.emplace_back();
    for (int64_t i = 0; i <= lengths[d]; ++i) {
      const auto id = static_cast<int32_t>(random_below(5, d * 100 + i, 64));
      if (i < lengths[d]) doc_tokens.back().push_back(id);
      if (i > 0) doc_targets.back().push_back(i == lengths[d] ? -1 : id);
    }
  }
  Result alone;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const Result r = run(spec, 1, lengths[d], doc_tokens[d], doc_targets[d], nullptr);
    alone.loss_sum += r.loss_sum;
    alone.attention_flops += r.attention_flops;
    if (alone.grads.empty()) alone.grads.assign(r.grads.size(), 0.0f);
    for (size_t i = 0; i < r.grads.size(); ++i) alone.grads[i] += r.grads[i];
  }
  std::vector<int32_t> tokens, targets, positions;
  for (size_t d = 0; d < lengths.size(); ++d) {
    tokens.insert(tokens.end(), doc_tokens[d].begin(), doc_tokens[d].end());
    targets.insert(targets.end(), doc_targets[d].begin(), doc_targets[d].end());
    for (int64_t i = 0; i < lengths[d]; ++i) positions.push_back(static_cast<int32_t>(i));
  }
  ASSERT_EQ(static_cast<int64_t>(tokens.size()), 2 * T);
  const Result packed = run(spec, 2, T, tokens, targets, &positions);
  EXPECT_NEAR(packed.loss_sum, alone.loss_sum, 1e-6 * std::abs(alone.loss_sum));
  EXPECT_LT(relative_difference(packed.grads, alone.grads), 1e-6);
  // The profiler's attention FLOPs count the pairs within documents, as the documents alone
  // do: 2 x heads x pairs x (D + Dv) per layer's forward.
  EXPECT_DOUBLE_EQ(packed.attention_flops, alone.attention_flops);
  double pairs = 0;
  for (const int64_t l : lengths) pairs += static_cast<double>(l * (l + 1) / 2);
  EXPECT_DOUBLE_EQ(packed.attention_flops, spec.num_layers * 2.0 * spec.heads * pairs * 2 * spec.head_dim);

  // Without packing the documents see each other and sit at later positions.
  const Result naive = run(spec, 2, T, tokens, targets, nullptr);
  EXPECT_GT(std::abs(naive.loss_sum - alone.loss_sum), 1e-3 * std::abs(alone.loss_sum));
  EXPECT_GT(relative_difference(naive.grads, alone.grads), 1e-3);
}

}  // namespace
}  // namespace tessera
