// GEMM / attention shapes, FLOPs, roofline columns, and collective sizes and bandwidths.
#include <gtest/gtest.h>

#include "tessera/analysis/collectives.h"
#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/shapes.h"
#include "tessera/analysis/trace_data.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::json;
using testing::test_dir;
using testing::TraceBuilder;

double num(const Table& t, size_t row, const char* column) {
  const Cell& c = t.rows[row][t.column(column)];
  if (auto* i = std::get_if<int64_t>(&c)) return static_cast<double>(*i);
  return std::get<double>(c);
}
std::string text(const Table& t, size_t row, const char* column) {
  const Cell& c = t.rows[row][t.column(column)];
  auto* s = std::get_if<std::string>(&c);
  return s ? *s : "";
}
bool empty(const Table& t, size_t row, const char* column) {
  return std::holds_alternative<std::monostate>(t.rows[row][t.column(column)]);
}

GemmShape gemm(const char* op, std::vector<std::vector<int64_t>> dims,
               std::vector<std::string> types) {
  auto s = gemm_shape_from_op(op, dims, types);
  EXPECT_TRUE(s.has_value()) << op;
  return s.value_or(GemmShape{});
}

TEST(Shapes, GemmShapesFromOpInputDims) {
  const std::string bf = "c10::BFloat16";
  GemmShape mm = gemm("aten::mm", {{64, 16}, {16, 32}}, {bf, bf});
  EXPECT_EQ(std::tie(mm.m, mm.n, mm.k, mm.batch), std::make_tuple(64, 32, 16, 1));
  EXPECT_EQ(mm.dtype, "bf16");
  GemmShape addmm = gemm("aten::addmm", {{32}, {64, 16}, {16, 32}}, {bf, bf, bf});
  EXPECT_EQ(std::tie(addmm.m, addmm.n, addmm.k), std::make_tuple(64, 32, 16));
  GemmShape linear = gemm("aten::linear", {{2, 8, 16}, {32, 16}, {32}}, {"float", "float"});
  EXPECT_EQ(std::tie(linear.m, linear.n, linear.k), std::make_tuple(16, 32, 16));
  EXPECT_EQ(linear.dtype, "fp32");
  GemmShape bmm = gemm("aten::bmm", {{4, 64, 16}, {4, 16, 32}}, {bf, bf});
  EXPECT_EQ(std::tie(bmm.m, bmm.n, bmm.k, bmm.batch), std::make_tuple(64, 32, 16, 4));
  GemmShape matmul = gemm("aten::matmul", {{4, 64, 16}, {16, 32}}, {bf, bf});
  EXPECT_EQ(std::tie(matmul.m, matmul.n, matmul.k, matmul.batch), std::make_tuple(256, 32, 16, 1));
  GemmShape fp8 = gemm("aten::_scaled_mm", {{64, 16}, {16, 32}, {}, {}},
                       {"c10::Float8_e4m3fn", "c10::Float8_e4m3fn"});
  EXPECT_EQ(fp8.dtype, "fp8_e4m3");
  EXPECT_DOUBLE_EQ(gemm_bytes(fp8), 64 * 16 + 16 * 32 + 64 * 32 * 2);  // bf16 output
  EXPECT_FALSE(gemm_shape_from_op("aten::add", {{1}, {1}}, {}).has_value());
  EXPECT_FALSE(gemm_shape_from_op("aten::mm", {{}, {}}, {}).has_value());
}

