// What the CPU backend promises beyond matching the double reference (which the op-test
// registry checks, tests/ops/op_registry_test.cpp): results that do not depend on the OpenMP
// thread count, memory accounting, conversion edge cases and clear errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "op_test_util.h"
#include "tessera/backend/cpu/cpu_backend.h"

namespace tessera {
namespace {

using test::download_float;
using test::GuardedTensor;
using test::random_ids;
using test::random_normal;
using test::upload_float;

class CpuBackendTest : public ::testing::Test {
 protected:
  GuardedTensor input(Shape shape, const std::vector<float>& values) {
    GuardedTensor g(*backend, DType::F32, shape);
    upload_float(*backend, g, values);
    return g;
  }
  GuardedTensor random(Shape shape) { return input(shape, random_normal(shape.numel(), ++seed)); }
  GuardedTensor ids(const std::vector<int32_t>& values) {
    GuardedTensor g(*backend, DType::I32, Shape{static_cast<int64_t>(values.size())});
    backend->upload(g, values.data());
    return g;
  }

  std::unique_ptr<Backend> backend = make_cpu_backend();
  uint32_t seed = 2024;
  std::mt19937_64 rng{2024};
};

// ---- determinism ----

class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

// Runs op with 1 and with 2 OpenMP threads and expects bitwise-equal outputs.
template <class Op>
void expect_thread_count_invariant(Backend& backend, const Tensor& out, Op op) {
  std::vector<float> results[2];
  for (int threads : {1, 2}) {
    ThreadCount scope(threads);
    op();
    results[threads - 1] = download_float(backend, out);
  }
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)),
            0);
}

TEST_F(CpuBackendTest, ReductionsAreDeterministicAcrossThreadCounts) {
  const int64_t n = (int64_t{1} << 20) + 7;
  GuardedTensor x = random({n}), out = random({1});
  expect_thread_count_invariant(*backend, out, [&] { backend->sum(out, x, false); });
  expect_thread_count_invariant(*backend, out, [&] { backend->sum_squares(out, x, false); });

  const int64_t M = 300, N = 70;
  GuardedTensor dout = random({M, N}), dbias = random({N});
  expect_thread_count_invariant(*backend, dbias, [&] {
    backend->fill(dbias, 0.5f);
    backend->bias_backward(dbias, dout);
  });
  GuardedTensor tokens = ids(random_ids(M, 13, rng)), dtable = random({13, N});
  expect_thread_count_invariant(*backend, dtable, [&] {
    backend->fill(dtable, 0.5f);
    backend->embedding_backward(dtable, dout, tokens);
  });
  GuardedTensor x2 = random({M, N}), w = random({N}), rstd = random({M});
  GuardedTensor dx = random({M, N}), dw = random({N});
  expect_thread_count_invariant(*backend, dw, [&] {
    backend->fill(dx, 0.0f);
    backend->fill(dw, 0.0f);
    backend->rmsnorm_backward(dx, dw, dout, x2, w, rstd);
  });
}

TEST_F(CpuBackendTest, AttentionIsDeterministicAcrossThreadCounts) {
  for (int64_t kv : {2, 4}) {
    const AttentionShape s{2, 64, 4, kv, 16, true, 0, 0.25f};
    const int64_t W = s.qkv_width();
    GuardedTensor qkv = random({2, 64, W}), out = random({2, 64, 64}), lse = random({2, 4, 64});
    GuardedTensor dout = random({2, 64, 64}), dqkv = random({2, 64, W});
    expect_thread_count_invariant(*backend, out,
                                  [&] { backend->attention_forward(out, lse, qkv, s); });
    expect_thread_count_invariant(
        *backend, dqkv, [&] { backend->attention_backward(dqkv, dout, out, lse, qkv, s); });
  }
}

// ---- conversions and transfers ----

