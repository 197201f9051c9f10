// The bandwidth and ops_unique_args sheets and the report's headline on hand-built traces
// whose answers are worked out here, from the op shapes and the GPU's datasheet bandwidth.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include <fmt/format.h>

#include "tessera/analysis/bandwidth.h"
#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/kernel_tables.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/trace_data.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::json;
using testing::test_dir;
using testing::TraceBuilder;

bool empty(const Table& t, size_t row, const char* column) {
  return std::holds_alternative<std::monostate>(t.rows[row][t.column(column)]);
}

size_t row_of(const Table& t, const char* column, const std::string& value) {
  for (size_t r = 0; r < t.rows.size(); ++r) {
    if (t.text(r, column) == value) return r;
  }
  ADD_FAILURE() << "no row with " << column << " = " << value << " in " << t.name;
  return 0;
}

// A Tessera op (cpu_op with its sizes) and the kernel it launched, linked by External id.
void tessera_op(TraceBuilder& b, const std::string& op, int64_t ext, json args, double ts,
                const std::string& kernel, double kernel_us) {
  args["External id"] = ext;
  b.cpu_op(op, ts, kernel_us + 5, args);
  b.kernel(kernel, ts + 1, kernel_us, {{"External id", ext}});
}

// Tessera ops of every byte model kind, in µs on device 0.
TraceData tessera_trace(const std::filesystem::path& dir) {
  TraceBuilder b(dir);
  b.member("deviceProperties", {{{"name", "NVIDIA H100 80GB HBM3"}}});
  const json norm = {{"rows", 4096}, {"cols", 4096}, {"dtype", "bf16"}};
  tessera_op(b, "rmsnorm_forward", 1, norm, 0, "rmsnorm_forward_kernel", 100);
  tessera_op(b, "rmsnorm_forward", 2, norm, 200, "rmsnorm_forward_kernel", 60);
  // sum launches two kernels: one call of 20 + 5 µs.
  tessera_op(b, "sum", 3, {{"numel", 1 << 20}, {"dtype", "fp32"}, {"accumulate", false}}, 400,
             "void tessera::sum_partial_kernel<float>", 20);
  b.kernel("void tessera::sum_final_kernel", 425, 5, {{"External id", 3}});
  tessera_op(b, "convert", 4, {{"numel", 1 << 20}, {"dtype", "bf16"}, {"src_dtype", "fp32"}}, 500,
             "void tessera::cuda::convert_kernel<float, bf16>", 8);
  b.cpu_op("upload", 600, 50, {{"External id", 5}, {"nbytes", 1 << 20}, {"dtype", "fp32"}});
  b.memcpy(601, 40, 0, "Memcpy HtoD (Pageable -> Device)",
           {{"External id", 5}, {"bytes", 1 << 20}});
  b.cpu_op("copy", 700, 20, {{"External id", 6}, {"nbytes", 8 << 20}, {"dtype", "bf16"}});
  b.memcpy(701, 10, 0, "Memcpy DtoD (Device -> Device)", {{"External id", 6}, {"bytes", 8 << 20}});
  b.memset(720, 2, 0, {{"bytes", 4096}});
  b.kernel("void at::native::vectorized_elementwise_kernel<4, add>", 730, 3);  // no op
  tessera_op(b, "mystery_op", 7, {{"numel", 10}}, 740, "swiglu_forward_kernel", 4);
  tessera_op(b, "copy_columns", 10, {{"rows", 8}, {"cols", 64}, {"dtype", "bf16"}, {"op_bytes", 2048}},
             770, "void tessera::cuda::copy_columns_kernel<uint4>", 2);
  tessera_op(b, "fill", 8, {{"dtype", "bf16"}}, 750, "fill_kernel", 2);
  tessera_op(b, "matmul", 9, {{"M", 64}, {"N", 64}, {"K", 64}, {"dtype", "bf16"}}, 760,
             "nvjet_sm90_x", 5);
  return TraceData::load(b.write("t.json"), false);
}