TEST(Shapes, GemmFlopsAndBytes) {
  GemmShape s{1024, 1024, 1024, 1, "bf16"};
  EXPECT_DOUBLE_EQ(gemm_flops(s), 2.0 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(gemm_bytes(s), 2.0 * 3 * 1024 * 1024);
  s.batch = 3;
  EXPECT_DOUBLE_EQ(gemm_flops(s), 6.0 * 1024 * 1024 * 1024);
}

TEST(Shapes, AttentionFlopsConventions) {
  AttentionShape s{1, 32, 8, 8192, 8192, 128, -1, 0, "bf16"};
  const double full = 4.0 * 32 * 8192.0 * 8192.0 * 128;
  EXPECT_DOUBLE_EQ(attention_flops(s, false), full);
  s.causal = 1;
  EXPECT_DOUBLE_EQ(attention_flops(s, false), full / 2);
  EXPECT_DOUBLE_EQ(attention_flops(s, true), 2.5 * full / 2);
  s.window = 1024;  // sliding window: T * W pairs
  EXPECT_DOUBLE_EQ(attention_flops(s, false), 4.0 * 32 * 8192.0 * 1024 * 128);
  s.window = 100000;  // a window longer than the sequence is no window
  EXPECT_DOUBLE_EQ(attention_flops(s, false), full / 2);
  // Multi-latent attention: scores over D = 192, values over Dv = 128.
  s.d = 192, s.dv = 128;
  EXPECT_DOUBLE_EQ(attention_flops(s, false), 2.0 * 32 * 8192.0 * 8192.0 * (192 + 128) / 2);
}

TEST(Shapes, AttentionShapesFromOpInputs) {
  const std::string bf = "c10::BFloat16";
  std::vector<std::string> concrete(13, "");
  concrete[10] = "True";
  auto cudnn = attention_shape_from_op("aten::_cudnn_attention_forward",
                                       {{2, 4, 128, 64}, {2, 2, 128, 64}, {2, 2, 128, 64}},
                                       {bf, bf, bf}, concrete);
  ASSERT_TRUE(cudnn.has_value());
  EXPECT_EQ(std::tie(cudnn->b, cudnn->h, cudnn->kv, cudnn->t, cudnn->s, cudnn->d),
            std::make_tuple(2, 4, 2, 128, 128, 64));
  EXPECT_EQ(cudnn->causal, 1);
  EXPECT_EQ(cudnn->dtype, "bf16");
  // FlashAttention's own op takes (batch, seq, heads, dim) and a window size.
  std::vector<std::string> flash(15, "");
  flash[8] = "True";
  flash[11] = "32";
  auto fa = attention_shape_from_op("aten::_flash_attention_forward",
                                    {{2, 128, 4, 64}, {2, 96, 2, 64}, {2, 96, 2, 64}}, {bf, bf, bf},
                                    flash);
  ASSERT_TRUE(fa.has_value());
  EXPECT_EQ(std::tie(fa->b, fa->t, fa->h, fa->s, fa->kv, fa->d, fa->window),
            std::make_tuple(2, 128, 4, 96, 2, 64, 32));
}

TEST(Shapes, GemmTableWithRooflineOnH100) {
  TraceBuilder b(test_dir());
  b.kernel("nvjet_big", 0, 200, {{"M", 4096}, {"N", 4096}, {"K", 4096}, {"dtype", "bf16"}})
      .kernel("nvjet_gemv", 300, 20, {{"M", 16}, {"N", 4096}, {"K", 4096}, {"dtype", "bf16"}})
      // split-K: two kernels of one aten::mm call are one call with the summed time
      .cpu_op("aten::mm", 390, 40,
              {{"External id", 5},
               {"Input Dims", {{64, 16}, {16, 32}}},
               {"Input type", {"float", "float"}}})
      .kernel("sm90_xmma_gemm_f32f32", 400, 3, {{"External id", 5}})
      .kernel("void cublasLt::splitKreduce_kernel<32, 16>", 404, 1, {{"External id", 5}})
      .kernel("nvjet_orphan", 500, 2);  // no shape anywhere: kept, with empty shape cells
  TraceData d = TraceData::load(b.write("t.json"), false);
  Table t = gemm_table(d, find_gpu_spec("H100"));
  ASSERT_EQ(t.rows.size(), 4u);
  // Sorted by total time: big, gemv, split-K call, orphan.
  EXPECT_EQ(num(t, 0, "M"), 4096);
  const double flops = 2.0 * 4096 * 4096 * 4096;
  EXPECT_NEAR(num(t, 0, "gflop"), flops / 1e9, 1e-6);
  EXPECT_NEAR(num(t, 0, "tflops"), flops / 200e-6 / 1e12, 1e-6);
  EXPECT_NEAR(num(t, 0, "peak_pct"), 100 * flops / 200e-6 / 1e12 / 989.4, 1e-6);
  EXPECT_NEAR(num(t, 0, "ridge_flops_per_byte"), 989.4 / 3.35, 1e-9);
  EXPECT_EQ(text(t, 0, "bound"), "compute");
  EXPECT_EQ(text(t, 0, "op"), "tessera args");
  EXPECT_EQ(text(t, 1, "bound"), "memory");
  const double gemv_flops = 2.0 * 16 * 4096 * 4096;
  const double gemv_bytes = 2.0 * (16 * 4096 + 4096 * 4096 + 16 * 4096);
  EXPECT_NEAR(num(t, 1, "flops_per_byte"), gemv_flops / gemv_bytes, 1e-9);
  EXPECT_NEAR(num(t, 1, "roofline_pct"),
              100 * (gemv_flops / 20e-6 / 1e12) / (gemv_flops / gemv_bytes * 3.35), 1e-6);
  EXPECT_EQ(num(t, 2, "count"), 1);
  EXPECT_DOUBLE_EQ(num(t, 2, "total_ms"), 0.004);
  EXPECT_EQ(text(t, 2, "dtype"), "fp32");
  EXPECT_EQ(text(t, 2, "op"), "aten::mm");
  EXPECT_TRUE(empty(t, 3, "M"));
  EXPECT_EQ(num(t, 3, "count"), 1);
  // Without a GPU spec the peak columns stay empty.
  Table no_gpu = gemm_table(d, std::nullopt);
  EXPECT_TRUE(empty(no_gpu, 0, "peak_pct"));
  EXPECT_FALSE(empty(no_gpu, 0, "tflops"));
}

TEST(Shapes, AttentionTableFromArgsAndOps) {
  TraceBuilder b(test_dir());
  b.kernel("attention_forward_kernel", 0, 2000,
           {{"B", 1},
            {"H", 32},
            {"KV", 8},
            {"T", 8192},
            {"D", 128},
            {"causal", true},
            {"dtype", "bf16"}})
      .kernel("attention_backward_kernel", 3000, 5000,
              {{"B", 1},
               {"H", 32},
               {"KV", 8},
               {"T", 8192},
               {"D", 128},
               {"causal", true},
               {"dtype", "bf16"}})
      .cpu_op("aten::_cudnn_attention_backward", 9000, 100,
              {{"External id", 9},
               {"Input Dims", {{2, 4, 128, 64}, {2, 4, 128, 64}, {2, 2, 128, 64}, {2, 2, 128, 64}}},
               {"Input type", {"c10::BFloat16", "c10::BFloat16"}},
               {"Concrete Inputs",
                {"", "", "", "", "", "", "", "", "", "", "", "128", "128", "0.", "True", ""}}})
      .kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_x", 9010, 8, {{"External id", 9}})
      .kernel("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", 9020, 2,
              {{"External id", 9}});
  TraceData d = TraceData::load(b.write("t.json"), false);
  Table t = attention_table(d, find_gpu_spec("h100"));
  ASSERT_EQ(t.rows.size(), 3u);
  const double fwd = 4.0 * 32 * 8192.0 * 8192.0 * 128 / 2;
  EXPECT_EQ(text(t, 0, "pass"), "bwd");
  EXPECT_NEAR(num(t, 0, "gflop"), 2.5 * fwd / 1e9, 1e-6);
  EXPECT_EQ(text(t, 1, "pass"), "fwd");
  EXPECT_NEAR(num(t, 1, "tflops"), fwd / 2000e-6 / 1e12, 1e-6);
  EXPECT_EQ(num(t, 1, "S"), 8192);  // S defaults to T
  EXPECT_EQ(text(t, 1, "causal"), "true");
  // The cuDNN backward op's two kernels are one call of 10 µs.
  EXPECT_EQ(num(t, 2, "count"), 1);
  EXPECT_DOUBLE_EQ(num(t, 2, "mean_us"), 10);
  EXPECT_EQ(num(t, 2, "KV"), 2);
  EXPECT_NEAR(num(t, 2, "gflop"), 2.5 * 4.0 * 2 * 4 * 128 * 128 * 64 / 2 / 1e9, 1e-9);
}

TEST(Collectives, NamesAndBusBandwidthFactors) {
  EXPECT_EQ(normalize_collective("allreduce"), "all_reduce");
  EXPECT_EQ(normalize_collective("_allgather_base"), "all_gather");
  EXPECT_EQ(normalize_collective("_reduce_scatter_base"), "reduce_scatter");
  EXPECT_EQ(normalize_collective("nccl:all_to_all"), "all_to_all");
  EXPECT_EQ(normalize_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL"), "all_reduce");
  EXPECT_EQ(normalize_collective("ncclDevKernel_SendRecv"), "send_recv");
  EXPECT_EQ(normalize_collective("ncclKernel_Broadcast_RING_LL_Sum_int8_t"), "broadcast");
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("all_reduce", 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("all_gather", 8), 0.875);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("reduce_scatter", 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("all_to_all", 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("broadcast", 8), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("send_recv", 2), 1.0);
}

TEST(Collectives, SizesFromKernelArgsOpArgsTesseraArgsAndNames) {
  TraceBuilder b(test_dir());
  b.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 128,
           {{"Collective name", "allreduce"},
            {"In msg nelems", 262144},
            {"Out msg nelems", 262144},
            {"Group size", 2},
            {"dtype", "Float"}})
      .cpu_op("record_param_comms", 190, 20,
              {{"External id", 5},
               {"Collective name", "_allgather_base"},
               {"In msg nelems", 1000},
               {"Out msg nelems", 8000},
               {"Group size", 8},
               {"dtype", "BFloat16"}})
      .kernel("ncclDevKernel_AllGather_RING_LL", 200, 10, {{"External id", 5}})
      .kernel("ncclDevKernel_ReduceScatter_Sum_bf16", 300, 100,
              {{"collective", "reduce_scatter"}, {"bytes", 1000000}, {"group_size", 4}})
      .kernel("ncclDevKernel_SendRecv_bf16", 500, 5);
  TraceData d = TraceData::load(b.write("t.json"), false);
  Table t = collectives_table(d);
  ASSERT_EQ(t.rows.size(), 4u);
  auto row = [&](const std::string& kind) {
    for (size_t r = 0; r < t.rows.size(); ++r) {
      if (text(t, r, "collective") == kind) return r;
    }
    ADD_FAILURE() << kind;
    return size_t{0};
  };
  size_t ar = row("all_reduce");
  EXPECT_EQ(num(t, ar, "bytes"), 262144 * 4);
  EXPECT_NEAR(num(t, ar, "algbw_gbps"), 262144 * 4 / 128e3, 1e-9);
  EXPECT_NEAR(num(t, ar, "busbw_gbps"), 262144 * 4 / 128e3 * 1.0, 1e-9);
  size_t ag = row("all_gather");
  EXPECT_EQ(num(t, ag, "bytes"), 16000);
  EXPECT_EQ(text(t, ag, "dtype"), "bf16");
  EXPECT_NEAR(num(t, ag, "busbw_gbps"), 1.6 * 0.875, 1e-9);
  size_t rs = row("reduce_scatter");
  EXPECT_NEAR(num(t, rs, "algbw_gbps"), 10.0, 1e-9);
  EXPECT_NEAR(num(t, rs, "busbw_gbps"), 7.5, 1e-9);
  size_t sr = row("send_recv");
  EXPECT_EQ(text(t, sr, "dtype"), "bf16");
  EXPECT_TRUE(empty(t, sr, "bytes"));
  EXPECT_TRUE(empty(t, sr, "busbw_gbps"));
}

TEST(GpuSpecs, TableHasTheSixGpusAndDetectsDeviceNames) {
  auto specs = load_gpu_specs();
  std::vector<std::string> names;
  for (const GpuSpec& s : specs) {
    names.push_back(s.name);
    EXPECT_GT(s.bf16_tflops, 0) << s.name;
    EXPECT_GT(s.fp8_tflops, s.bf16_tflops) << s.name;
    EXPECT_GT(s.hbm_tbps, 0) << s.name;
    EXPECT_FALSE(s.source.empty()) << s.name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"H100", "H200", "B200", "MI300X", "MI325X", "MI355X"}));
  EXPECT_EQ(find_gpu_spec("NVIDIA H100 80GB HBM3")->name, "H100");
  EXPECT_EQ(find_gpu_spec("AMD Instinct MI300X")->name, "MI300X");
  EXPECT_FALSE(find_gpu_spec("GeForce GTX 1080").has_value());
  EXPECT_EQ(peak_tflops(*find_gpu_spec("H200"), "fp8_e4m3"), 1978.9);
  EXPECT_EQ(dtype_info("c10::BFloat16").name, "bf16");
  EXPECT_EQ(dtype_info("long int").bytes, 8);
  EXPECT_EQ(dtype_info("Float8_e5m2").name, "fp8_e5m2");
}

}  // namespace
}  // namespace tessera::analysis