// Edge values that random inputs do not reach; the op-test registry checks the rest.
TEST_F(CpuBackendTest, Bf16ConversionRoundsTiesToEvenAndKeepsInfinity) {
  const float tie =
      bf16_bits_to_float(0x3f81) + 0.5f * (bf16_bits_to_float(0x3f82) - bf16_bits_to_float(0x3f81));
  const std::vector<float> values = {std::numeric_limits<float>::infinity(), tie, -tie};
  GuardedTensor src = input({3}, values), half(*backend, DType::BF16, Shape{3});
  backend->convert(half, src);
  std::vector<uint16_t> bits(3);
  backend->download(bits.data(), half);
  EXPECT_EQ(bits[0], 0x7f80);
  EXPECT_EQ(bits[1], 0x3f82);  // a tie goes to the even mantissa
  EXPECT_EQ(bits[2], 0xbf82);
  EXPECT_TRUE(src.guards_intact() && half.guards_intact());
}

TEST_F(CpuBackendTest, EmptyTensorsTransferNothing) {
  std::vector<float> host(8, 1.0f);
  const Tensor empty{nullptr, DType::F32, Shape{0, 8}, Device{}};  // a zero-byte DeviceBuffer
  EXPECT_NO_THROW(backend->upload(empty, host.data()));
  EXPECT_NO_THROW(backend->download(host.data(), empty));
  EXPECT_NO_THROW(backend->copy(empty, empty));
}

// ---- memory and errors ----

TEST_F(CpuBackendTest, MemoryAccounting) {
  backend->reset_peak_memory();
  const MemoryStats before = backend->memory_stats();
  void* a = backend->allocate(1 << 20, "a");
  void* b = backend->allocate(3000, "b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_EQ(backend->memory_stats().allocated_bytes, before.allocated_bytes + (1 << 20) + 3000);
  backend->release(a);
  const MemoryStats after = backend->memory_stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes + 3000);
  EXPECT_EQ(after.peak_bytes, before.allocated_bytes + (1 << 20) + 3000);
  backend->reset_peak_memory();
  EXPECT_EQ(backend->memory_stats().peak_bytes, after.allocated_bytes);
  backend->release(b);
  EXPECT_GT(after.device_total_bytes, 0u);
  EXPECT_GT(after.device_free_bytes, 0u);
  EXPECT_LE(after.device_free_bytes, after.device_total_bytes);
}

TEST_F(CpuBackendTest, AbsurdAllocationThrowsOutOfMemory) {
  const size_t bytes = size_t{1} << 62;
  try {
    backend->allocate(bytes, "activation stash");
    FAIL() << "no exception";
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(bytes)), std::string::npos) << message;
    EXPECT_NE(message.find("activation stash"), std::string::npos) << message;
    EXPECT_NE(message.find("available"), std::string::npos) << message;
  }
  EXPECT_EQ(backend->memory_stats().allocated_bytes, 0u);
}