TEST(Bandwidth, TesseraOpsBytesGbpsAndShareOfHbm) {
  const TraceData d = tessera_trace(test_dir());
  const GpuSpec h100 = *find_gpu_spec("H100");
  const Table t = bandwidth_table(d, h100);
  ASSERT_EQ(t.rows.size(), 10u);  // every op but the GEMM, and the memset

  // RMSNorm: x and out (rows x cols bf16), weight (cols bf16), rstd (rows fp32); two calls.
  const double norm_bytes = (2.0 * 4096 * 4096 + 4096) * 2 + 4.0 * 4096;
  const size_t norm = row_of(t, "op", "rmsnorm_forward");
  EXPECT_EQ(t.number(norm, "count").value(), 2);
  EXPECT_DOUBLE_EQ(t.number(norm, "mean_us").value(), 80);
  EXPECT_DOUBLE_EQ(t.number(norm, "mbytes").value(), norm_bytes / 1e6);
  const double gbps = norm_bytes / 80e-6 / 1e9;
  EXPECT_NEAR(t.number(norm, "gbps").value(), gbps, 1e-9);
  EXPECT_NEAR(t.number(norm, "hbm_pct").value(), 100 * gbps / (h100.hbm_tbps * 1e3), 1e-9);
  EXPECT_NEAR(t.number(norm, "excess_ms").value(),
              0.160 - 2 * norm_bytes / (h100.hbm_tbps * 1e12) * 1e3, 1e-12);
  EXPECT_EQ(t.text(norm, "category"), "normalization");
  // Op args as the trace writes them (nlohmann orders the builder's keys).
  EXPECT_EQ(t.text(norm, "args"), R"({"cols": 4096, "dtype": "bf16", "rows": 4096})");
  EXPECT_EQ(t.text(norm, "bytes_basis"),
            "rmsnorm_forward: x, weight read; out, rstd (fp32) written");
  EXPECT_EQ(norm, 0u);  // the most time first

  // A call is the op instance: both sum kernels, 25 µs; x read, the fp32 sum written.
  const size_t sum = row_of(t, "op", "sum");
  EXPECT_EQ(t.number(sum, "count").value(), 1);
  EXPECT_DOUBLE_EQ(t.number(sum, "mean_us").value(), 25);
  EXPECT_DOUBLE_EQ(t.number(sum, "mbytes").value(), (4.0 * (1 << 20) + 4) / 1e6);
  EXPECT_EQ(t.text(sum, "kernel"), "void tessera::sum_partial_kernel<float>");

  const size_t convert = row_of(t, "op", "convert");
  EXPECT_DOUBLE_EQ(t.number(convert, "mbytes").value(), 6.0 * (1 << 20) / 1e6);
  EXPECT_NEAR(t.number(convert, "gbps").value(), 6.0 * (1 << 20) / 8e-6 / 1e9, 1e-9);

  // Copies carry their own bytes: device to device reads and writes them, a host transfer
  // is bound by its link, not HBM.
  const size_t copy = row_of(t, "op", "copy");
  EXPECT_DOUBLE_EQ(t.number(copy, "mbytes").value(), 2.0 * (8 << 20) / 1e6);
  EXPECT_EQ(t.text(copy, "memory"), "HBM");
  EXPECT_EQ(t.text(copy, "category"), "memcpy");
  const size_t upload = row_of(t, "op", "upload");
  EXPECT_DOUBLE_EQ(t.number(upload, "gbps").value(), (1 << 20) / 40e-6 / 1e9);
  EXPECT_EQ(t.text(upload, "memory"), "host/peer link");
  EXPECT_TRUE(empty(t, upload, "hbm_pct"));
  const size_t memset = row_of(t, "kernel", "Memset (Device)");
  EXPECT_EQ(t.text(memset, "op"), "(no op)");
  EXPECT_DOUBLE_EQ(t.number(memset, "mbytes").value(), 4096 / 1e6);

  // An op without a model of its own here: the op table's count it carries.
  const size_t columns = row_of(t, "op", "copy_columns");
  EXPECT_DOUBLE_EQ(t.number(columns, "mbytes").value(), 2048 / 1e6);
  EXPECT_EQ(t.text(columns, "bytes_basis"), "copy_columns: the op's own count (op_bytes)");

  // Listed, not dropped, with the reason.
  const size_t lone = row_of(t, "kernel", "void at::native::vectorized_elementwise_kernel<4, add>");
  for (const auto& [r, why] : std::vector<std::pair<size_t, std::string>>{
           {lone, "not derived: no launching op (the kernel has no External id or runtime link)"},
           {row_of(t, "op", "mystery_op"), "not derived: no byte model for op 'mystery_op'"},
           {row_of(t, "op", "fill"), "not derived: op argument 'numel' is (missing)"}}) {
    EXPECT_EQ(t.text(r, "bytes_basis"), why);
    EXPECT_TRUE(empty(t, r, "mbytes") && empty(t, r, "gbps") && empty(t, r, "hbm_pct"));
    EXPECT_EQ(t.number(r, "count").value(), 1);
  }

  // Without a GPU the rates stay, the share of HBM goes.
  const Table no_gpu = bandwidth_table(d, std::nullopt);
  EXPECT_NEAR(no_gpu.number(0, "gbps").value(), gbps, 1e-9);
  EXPECT_TRUE(empty(no_gpu, 0, "hbm_pct") && empty(no_gpu, 0, "excess_ms"));
}