TEST_F(CpuBackendTest, RejectsNonFp32AndBadIds) {
  GuardedTensor x(*backend, DType::BF16, Shape{2, 4});
  GuardedTensor w = random({4}), out = random({2, 4}), rstd = random({2});
  try {
    backend->rmsnorm_forward(out, rstd, x, w, 1e-5f);
    FAIL() << "no exception";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  GuardedTensor table = random({3, 4}), tokens = ids({0, 3});
  EXPECT_THROW(backend->embedding_forward(out, tokens, table), InternalError);
  GuardedTensor logits = random({2, 3}), targets = ids({1, 3});
  EXPECT_THROW(backend->cross_entropy(rstd, logits, targets, Tensor{}, 1.0f), InternalError);
}

// ---- vocabulary shards ----

// The whole vocabulary split into S shards of V/S columns (rows of the table): the shards'
// lookups add up to the whole lookup (each token's row from exactly one shard) and their
// gradients are the whole gradient's rows; the sharded cross-entropy gives every shard the
// whole row's losses and its columns of the whole gradient.
TEST_F(CpuBackendTest, VocabularyShardsAddUpToTheWholeVocabulary) {
  constexpr int64_t N = 37, C = 24, V = 96, S = 3, Vs = V / S;
  std::vector<int32_t> token_ids(N), target_ids(N);
  for (int64_t n = 0; n < N; ++n) {
    token_ids[n] = static_cast<int32_t>((n * 41 + 7) % V);
    target_ids[n] = n % 9 == 4 ? -1 : static_cast<int32_t>((n * 29 + 3) % V);  // some ignored
  }
  GuardedTensor tokens = ids(token_ids), targets = ids(target_ids);

  const std::vector<float> table_values = random_normal(V * C, 11);
  GuardedTensor table = input({V, C}, table_values), whole = random({N, C});
  backend->embedding_forward(whole, tokens, table);
  std::vector<float> sum(N * C, 0.0f);
  const std::vector<float> dout_values = random_normal(N * C, 12);
  GuardedTensor dout = input({N, C}, dout_values),
                dtable = input({V, C}, std::vector<float>(V * C));
  backend->embedding_backward(dtable, dout, tokens);
  const std::vector<float> whole_dtable = download_float(*backend, dtable);
  for (int64_t s = 0; s < S; ++s) {
    GuardedTensor shard = input(
        {Vs, C}, {table_values.begin() + s * Vs * C, table_values.begin() + (s + 1) * Vs * C});
    GuardedTensor out = random({N, C}), dshard = input({Vs, C}, std::vector<float>(Vs * C));
    backend->embedding_shard_forward(out, tokens, shard, s * Vs);
    const std::vector<float> part = download_float(*backend, out);
    for (int64_t i = 0; i < N * C; ++i) sum[i] += part[i];
    backend->embedding_shard_backward(dshard, dout, tokens, s * Vs);
    const std::vector<float> drows = download_float(*backend, dshard);
    EXPECT_TRUE(std::equal(drows.begin(), drows.end(), whole_dtable.begin() + s * Vs * C))
        << "shard " << s << "'s rows of the table gradient";
  }
  EXPECT_EQ(sum, download_float(*backend, whole)) << "the shards' lookups add up to the whole";

  const std::vector<float> logit_values = random_normal(N * V, 13, 2.0f);
  GuardedTensor logits = input({N, V}, logit_values), losses = random({N}),
                dlogits = random({N, V});
  backend->cross_entropy(losses, logits, targets, dlogits, 0.25f);
  const std::vector<float> want_losses = download_float(*backend, losses),
                           want_grad = download_float(*backend, dlogits);
  std::vector<GuardedTensor> shards;
  GuardedTensor stats = random({S, N, 2});
  for (int64_t s = 0; s < S; ++s) {
    std::vector<float> cols(N * Vs);
    for (int64_t n = 0; n < N; ++n)
      std::copy_n(logit_values.begin() + n * V + s * Vs, Vs, cols.begin() + n * Vs);
    shards.push_back(input({N, Vs}, cols));
    backend->cross_entropy_shard_stats(stats.t().flat_range(s * 2 * N, 2 * N), shards.back(),
                                       targets, s * Vs);
  }
  for (int64_t s = 0; s < S; ++s) {
    GuardedTensor shard_losses = random({N});
    backend->cross_entropy_shard(shard_losses, shards[s], targets, stats, s * Vs, shards[s], 0.25f);
    const std::vector<float> got = download_float(*backend, shard_losses),
                             grad = download_float(*backend, shards[s]);
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_NEAR(got[n], want_losses[n], 1e-5 * std::max(1.0f, std::abs(want_losses[n])))
          << "row " << n << " on shard " << s;
      for (int64_t v = 0; v < Vs; ++v)
        EXPECT_NEAR(grad[n * Vs + v], want_grad[n * V + s * Vs + v], 1e-7)
            << "row " << n << ", column " << s * Vs + v;
    }
  }
}