TEST(Bandwidth, PyTorchOpBytes) {
  // 2 x 128 x 256 = 65536 elements.
  const char* dims = "[[2, 128, 256], [2, 128, 256], []]";
  struct Case {
    const char* op;
    const char* dims;
    const char* types;
    const char* concrete;
    double bytes;
    const char* basis;
  } cases[] = {
      // Out of place: inputs read, the broadcast output in the widest type written.
      {"aten::add", dims, R"(["float", "c10::BFloat16", "Scalar"])", "[]", 65536.0 * (4 + 2 + 4),
       "elementwise: every tensor read, one output of their broadcast shape written"},
      {"aten::mul", "[[2, 2, 128, 32], [128, 32]]", R"(["float", "float"])", "[]",
       4.0 * (16384 + 4096 + 16384),
       "elementwise: every tensor read, one output of their broadcast shape written"},
      {"aten::silu", "[[2, 128, 1024]]", R"(["c10::BFloat16"])", "[]", 262144.0 * 4,
       "elementwise: every tensor read, one output of their broadcast shape written"},
      {"aten::copy_", dims, R"(["c10::BFloat16", "float", "Scalar"])", "[]", 65536.0 * (2 + 4),
       "copy: source read, destination written"},
      {"aten::fill_", "[[256, 1024], []]", R"(["float", "Scalar"])", "[]", 262144.0 * 4,
       "fill: self written"},
      {"aten::fill_", "[[], []]", R"(["float", "Scalar"])", "[]", 4, "fill: self written"},
      {"aten::add_", dims, R"(["float", "float", "Scalar"])", "[]", 65536.0 * 4 * 3,
       "in place: every tensor read, self written"},
      {"aten::sum", "[[2, 128, 256]]", R"(["float", "ScalarList", "Scalar", ""])",
       R"(["", "[-1]", "False", ""])", 4.0 * (65536 + 256),
       "reduction: input read, reduced output written"},
      {"aten::mean", "[[2, 128, 256]]", R"(["c10::BFloat16"])", R"(["", ""])", 2.0 * (65536 + 1),
       "reduction: input read, reduced output written"},
      {"triton_poi_fused__to_copy_t_1", "[[256, 256], [256, 256], []]",
       R"(["float", "c10::BFloat16", "Scalar"])", R"(["", "", "65536"])", 65536.0 * (4 + 2),
       "triton: every tensor argument once"},
  };
  for (const Case& c : cases) {
    const BytesEstimate e = pytorch_op_bytes(c.op, c.dims, c.types, c.concrete);
    EXPECT_DOUBLE_EQ(e.bytes, c.bytes) << c.op << " " << c.dims;
    EXPECT_EQ(e.basis, c.basis) << c.op;
  }
  struct NotDerived {
    const char* op;
    const char* dims;
    const char* types;
    const char* why;
  } not_derived[] = {
      {"aten::cat", "[[[2, 128], [2, 128]], []]", R"(["TensorList", "Scalar"])",
       "not derived: argument 0 is a TensorList, which the trace gives no element type for"},
      {"aten::nll_loss_forward", "[[256, 1024], [256], []]", R"(["float", "long int", "Scalar"])",
       "not derived: the tensor arguments do not broadcast, so the output is unknown"},
      {"aten::add", "[[], []]", R"(["Scalar", "Scalar"])",
       "not derived: the op has no tensor arguments"},
  };
  for (const NotDerived& c : not_derived) {
    const BytesEstimate e = pytorch_op_bytes(c.op, c.dims, c.types, "[]");
    EXPECT_LT(e.bytes, 0) << c.op;
    EXPECT_EQ(e.basis, c.why) << c.op;
  }
}