// Context parallelism: the sequence cut into 2S chunks, segment c holding chunks c and
// 2S - 1 - c. Each segment's queries against every segment's keys give the rows of whole-
// sequence attention (causal, and with a window), and the segments' backward calls add up to
// the whole backward once their rows are put back in sequence order (fp32: within 1e-6
// relative; the sums of the key gradients over the segments run in another order). Also with
// packed documents (starts by position over the whole sequence) that cross chunks and
// segments.
TEST_F(CpuBackendTest, GatheredAttentionOverSegmentsIsWholeSequenceAttention) {
  for (const auto& [window, packed] : {std::pair{int64_t{0}, false}, std::pair{int64_t{5}, false},
                                       std::pair{int64_t{0}, true}, std::pair{int64_t{5}, true}}) {
    SCOPED_TRACE(fmt::format("window {}{}", window, packed ? ", packed" : ""));
    constexpr int64_t S = 3, B = 2, T = 24, Tl = T / S, Tc = T / (2 * S), H = 4, KV = 2, D = 8;
    AttentionShape whole;
    whole.batch = B, whole.seq = T, whole.heads = H, whole.kv_heads = KV, whole.head_dim = D;
    whole.window = window;
    whole.scale = 0.35f;
    // Documents of 7, 1, 10 and 6 tokens in every sequence.
    std::vector<int32_t> starts;
    for (int64_t b = 0; b < B; ++b)
      for (int length : {7, 1, 10, 6})
        for (int k = 0; k < length; ++k) starts.push_back(static_cast<int32_t>(starts.size() % T) - k);
    GuardedTensor document_starts = ids(starts);
    if (packed) whole.document_starts = document_starts;
    AttentionShape local = whole;
    local.seq = Tl;
    const int64_t W = whole.qkv_width(), HD = H * D;
    std::vector<int32_t> positions;
    for (int64_t c = 0; c < S; ++c)
      for (int64_t t = 0; t < Tl; ++t)
        positions.push_back(
            static_cast<int32_t>(t < Tc ? c * Tc + t : (2 * S - 1 - c) * Tc + t - Tc));
    const std::vector<float> qkv = random_normal(B * T * W, 21),
                             dout = random_normal(B * T * HD, 22);
    // Segment-major (S, B, Tl) copies of rows of (B, T) tensors.
    auto segmented = [&](const std::vector<float>& v, int64_t width) {
      std::vector<float> out(v.size());
      for (int64_t c = 0; c < S; ++c)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < Tl; ++t)
            std::copy_n(v.begin() + (b * T + positions[c * Tl + t]) * width, width,
                        out.begin() + ((c * B + b) * Tl + t) * width);
      return out;
    };
    GuardedTensor full_qkv = input({B * T, W}, qkv), full_out = random({B * T, HD}),
                  full_lse = random({B, H, T}), full_dqkv = random({B * T, W}),
                  full_dout = input({B * T, HD}, dout);
    backend->attention_forward(full_out, full_lse, full_qkv, whole);
    backend->attention_backward(full_dqkv, full_dout, full_out, full_lse, full_qkv, whole);
    const std::vector<float> want_out = segmented(download_float(*backend, full_out), HD);
    const std::vector<float> want_dqkv = segmented(download_float(*backend, full_dqkv), W);

    // Each segment's own qkv rows, and every segment's key and value columns (kv_all).
    const std::vector<float> seg_qkv = segmented(qkv, W);
    const int64_t QW = H * D, KW = whole.kv_width(), rows = B * Tl;
    std::vector<float> kv_columns;
    for (int64_t r = 0; r < S * rows; ++r)
      kv_columns.insert(kv_columns.end(), seg_qkv.begin() + r * W + QW, seg_qkv.begin() + (r + 1) * W);
    GuardedTensor all = input({S * rows, KW}, kv_columns), pos = ids(positions);
    const std::vector<float> seg_dout = segmented(dout, HD);
    std::vector<float> dqkv_sum(S * rows * W, 0.0f);
    for (int64_t c = 0; c < S; ++c) {
      GuardedTensor own = input({rows, W}, {seg_qkv.begin() + c * rows * W,
                                            seg_qkv.begin() + (c + 1) * rows * W});
      GuardedTensor out = random({rows, HD}), lse = random({B, H, Tl}),
                    d = input({rows, HD}, {seg_dout.begin() + c * rows * HD,
                                           seg_dout.begin() + (c + 1) * rows * HD}),
                    dqkv = random({rows, W}), dall = random({S * rows, KW});
      const std::vector<float> dqkv_before = download_float(*backend, dqkv);
      backend->attention_gathered_forward(out, lse, own, all, pos, c, local);
      const std::vector<float> got = download_float(*backend, out);
      for (int64_t i = 0; i < rows * HD; ++i)
        EXPECT_NEAR(got[i], want_out[c * rows * HD + i], 1e-6f * std::max(1.0f, std::abs(got[i])))
            << "segment " << c << " " << i;
      backend->attention_gathered_backward(dqkv, dall, d, out, lse, own, all, pos, c, local);
      const std::vector<float> dq = download_float(*backend, dqkv), dkv = download_float(*backend, dall);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(dq.begin() + r * W, QW, dqkv_sum.begin() + (c * rows + r) * W);
        for (int64_t k = QW; k < W; ++k)  // the key and value columns are not the op's
          EXPECT_EQ(dq[r * W + k], dqkv_before[r * W + k]) << "segment " << c << " row " << r;
      }
      for (int64_t r = 0; r < S * rows; ++r)
        for (int64_t k = 0; k < KW; ++k) dqkv_sum[r * W + QW + k] += dkv[r * KW + k];
    }
    for (size_t i = 0; i < dqkv_sum.size(); ++i)
      EXPECT_NEAR(dqkv_sum[i], want_dqkv[i], 1e-6f * std::max(1.0f, std::abs(want_dqkv[i])))
          << "element " << i;
  }
}