// A PyTorch op linked to its kernel through the launch's correlation only, as in eager traces.
TEST(Bandwidth, PyTorchOpThroughTheRuntimeLink) {
  TraceBuilder b(test_dir());
  b.cpu_op("aten::mul", 0, 10,
           {{"External id", 1},
            {"Input Dims", {{2, 128, 1024}, {2, 128, 1024}}},
            {"Input type", {"c10::BFloat16", "c10::BFloat16"}},
            {"Input Strides", {{262144, 1024, 1}, {262144, 1024, 1}}},
            {"Concrete Inputs", {"", ""}}})
      .runtime(1, 77, 1)
      .kernel("void at::native::vectorized_elementwise_kernel<8, mul>", 2, 2,
              {{"correlation", 77}});
  const Table t = bandwidth_table(TraceData::load(b.write("t.json"), false), std::nullopt);
  ASSERT_EQ(t.rows.size(), 1u);
  EXPECT_EQ(t.text(0, "op"), "aten::mul");
  EXPECT_EQ(t.text(0, "input_dims"), "[[2,128,1024],[2,128,1024]]");
  EXPECT_DOUBLE_EQ(t.number(0, "mbytes").value(), 3 * 262144.0 * 2 / 1e6);
  EXPECT_DOUBLE_EQ(t.number(0, "gbps").value(), 3 * 262144.0 * 2 / 2e-6 / 1e9);
}

// Op instances and their kernels, in µs:
//   aten::mm [[64, 32], [32, 16]] three times (10, 20, 40), once more on another thread (8);
//   aten::mm [[128, 32], [32, 16]] once (5);
//   _fused_rms_norm_backward: kernels [100, 110) and [105, 120) on two streams: busy 20;
//   an NCCL kernel (left out) and a kernel without an op (3).
TraceData unique_args_trace(const std::filesystem::path& dir) {
  TraceBuilder b(dir);
  b.thread_name(100, "thread 100 (python3)");
  const json small = {{64, 32}, {32, 16}};
  const json types = {"c10::BFloat16", "c10::BFloat16"};
  const json strides = {{32, 1}, {16, 1}};
  auto mm = [&](int64_t ext, const json& dims, double ts, double dur, int tid = 100) {
    b.cpu_op("aten::mm", ts, dur + 2,
             {{"External id", ext},
              {"Input Dims", dims},
              {"Input type", types},
              {"Input Strides", strides},
              {"Concrete Inputs", {"", ""}},
              {"Sequence number", ext}},  // per call: must not split the rows
             tid);
    b.kernel("nvjet_sm90_mm", ts + 1, dur, {{"External id", ext}});
  };
  mm(11, small, 0, 10);
  mm(12, small, 20, 20);
  mm(13, small, 50, 40);
  mm(14, {{128, 32}, {32, 16}}, 95, 5);
  mm(17, small, 200, 8, 200);
  b.cpu_op("aten::_fused_rms_norm_backward", 99, 30, {{"External id", 15}});
  b.kernel("layer_norm_grad_input_kernel", 100, 10, {{"External id", 15}}, 0, 7);
  b.kernel("GammaBetaBackward_kernel", 105, 15, {{"External id", 15}}, 0, 8);
  b.cpu_op("record_param_comms", 130, 30, {{"External id", 16}});
  b.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 131, 25, {{"External id", 16}}, 0, 20);
  b.kernel("mystery_kernel", 170, 3);
  return TraceData::load(b.write("t.json"), false);
}

TEST(OpsUniqueArgs, GroupsByNameThreadAndArgumentsWithTraceLensStatistics) {
  const Table t = ops_unique_args_table(unique_args_trace(test_dir()));
  ASSERT_EQ(t.rows.size(), 5u);
  const double whole = 70 + 8 + 5 + 20 + 3;
  // Sorted by total time: mm small (70), rms norm backward (20), mm on tid 200 (8), ...
  EXPECT_EQ(t.text(0, "name"), "aten::mm");
  EXPECT_EQ(t.text(0, "thread"), "thread 100 (python3)");
  // The raw JSON text of the trace, here compact.
  EXPECT_EQ(t.text(0, "input_dims"), "[[64,32],[32,16]]");
  EXPECT_EQ(t.text(0, "input_type"), R"(["c10::BFloat16","c10::BFloat16"])");
  EXPECT_EQ(t.text(0, "input_strides"), "[[32,1],[16,1]]");
  EXPECT_EQ(t.text(0, "other_args"), "");
  EXPECT_EQ(t.text(0, "category"), "GEMM");
  EXPECT_EQ(t.number(0, "count").value(), 3);
  EXPECT_DOUBLE_EQ(t.number(0, "total_ms").value(), 0.070);
  EXPECT_NEAR(t.number(0, "mean_us").value(), 70.0 / 3, 1e-9);
  EXPECT_DOUBLE_EQ(t.number(0, "median_us").value(), 20);
  const double mean = 70.0 / 3;
  const double std =
      std::sqrt((std::pow(10 - mean, 2) + std::pow(20 - mean, 2) + std::pow(40 - mean, 2)) /
                2);  // sample std, as pandas
  EXPECT_NEAR(t.number(0, "std_us").value(), std, 1e-9);
  EXPECT_DOUBLE_EQ(t.number(0, "min_us").value(), 10);
  EXPECT_DOUBLE_EQ(t.number(0, "max_us").value(), 40);
  EXPECT_NEAR(t.number(0, "share_pct").value(), 100 * 70 / whole, 1e-9);
  EXPECT_EQ(t.number(0, "example_external_id").value(), 11);
  // Busy time, not the sum of the two overlapping kernels.
  EXPECT_EQ(t.text(1, "name"), "aten::_fused_rms_norm_backward");
  EXPECT_DOUBLE_EQ(t.number(1, "total_ms").value(), 0.020);
  EXPECT_EQ(t.number(1, "kernels_per_call").value(), 2);
  EXPECT_TRUE(empty(t, 1, "std_us"));  // one call
  EXPECT_EQ(t.text(1, "kernels"), "GammaBetaBackward_kernel; layer_norm_grad_input_kernel");
  EXPECT_NEAR(t.number(1, "cumulative_pct").value(), 100 * 90 / whole, 1e-9);
  // The same op and arguments on another thread is another row (no thread_name: pid and tid).
  EXPECT_EQ(t.text(2, "name"), "aten::mm");
  EXPECT_EQ(t.text(2, "thread"), "pid 100 tid 200");
  EXPECT_EQ(t.text(3, "input_dims"), "[[128,32],[32,16]]");
  EXPECT_EQ(t.text(4, "name"), "(no op) mystery_kernel");
  EXPECT_NEAR(t.number(4, "cumulative_pct").value(), 100, 1e-9);
}