// The gathered keys and values are each rank's k and v columns alone: a gather of the whole
// q, k, v (the layout before the queries stopped travelling) is refused by name, not read.
TEST_F(CpuBackendTest, GatheredAttentionRefusesKeysGatheredWithTheirQueries) {
  AttentionShape s;
  s.batch = 1, s.seq = 4, s.heads = 4, s.kv_heads = 2, s.head_dim = 8, s.scale = 0.35f;
  GuardedTensor own = random({4, s.qkv_width()}), whole = random({2 * 4, s.qkv_width()}),
                pos = ids({0, 1, 6, 7, 2, 3, 4, 5});
  GuardedTensor out = random({4, s.heads * s.head_dim}), lse = random({1, 4, 4});
  try {
    backend->attention_gathered_forward(out, lse, own, whole, pos, 0, s);
    FAIL() << "no exception";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("attention_gathered_forward: kv_all (8, 64) has 512 elements, expected 256"),
              std::string::npos)
        << e.what();
  }
}

// Context parallelism runs grouped-query attention only: narrower value heads (multi-latent
// attention) are refused by name rather than read with the keys' width.
TEST_F(CpuBackendTest, GatheredAttentionRefusesNarrowerValueHeads) {
  AttentionShape s;
  s.batch = 1, s.seq = 4, s.heads = 2, s.kv_heads = 2, s.head_dim = 8, s.v_head_dim = 4;
  s.scale = 0.35f;
  GuardedTensor own = random({4, s.qkv_width()}), all = random({2 * 4, s.kv_width()}),
                pos = ids({0, 1, 6, 7, 2, 3, 4, 5});
  GuardedTensor out = random({4, s.heads * s.v_dim()}), lse = random({1, 2, 4});
  try {
    backend->attention_gathered_forward(out, lse, own, all, pos, 0, s);
    FAIL() << "no exception";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("value heads of 4 with heads of 8"), std::string::npos)
        << e.what();
  }
}

TEST_F(CpuBackendTest, Description) {
  EXPECT_EQ(backend->description(),
            fmt::format("cpu (OpenBLAS, {} threads)", omp_get_max_threads()));
  EXPECT_EQ(backend->device().kind, DeviceKind::CPU);
}

}  // namespace
}  // namespace tessera