// Tessera's ops group by their own sizes.
TEST(OpsUniqueArgs, TesseraOpsGroupByTheirArgs) {
  const Table t = ops_unique_args_table(tessera_trace(test_dir()));
  const size_t norm = row_of(t, "name", "rmsnorm_forward");
  EXPECT_EQ(t.text(norm, "other_args"), R"({"cols": 4096, "dtype": "bf16", "rows": 4096})");
  EXPECT_EQ(t.number(norm, "count").value(), 2);
  EXPECT_EQ(t.text(norm, "thread"), "pid 100 tid 100");
  EXPECT_EQ(t.text(row_of(t, "name", "matmul"), "other_args"),
            R"({"K": 64, "M": 64, "N": 64, "dtype": "bf16"})");
}

TEST(Headline, StepBusyCategoriesGemmAndBandwidth) {
  TraceBuilder b(test_dir());
  b.member("deviceProperties", {{{"name", "NVIDIA H100 80GB HBM3"}}});
  b.step(1, 0, 1000).step(2, 1000, 3000);
  // GEMM [0, 100): 2*4096^3 FLOP. RMSNorm [100, 150), idle, RMSNorm [200, 260).
  b.kernel("nvjet_sm90_a", 0, 100, {{"M", 4096}, {"N", 4096}, {"K", 4096}, {"dtype", "bf16"}});
  const json norm = {{"rows", 4096}, {"cols", 4096}, {"dtype", "bf16"}};
  tessera_op(b, "rmsnorm_forward", 1, norm, 99, "rmsnorm_forward_kernel", 50);
  tessera_op(b, "rmsnorm_forward", 2, norm, 199, "rmsnorm_forward_kernel", 60);
  const Report r = build_report(TraceData::load(b.write("t.json"), false), ReportOptions{});
  std::map<std::string, std::vector<std::string>> h;
  for (const auto& [label, text] : r.headline) h[label].push_back(text);
  using Lines = std::vector<std::string>;
  EXPECT_EQ(h["step time"], Lines{"2.000 ms (mean of 2 ProfilerStep# ranges)"});
  EXPECT_EQ(h["GPU busy"],
            Lines{fmt::format("{:.1f}% of 0.260 ms: computation {:.1f}%, exposed "
                              "communication 0.0%, exposed memcpy 0.0%, idle "
                              "{:.1f}%",
                              100 * 210 / 260.0, 100 * 210 / 260.0, 100 * 50 / 260.0)});
  EXPECT_EQ(h["top categories"],
            Lines{fmt::format("normalization {:.1f}%, GEMM {:.1f}% of GPU time", 100 * 110 / 210.0,
                              100 * 100 / 210.0)});
  const double tflops = 2.0 * 4096 * 4096 * 4096 / 100e-6 / 1e12;
  EXPECT_EQ(h["GEMM"], Lines{fmt::format("{:.1f} TFLOP/s, {:.1f}% of peak (1 calls, 0.100 ms; "
                                         "shapes for 100% of that time)",
                                         tflops, 100 * tflops / 989.4)});
  const double bytes = (2.0 * 4096 * 4096 + 4096) * 2 + 4.0 * 4096;
  const double bps = 2 * bytes / 110e-6;
  EXPECT_EQ(h["bandwidth"],
            Lines{fmt::format("{:.2f} TB/s, {:.1f}% of H100 HBM (2 calls, 0.110 ms of elementwise, "
                              "reduction, normalization, optimizer and copy work; bytes for 100% "
                              "of that time)",
                              bps / 1e12, 100 * bps / 3.35e12)});
  EXPECT_EQ(h["worst bandwidth"],
            Lines{fmt::format("rmsnorm_forward {{\"cols\": 4096, \"dtype\": \"bf16\", \"rows\": "
                              "4096}}: {:.0f} GB/s, {:.1f}% of HBM (2 calls, {:.3f} ms above "
                              "the bandwidth floor)",
                              bps / 1e9, 100 * bps / 3.35e12, 0.110 - 2 * bytes / 3.35e12 * 1e3)});
}

}  // namespace
}  // namespace tessera::analysis
