// cuDNN fused attention through the backend graph API (cudnn_graph.h): see cudnn_attention.cuh
// for the contract. Everything cuDNN-specific is in this file; it needs only header-only parts
// of Tessera (core/error.h, ops/backend.h), so dev/attention builds it with plain nvcc.
//
// The graphs below are, node for node and attribute for attribute, what cudnn-frontend's
// CompositeSDPANode / CompositeSDPABackwardNode build on cuDNN 9.14-9.20 (frontend v1.15 and
// v1.23, include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, softmax.h,
// diagonal_band_mask.h, utils/attn_score_modifiers.h). cuDNN recognises that pattern and runs it
// as one fused flash-attention engine. Conventions copied from the frontend:
//   - every tensor: 4-D, BYTE_ALIGNMENT 16, a unique id; virtual tensors are IS_VIRTUAL,
//     fp32 unless stated (the frontend's intermediate type), bf16 where the frontend sets the
//     I/O type (the probabilities fed to the second matmul, GQA full-head dK/dV);
//   - scalars are pass-by-value fp32 tensors, dims and strides {1,1,1,1}, IS_BY_VALUE; the
//     variant pack points at a host float;
//   - pointwise: MATH_PREC fp32 (the compute type) unless stated, ALPHA1 = ALPHA2 = 1;
//     GEN_INDEX sets AXIS; matmul and reduction COMP_TYPE fp32;
//   - K (and V in backward) enter the matmuls as K^T: dims (B, KV, D, T), the strides of K
//     with the last two swapped.
//
// Forward (generate_stats = true, attn_scale by value, causal = right bound 0 top-left,
// window = left bound):
//   bmm1            matmul      Q (B,H,T,D), K^T (B,KV,D,T)          -> S (B,H,T,T) fp32
//   attn_scale      pointwise   MUL(S, scale)
//   [causal]        GEN_INDEX axis 2 -> row int32, GEN_INDEX axis 3 -> col int32,
//                   CMP_GE(row, col) (BOOLEAN math) -> keep, BINARY_SELECT(x, -inf, keep)
//   [window w]      GEN_INDEX axis 2 -> row, GEN_INDEX axis 3 -> col (int32; fp32 in the
//                   frontend <= 1.15 form, tried second), ADD(col, w) fp32,
//                   CMP_GT(col + w, row) (BOOLEAN) -> keep, BINARY_SELECT(x, -inf, keep)
//   softmax         reduction MAX -> max (B,H,T,1); SUB(x, max); EXP; reduction ADD -> sum;
//                   LOG(sum); ADD(max, log) -> Stats (B,H,T,1) fp32 (user: Tessera's lse);
//                   DIV(exp, sum) -> P (B,H,T,T) bf16
//   bmm2            matmul      P, V (B,KV,T,D)                       -> O (B,H,T,D) bf16
//
// Backward (frontend CompositeSDPABackwardNode, no dropout/bias):
//   mul_dO_O        MUL(dO, O) -> (B,H,T,D); reduce_dO_o reduction ADD -> (B,H,T,1);
//   scale_dropout_inv MUL(., 1.0) -> softmax_sum (B,H,T,1) fp32, non-virtual, in the workspace
//   matmul_Q_KT     Q, K^T -> S;  mul_s_attn_scale MUL(S, scale)
//   [padding]       T % 128 != 0: the frontend's workaround for wrong backward results (v1.15:
//                   always, v1.23: up to cuDNN 9.15.0), a padding mask with
//                   seq_len_q = seq_len_kv = T (int32 (B,1,1,1) in the workspace):
//                   GEN_INDEX row/col (int32 math), CMP_LT(row, seq_q), CMP_LT(col, seq_kv),
//                   LOGICAL_AND, BINARY_SELECT(x, -inf, .); the matmuls then carry M/N/K
//                   override descriptors pointing at the sequence lengths
//   sub_s_m         SUB(x, Stats);  [causal] [window] masks as in forward;  exp_s EXP
//   reshape_p       RESHAPE -> P^T view (B,H,T,T) strides (H*T*T, T*T, 1, T) bf16
//   matmul_pT_dO    P^T, dO -> dV (MHA) or dV_fullhead (B,H,T,D) bf16 + reduction ADD -> dV
//   matmul_dO_VT    dO, V^T -> dP;  sub_dP_softmax_sum SUB;  mul_dP_exp_s MUL;
//   mul_dS_attn_scale MUL(., scale) -> dS (fp32)
//   reshape_dS      RESHAPE -> dS^T view bf16;  matmul_dST_Q dS^T, Q -> dK (or dK_fullhead +
//                   reduction ADD)
//   reshape_k       RESHAPE K^T -> K view (B,KV,T,D) (fp32 virtual, as the frontend leaves it)
//   matmul_dS_K     dS, K -> dQ_accum (B,H,T,D) fp32 non-virtual in the workspace, then
//                   identity_dQ IDENTITY -> dQ; deterministic: matmul_dS_K -> dQ directly.
//
// Version rules copied from the frontend: cuDNN 9.14.0 (exactly) refuses full attention with a
// window and T > 1024 (known wrong results); backward refuses T = 1; D must be a multiple of 8,
// at most 256.
//
// Value heads narrower than the query/key heads (multi-latent attention, Dv < D) use the same
// graphs with V, O, dO and dV (and the dO * O product) Dv wide, as the frontend sizes them from
// the V tensor; whether an engine of the loaded cuDNN takes such a graph is its plan's answer
// (CudnnPlanInfo::supported), asked once per shape.
#include "tessera/backend/cuda/cudnn_attention.cuh"

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/core/error.h"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#include <dlfcn.h>
#include <link.h>
#define TESSERA_CUDNN_HEADERS 1
#else
#define TESSERA_CUDNN_HEADERS 0
#endif

namespace tessera::cuda {

namespace {

std::string version_text(size_t v) {  // 91500 -> "9.15.0" (cuDNN 9 numbering)
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
         std::to_string(v % 100);
}

constexpr size_t kWorkspaceAlign = 256;
size_t align_up(size_t n) {
  return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Offsets in a backward plan's workspace of Tessera's buffers and of the engine's own part.
struct BackwardWorkspace {
  size_t softmax_sum = 0, dq_accum = 0, seq_q = 0, seq_kv = 0, engine = 0;
};

BackwardWorkspace backward_workspace(int64_t B, int64_t H, int64_t T, int64_t D, bool deterministic,
                                     bool padding_workaround) {
  BackwardWorkspace w;
  size_t offset = 0;
  w.softmax_sum = offset;
  offset = align_up(offset + static_cast<size_t>(B * H * T) * sizeof(float));
  if (!deterministic) {
    w.dq_accum = offset;
    offset = align_up(offset + static_cast<size_t>(B * H * T * D) * sizeof(float));
  }
  if (padding_workaround) {
    w.seq_q = offset;
    offset = align_up(offset + static_cast<size_t>(B) * sizeof(int32_t));
    w.seq_kv = offset;
    offset = align_up(offset + static_cast<size_t>(B) * sizeof(int32_t));
  }
  w.engine = offset;
  return w;
}

}  // namespace

size_t cudnn_backward_tessera_workspace_bytes(const AttentionShape& s, bool deterministic) {
  // A window at least the sequence long restricts nothing and changes no buffer.
  return backward_workspace(s.batch, s.heads, s.seq, s.head_dim, deterministic, s.seq % 128 != 0)
      .engine;
}

#if TESSERA_CUDNN_HEADERS

namespace {

// Oldest cuDNN whose SDPA graphs this file relies on.
constexpr size_t kMinCudnnVersion = 91400;

std::string shape_text(const AttentionShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq) +
         " H=" + std::to_string(s.heads) + " KV=" + std::to_string(s.kv_heads) +
         " D=" + std::to_string(s.head_dim) +
         (s.v_dim() != s.head_dim ? " Dv=" + std::to_string(s.v_dim()) : std::string()) +
         (s.causal ? " causal" : " full") +
         (s.window > 0 ? " window=" + std::to_string(s.window) : std::string());
}

// The attention problem as the graphs see it; window 0 = no left bound (a window >= T restricts
// nothing, causal or not, and is dropped).
struct Geometry {
  int64_t B = 0, T = 0, H = 0, KV = 0, D = 0, Dv = 0, W = 0;
  bool causal = true;
  int64_t window = 0;
};

Geometry geometry_of(const AttentionShape& s) {
  Geometry g;
  g.B = s.batch, g.T = s.seq, g.H = s.heads, g.KV = s.kv_heads, g.D = s.head_dim, g.Dv = s.v_dim();
  g.W = s.qkv_width();
  g.causal = s.causal;
  g.window = (s.window > 0 && s.window < s.seq) ? s.window : 0;
  return g;
}

__global__ void fill_seq_lens_kernel(int32_t* seq_q, int32_t* seq_kv, int64_t n, int32_t value) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) {
    seq_q[i] = value;
    seq_kv[i] = value;
  }
}

// ---------------------------------------------------------------------------------------
// The library, loaded at run time
// ---------------------------------------------------------------------------------------
struct Api {
  std::string path;
  size_t version = 0;
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
};

// Loaded once per process and never unloaded (unloading cuDNN at exit is a known crash source).
const Api* load_api(std::string* why) {
  static Api api;
  static std::string error;
  static bool ok = false;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> names;
    if (const char* env = std::getenv("TESSERA_CUDNN_LIBRARY"); env != nullptr && *env != 0) {
      names.emplace_back(env);
    }
    names.emplace_back("libcudnn.so.9");
    void* lib = nullptr;
    std::string attempts;
    for (const std::string& name : names) {
      lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      const char* e = dlerror();
      attempts += (attempts.empty() ? "" : "; ") + std::string(e != nullptr ? e : name.c_str());
    }
    if (lib == nullptr) {
      error = "cuDNN 9 could not be loaded (" + attempts +
              "); put the directory of libcudnn.so.9 (e.g. PyTorch's site-packages/nvidia/"
              "cudnn/lib) on LD_LIBRARY_PATH, or set TESSERA_CUDNN_LIBRARY to the file";
      return;
    }
    std::string missing;
    auto resolve = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + symbol;
    };
    resolve(api.GetVersion, "cudnnGetVersion");
    resolve(api.GetErrorString, "cudnnGetErrorString");
    resolve(api.GetLastErrorString, "cudnnGetLastErrorString");
    resolve(api.Create, "cudnnCreate");
    resolve(api.Destroy, "cudnnDestroy");
    resolve(api.SetStream, "cudnnSetStream");
    resolve(api.CreateDescriptor, "cudnnBackendCreateDescriptor");
    resolve(api.DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    resolve(api.Finalize, "cudnnBackendFinalize");
    resolve(api.SetAttribute, "cudnnBackendSetAttribute");
    resolve(api.GetAttribute, "cudnnBackendGetAttribute");
    resolve(api.Execute, "cudnnBackendExecute");
    struct link_map* map = nullptr;
    api.path = (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr)
                   ? map->l_name
                   : names.back();
    if (!missing.empty()) {
      error = "the cuDNN library at " + api.path + " lacks " + missing + " (not cuDNN 9?)";
      return;
    }
    api.version = api.GetVersion();
    if (api.version < kMinCudnnVersion || api.version >= 100000) {
      error = "cuDNN " + version_text(api.version) + " (" + api.path +
              ") is not supported: Tessera's cuDNN attention needs cuDNN 9.14 or a newer 9.x";
      return;
    }
    ok = true;
  });
  if (!ok) {
    if (why != nullptr) *why = error;
    return nullptr;
  }
  return &api;
}

// "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN (3001): <cuDNN's last error message>"
std::string status_text(const Api& api, cudnnStatus_t status) {
  std::string text = api.GetErrorString(status);
  text += " (" + std::to_string(static_cast<int>(status)) + ")";
  char detail[2048] = {0};
  api.GetLastErrorString(detail, sizeof detail);
  detail[sizeof detail - 1] = 0;
  if (detail[0] != 0) text += ": " + std::string(detail);
  return text;
}

// Owns one backend descriptor.
class Desc {
 public:
  Desc() = default;
  Desc(const Api* api, cudnnBackendDescriptor_t d) : api_(api), d_(d) {}
  ~Desc() {
    if (d_ != nullptr) api_->DestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : api_(o.api_), d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&&) = delete;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

 private:
  const Api* api_ = nullptr;
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A failed step while building a graph or a plan: becomes CudnnPlanInfo::reason.
struct BuildFailure {
  std::string message;
};

// Where each non-virtual tensor's data lives at execution time.
enum class Bind {
  Q, K, V, O, Stats, dO, dQ, dK, dV,      // the op's buffers (views into qkv / dqkv / out)
  SoftmaxSum, DqAccum, SeqQ, SeqKV,        // Tessera-managed parts of the workspace
  Scale, Constant,                         // host floats passed by value
};

using Dims = std::array<int64_t, 4>;

#define TS_CUDNN_SET(desc, attr, type, count, values) set(desc, attr, #attr, type, count, values)

// Builds the tensors and operations of one graph. Every backend call is checked; a failure
// throws BuildFailure naming the graph, the node, the call and cuDNN's status and message.
class GraphBuilder {
 public:
  struct Binding {
    int64_t uid;
    Bind bind;
    float value;  // Constant scalars
  };

  GraphBuilder(const Api& api, std::string graph) : api_(api), graph_(std::move(graph)) {}

  // A user or workspace tensor (non-virtual).
  int64_t tensor(const char* name, cudnnDataType_t dtype, const Dims& dims, const Dims& strides,
                 Bind bind) {
    const int64_t uid = make_tensor(name, dtype, dims, strides, false, false);
    bindings_.push_back({uid, bind, 0.0f});
    return uid;
  }
  int64_t virt(const char* name, cudnnDataType_t dtype, const Dims& dims, const Dims& strides) {
    return make_tensor(name, dtype, dims, strides, true, false);
  }
  // A pass-by-value fp32 scalar: the attention scale (Bind::Scale, value given at execution) or
  // a constant.
  int64_t scalar(const char* name, Bind bind, float value) {
    const int64_t uid = make_tensor(name, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
    bindings_.push_back({uid, bind, value});
    return uid;
  }

  void matmul(const char* name, int64_t a, int64_t b, int64_t c, int64_t m_override = 0,
              int64_t n_override = 0, int64_t k_override = 0) {
    node_ = name;
    cudnnBackendDescriptor_t desc = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "MATMUL_DESCRIPTOR");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    TS_CUDNN_SET(desc, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(desc, "MATMUL_DESCRIPTOR");
    cudnnBackendDescriptor_t op =
        create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "OPERATION_MATMUL_DESCRIPTOR");
    set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, "CUDNN_ATTR_OPERATION_MATMUL_ADESC", a);
    set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, "CUDNN_ATTR_OPERATION_MATMUL_BDESC", b);
    set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, "CUDNN_ATTR_OPERATION_MATMUL_CDESC", c);
    TS_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc);
    if (m_override != 0) {
      set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
                 "CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC", m_override);
    }
    if (n_override != 0) {
      set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
                 "CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC", n_override);
    }
    if (k_override != 0) {
      set_tensor(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
                 "CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC", k_override);
    }
    finalize(op, "OPERATION_MATMUL_DESCRIPTOR");
    ops_.push_back(op);
    listing_ += std::string("  ") + name + ": matmul(" + tname(a) + ", " + tname(b) + ")" +
                (m_override || n_override || k_override ? " [M/N/K overrides]" : "") + " -> " +
                tname(c) + "\n";
  }

  // y = mode(x[, b[, t]]); axis only for GEN_INDEX. 0 = no tensor.
  void pointwise(const char* name, cudnnPointwiseMode_t mode, const char* mode_name,
                 cudnnDataType_t math, int64_t x, int64_t b, int64_t t, int64_t y,
                 int64_t axis = -1) {
    node_ = name;
    cudnnBackendDescriptor_t desc =
        create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "POINTWISE_DESCRIPTOR");
    TS_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    TS_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      TS_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    }
    finalize(desc, "POINTWISE_DESCRIPTOR");
    cudnnBackendDescriptor_t op =
        create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "OPERATION_POINTWISE_DESCRIPTOR");
    TS_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                 &desc);
    set_tensor(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, "CUDNN_ATTR_OPERATION_POINTWISE_XDESC", x);
    set_tensor(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, "CUDNN_ATTR_OPERATION_POINTWISE_YDESC", y);
    if (b != 0) {
      set_tensor(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, "CUDNN_ATTR_OPERATION_POINTWISE_BDESC",
                 b);
    }
    if (t != 0) {
      set_tensor(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, "CUDNN_ATTR_OPERATION_POINTWISE_TDESC",
                 t);
    }
    const float alpha = 1.0f;
    TS_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &alpha);
    TS_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &alpha);
    finalize(op, "OPERATION_POINTWISE_DESCRIPTOR");
    ops_.push_back(op);
    listing_ += std::string("  ") + name + ": " + mode_name + "(" + tname(x) +
                (b ? ", " + tname(b) : "") + (t ? ", " + tname(t) : "") + ")" +
                (axis >= 0 ? " axis " + std::to_string(axis) : "") + " math " + dtype_name(math) +
                " -> " + tname(y) + "\n";
  }

  void reduction(const char* name, cudnnReduceTensorOp_t op_type, const char* op_name, int64_t x,
                 int64_t y) {
    node_ = name;
    cudnnBackendDescriptor_t desc =
        create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "REDUCTION_DESCRIPTOR");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    TS_CUDNN_SET(desc, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    TS_CUDNN_SET(desc, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1,
                 &op_type);
    finalize(desc, "REDUCTION_DESCRIPTOR");
    cudnnBackendDescriptor_t op =
        create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "OPERATION_REDUCTION_DESCRIPTOR");
    TS_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc);
    set_tensor(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, "CUDNN_ATTR_OPERATION_REDUCTION_XDESC", x);
    set_tensor(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, "CUDNN_ATTR_OPERATION_REDUCTION_YDESC", y);
    finalize(op, "OPERATION_REDUCTION_DESCRIPTOR");
    ops_.push_back(op);
    listing_ += std::string("  ") + name + ": reduction " + op_name + "(" + tname(x) + ") -> " +
                tname(y) + "\n";
  }

  void reshape(const char* name, int64_t x, int64_t y) {
    node_ = name;
    cudnnBackendDescriptor_t op =
        create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "OPERATION_RESHAPE_DESCRIPTOR");
    set_tensor(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, "CUDNN_ATTR_OPERATION_RESHAPE_XDESC", x);
    set_tensor(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, "CUDNN_ATTR_OPERATION_RESHAPE_YDESC", y);
    finalize(op, "OPERATION_RESHAPE_DESCRIPTOR");
    ops_.push_back(op);
    listing_ += std::string("  ") + name + ": reshape(" + tname(x) + ") -> " + tname(y) + "\n";
  }

  // The operation graph over every operation added, bound to the handle (as the frontend does).
  cudnnBackendDescriptor_t operation_graph(cudnnHandle_t handle) {
    node_ = "operation graph";
    cudnnBackendDescriptor_t graph =
        create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "OPERATIONGRAPH_DESCRIPTOR");
    TS_CUDNN_SET(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                 static_cast<int64_t>(ops_.size()), ops_.data());
    if (handle != nullptr) {  // optional since cuDNN 9.8; the frontend sets it when it has one
      TS_CUDNN_SET(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    }
    finalize(graph, "OPERATIONGRAPH_DESCRIPTOR");
    return graph;
  }

  // Descriptors not tied to a node (heuristics, engine configs, the plan).
  cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type, const char* type_name) {
    cudnnBackendDescriptor_t d = nullptr;
    const cudnnStatus_t st = api_.CreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
      fail(std::string("cudnnBackendCreateDescriptor(CUDNN_BACKEND_") + type_name + ")", st);
    }
    descs_.emplace_back(&api_, d);
    return d;
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr, const char* attr_name,
           cudnnBackendAttributeType_t type, int64_t count, const void* values) {
    const cudnnStatus_t st = api_.SetAttribute(d, attr, type, count, values);
    if (st != CUDNN_STATUS_SUCCESS) {
      fail(std::string("cudnnBackendSetAttribute(") + attr_name + ")", st);
    }
  }
  void finalize(cudnnBackendDescriptor_t d, const char* what) {
    const cudnnStatus_t st = api_.Finalize(d);
    if (st != CUDNN_STATUS_SUCCESS) fail(std::string("cudnnBackendFinalize(") + what + ")", st);
  }
  [[noreturn]] void fail(const std::string& call, cudnnStatus_t st) {
    throw BuildFailure{graph_ + " graph, " + node_ + ": " + call + " failed: " +
                       status_text(api_, st)};
  }
  void set_node(const char* node) { node_ = node; }

  std::vector<Desc>& descriptors() { return descs_; }
  const std::vector<Binding>& bindings() const { return bindings_; }
  int op_count() const { return static_cast<int>(ops_.size()); }
  const std::string& listing() const { return listing_; }

 private:
  int64_t make_tensor(const char* name, cudnnDataType_t dtype, const Dims& dims,
                      const Dims& strides, bool is_virtual, bool by_value) {
    node_ = std::string("tensor '") + name + "'";
    const int64_t uid = next_uid_++;
    cudnnBackendDescriptor_t t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "TENSOR_DESCRIPTOR");
    const int64_t alignment = 16;
    TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype);
    TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    if (is_virtual) {
      const bool yes = true;
      TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    if (by_value) {
      const bool yes = true;
      TS_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    finalize(t, "TENSOR_DESCRIPTOR");
    tensors_[uid] = t;
    names_[uid] = name;
    listing_ += "  tensor " + std::to_string(uid) + " " + name + " " + dtype_name(dtype) + " dims (" +
                join(dims) + ") strides (" + join(strides) + ")" +
                (is_virtual ? " virtual" : by_value ? " by value" : "") + "\n";
    return uid;
  }
  void set_tensor(cudnnBackendDescriptor_t op, cudnnBackendAttributeName_t attr,
                  const char* attr_name, int64_t uid) {
    const auto it = tensors_.find(uid);
    if (it == tensors_.end()) {
      throw BuildFailure{graph_ + " graph, " + node_ + ": tensor uid " + std::to_string(uid) +
                         " does not exist (bug in cudnn_attention.cu)"};
    }
    cudnnBackendDescriptor_t t = it->second;
    set(op, attr, attr_name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
  }
  std::string tname(int64_t uid) const {
    const auto it = names_.find(uid);
    return (it == names_.end() ? std::string("?") : it->second) + "#" + std::to_string(uid);
  }
  static std::string join(const Dims& d) {
    return std::to_string(d[0]) + "," + std::to_string(d[1]) + "," + std::to_string(d[2]) + "," +
           std::to_string(d[3]);
  }
  static const char* dtype_name(cudnnDataType_t t) {
    switch (t) {
      case CUDNN_DATA_FLOAT: return "fp32";
      case CUDNN_DATA_BFLOAT16: return "bf16";
      case CUDNN_DATA_INT32: return "int32";
      case CUDNN_DATA_BOOLEAN: return "bool";
      default: return "other";
    }
  }

  const Api& api_;
  std::string graph_;
  std::string node_;
  std::vector<Desc> descs_;  // every descriptor, destroyed with the plan
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::map<int64_t, cudnnBackendDescriptor_t> tensors_;
  std::map<int64_t, std::string> names_;
  std::vector<Binding> bindings_;
  std::string listing_;
  int64_t next_uid_ = 1;
};

#define TS_PW(g, name, mode, math, x, b, t, y) (g).pointwise(name, mode, #mode, math, x, b, t, y)
#define TS_GEN_INDEX(g, name, math, x, y, axis)                                          \
  (g).pointwise(name, CUDNN_POINTWISE_GEN_INDEX, "CUDNN_POINTWISE_GEN_INDEX", math, x, 0, 0, y, \
                axis)
#define TS_RED(g, name, op, x, y) (g).reduction(name, op, #op, x, y)

// How the sliding-window bound is expressed (both are what some frontend version builds; if the
// first does not give a plan, the second is tried).
enum class WindowIndex {
  Int32,   // frontend >= 1.16 (CompositeDiagonalBandMaskNode): int32 row/col indices
  Float,   // frontend <= 1.15 (sliding_window_mask): fp32 row/col indices
};

constexpr cudnnDataType_t kF32 = CUDNN_DATA_FLOAT;
constexpr cudnnDataType_t kBF16 = CUDNN_DATA_BFLOAT16;
constexpr cudnnDataType_t kI32 = CUDNN_DATA_INT32;
constexpr cudnnDataType_t kBool = CUDNN_DATA_BOOLEAN;

// Causal (right bound 0, top-left diagonal) then window (left bound) masks on x (B,H,T,T).
int64_t apply_band_masks(GraphBuilder& g, int64_t x, const Geometry& G, WindowIndex index_type) {
  const Dims S{G.B, G.H, G.T, G.T}, Ss{G.H * G.T * G.T, G.T * G.T, G.T, 1};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (G.causal) {
    const int64_t row = g.virt("causal::row", kI32, S, Ss);
    TS_GEN_INDEX(g, "causal::gen_row_index", kF32, x, row, 2);
    const int64_t col = g.virt("causal::col", kI32, S, Ss);
    TS_GEN_INDEX(g, "causal::gen_col_index", kF32, x, col, 3);
    const int64_t keep = g.virt("causal::row>=col", kBool, S, Ss);
    TS_PW(g, "causal::row>=col", CUDNN_POINTWISE_CMP_GE, kBool, row, col, 0, keep);
    const int64_t fill = g.scalar("causal::-inf", Bind::Constant, neg_inf);
    const int64_t y = g.virt("causal::Y", kF32, S, Ss);
    TS_PW(g, "causal::binary_select", CUDNN_POINTWISE_BINARY_SELECT, kF32, x, fill, keep, y);
    x = y;
  }
  if (G.window > 0) {
    const cudnnDataType_t idx = index_type == WindowIndex::Int32 ? kI32 : kF32;
    const int64_t row = g.virt("window::row", idx, S, Ss);
    TS_GEN_INDEX(g, "window::gen_row_index", kF32, x, row, 2);
    const int64_t col = g.virt("window::col", idx, S, Ss);
    TS_GEN_INDEX(g, "window::gen_col_index", kF32, x, col, 3);
    const int64_t w = g.scalar("window::length", Bind::Constant, static_cast<float>(G.window));
    const int64_t col_w = g.virt("window::col+window", kF32, S, Ss);
    TS_PW(g, "window::col+window", CUDNN_POINTWISE_ADD, kF32, col, w, 0, col_w);
    const int64_t keep = g.virt("window::col+window>row", kBool, S, Ss);
    TS_PW(g, "window::col+window>row", CUDNN_POINTWISE_CMP_GT, kBool, col_w, row, 0, keep);
    const int64_t fill = g.scalar("window::-inf", Bind::Constant, neg_inf);
    const int64_t y = g.virt("window::Y", kF32, S, Ss);
    TS_PW(g, "window::binary_select", CUDNN_POINTWISE_BINARY_SELECT, kF32, x, fill, keep, y);
    x = y;
  }
  return x;
}

void build_forward_graph(GraphBuilder& g, const Geometry& G, WindowIndex index_type) {
  const int64_t B = G.B, T = G.T, H = G.H, KV = G.KV, D = G.D, Dv = G.Dv, W = G.W;
  const Dims S{B, H, T, T}, Ss{H * T * T, T * T, T, 1};
  const Dims R{B, H, T, 1}, Rs{H * T, T, 1, 1};
  const int64_t q = g.tensor("Q", kBF16, {B, H, T, D}, {T * W, D, W, 1}, Bind::Q);
  const int64_t kt = g.tensor("K^T", kBF16, {B, KV, D, T}, {T * W, D, 1, W}, Bind::K);
  const int64_t v = g.tensor("V", kBF16, {B, KV, T, Dv}, {T * W, Dv, W, 1}, Bind::V);
  const int64_t o = g.tensor("O", kBF16, {B, H, T, Dv}, {T * H * Dv, Dv, H * Dv, 1}, Bind::O);
  const int64_t stats = g.tensor("Stats", kF32, R, Rs, Bind::Stats);
  const int64_t scale = g.scalar("attn_scale", Bind::Scale, 0.0f);

  const int64_t s = g.virt("bmm1::C", kF32, S, Ss);
  g.matmul("bmm1", q, kt, s);
  int64_t x = g.virt("attn_scale::Y", kF32, S, Ss);
  TS_PW(g, "attn_scale", CUDNN_POINTWISE_MUL, kF32, s, scale, 0, x);
  x = apply_band_masks(g, x, G, index_type);

  // Softmax with statistics (frontend CompositeSoftmaxNode, stats only).
  const int64_t mx = g.virt("softmax::max", kF32, R, Rs);
  TS_RED(g, "softmax::Max", CUDNN_REDUCE_TENSOR_MAX, x, mx);
  const int64_t sub = g.virt("softmax::sub_M", kF32, S, Ss);
  TS_PW(g, "softmax::sub", CUDNN_POINTWISE_SUB, kF32, x, mx, 0, sub);
  const int64_t ex = g.virt("softmax::exp_sub_M", kF32, S, Ss);
  TS_PW(g, "softmax::exp", CUDNN_POINTWISE_EXP, kF32, sub, 0, 0, ex);
  const int64_t sum = g.virt("softmax::SumExp", kF32, R, Rs);
  TS_RED(g, "softmax::sum", CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  const int64_t lg = g.virt("softmax::log", kF32, R, Rs);
  TS_PW(g, "softmax::log", CUDNN_POINTWISE_LOG, kF32, sum, 0, 0, lg);
  TS_PW(g, "softmax::add", CUDNN_POINTWISE_ADD, kF32, mx, lg, 0, stats);
  const int64_t p = g.virt("softmax::P", kBF16, S, Ss);
  TS_PW(g, "softmax::div", CUDNN_POINTWISE_DIV, kF32, ex, sum, 0, p);

  g.matmul("bmm2", p, v, o);
}

// The frontend's padding mask (used here only as its cuDNN <= 9.15.0 backward workaround).
int64_t apply_padding_mask(GraphBuilder& g, int64_t x, int64_t seq_q, int64_t seq_kv,
                           const Geometry& G) {
  const Dims S{G.B, G.H, G.T, G.T}, Ss{G.H * G.T * G.T, G.T * G.T, G.T, 1};
  const int64_t row = g.virt("padding::row", kI32, S, Ss);
  TS_GEN_INDEX(g, "gen_row_idx_padding", kI32, x, row, 2);
  const int64_t col = g.virt("padding::col", kI32, S, Ss);
  TS_GEN_INDEX(g, "gen_col_idx_padding", kI32, x, col, 3);
  const int64_t row_ok = g.virt("padding::row<sq", kBool, S, Ss);
  TS_PW(g, "lt_row_sq_padding", CUDNN_POINTWISE_CMP_LT, kBool, row, seq_q, 0, row_ok);
  const int64_t col_ok = g.virt("padding::col<skv", kBool, S, Ss);
  TS_PW(g, "lt_col_skv_padding", CUDNN_POINTWISE_CMP_LT, kBool, col, seq_kv, 0, col_ok);
  const int64_t keep = g.virt("padding::keep", kBool, S, Ss);
  TS_PW(g, "and_row_col_padding", CUDNN_POINTWISE_LOGICAL_AND, kBool, row_ok, col_ok, 0, keep);
  const int64_t fill =
      g.scalar("padding::-inf", Bind::Constant, -std::numeric_limits<float>::infinity());
  const int64_t y = g.virt("padding::Y", kF32, S, Ss);
  TS_PW(g, "select_padding", CUDNN_POINTWISE_BINARY_SELECT, kF32, x, fill, keep, y);
  return y;
}

void build_backward_graph(GraphBuilder& g, const Geometry& G, WindowIndex index_type,
                          bool deterministic, bool padding_workaround) {
  const int64_t B = G.B, T = G.T, H = G.H, KV = G.KV, D = G.D, Dv = G.Dv, W = G.W;
  const Dims S{B, H, T, T}, Ss{H * T * T, T * T, T, 1};
  const Dims St{H * T * T, T * T, 1, T};  // the transposed (B,H,T,T) views
  const Dims R{B, H, T, 1}, Rs{H * T, T, 1, 1};
  const Dims Hd{B, H, T, D}, Hds{H * T * D, T * D, D, 1};  // packed (B,H,T,D) intermediates
  const Dims Hv{B, H, T, Dv}, Hvs{H * T * Dv, T * Dv, Dv, 1};  // and (B,H,T,Dv) ones
  const int64_t q = g.tensor("Q", kBF16, {B, H, T, D}, {T * W, D, W, 1}, Bind::Q);
  const int64_t kt = g.tensor("K^T", kBF16, {B, KV, D, T}, {T * W, D, 1, W}, Bind::K);
  const int64_t vt = g.tensor("V^T", kBF16, {B, KV, Dv, T}, {T * W, Dv, 1, W}, Bind::V);
  const int64_t o = g.tensor("O", kBF16, {B, H, T, Dv}, {T * H * Dv, Dv, H * Dv, 1}, Bind::O);
  const int64_t dout = g.tensor("dO", kBF16, {B, H, T, Dv}, {T * H * Dv, Dv, H * Dv, 1}, Bind::dO);
  const int64_t stats = g.tensor("Stats", kF32, R, Rs, Bind::Stats);
  const int64_t dq = g.tensor("dQ", kBF16, {B, H, T, D}, {T * W, D, W, 1}, Bind::dQ);
  const int64_t dk = g.tensor("dK", kBF16, {B, KV, T, D}, {T * W, D, W, 1}, Bind::dK);
  const int64_t dv = g.tensor("dV", kBF16, {B, KV, T, Dv}, {T * W, Dv, W, 1}, Bind::dV);
  const int64_t scale = g.scalar("attn_scale", Bind::Scale, 0.0f);
  int64_t seq_q = 0, seq_kv = 0;
  if (padding_workaround) {
    seq_q = g.tensor("seq_len_q", kI32, {B, 1, 1, 1}, {1, 1, 1, 1}, Bind::SeqQ);
    seq_kv = g.tensor("seq_len_kv", kI32, {B, 1, 1, 1}, {1, 1, 1, 1}, Bind::SeqKV);
  }

  // softmax_sum = rowsum(dO * O) (x 1.0, the dropout-free scale).
  const int64_t d_o = g.virt("mul_dO_O::Y", kF32, Hv, {H * T * Dv, T * Dv, H * Dv, 1});
  TS_PW(g, "mul_dO_O", CUDNN_POINTWISE_MUL, kF32, dout, o, 0, d_o);
  const int64_t rowsum = g.virt("reduce_dO_o::Y", kF32, R, Rs);
  TS_RED(g, "reduce_dO_o", CUDNN_REDUCE_TENSOR_ADD, d_o, rowsum);
  const int64_t one = g.scalar("one", Bind::Constant, 1.0f);
  const int64_t softmax_sum = g.tensor("softmax_sum", kF32, R, Rs, Bind::SoftmaxSum);
  TS_PW(g, "scale_dropout_inv", CUDNN_POINTWISE_MUL, kF32, rowsum, one, 0, softmax_sum);

  // P = exp(scale * Q K^T - stats), masked.
  const int64_t s = g.virt("matmul_Q_KT::C", kF32, S, Ss);
  g.matmul("matmul_Q_KT", q, kt, s, seq_q, seq_kv, 0);
  int64_t x = g.virt("mul_s_attn_scale::Y", kF32, S, Ss);
  TS_PW(g, "mul_s_attn_scale", CUDNN_POINTWISE_MUL, kF32, s, scale, 0, x);
  if (padding_workaround) x = apply_padding_mask(g, x, seq_q, seq_kv, G);
  const int64_t centered = g.virt("sub_s_m::Y", kF32, S, Ss);
  TS_PW(g, "sub_s_m", CUDNN_POINTWISE_SUB, kF32, x, stats, 0, centered);
  x = apply_band_masks(g, centered, G, index_type);
  const int64_t exp_s = g.virt("exp_s::Y", kF32, S, Ss);
  TS_PW(g, "exp_s", CUDNN_POINTWISE_EXP, kF32, x, 0, 0, exp_s);

  // dV = P^T dO (summed over the query heads of each KV head for GQA).
  const int64_t pt = g.virt("reshape_p::Y", kBF16, S, St);
  g.reshape("reshape_p", exp_s, pt);
  if (H == KV) {
    g.matmul("matmul_pT_dO", pt, dout, dv, seq_kv, 0, seq_q);
  } else {
    const int64_t dv_full = g.virt("matmul_pT_dO::C", kBF16, Hv, Hvs);
    g.matmul("matmul_pT_dO", pt, dout, dv_full, seq_kv, 0, seq_q);
    TS_RED(g, "red_dV_head", CUDNN_REDUCE_TENSOR_ADD, dv_full, dv);
  }

  // dS = scale * P * (dO V^T - softmax_sum).
  const int64_t dp = g.virt("matmul_dO_VT::C", kF32, S, Ss);
  g.matmul("matmul_dO_VT", dout, vt, dp, seq_q, seq_kv, 0);
  const int64_t dp_c = g.virt("sub_dP_softmax_sum::Y", kF32, S, Ss);
  TS_PW(g, "sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, kF32, dp, softmax_sum, 0, dp_c);
  const int64_t dp_p = g.virt("mul_dP_exp_s::Y", kF32, S, Ss);
  TS_PW(g, "mul_dP_exp_s", CUDNN_POINTWISE_MUL, kF32, dp_c, exp_s, 0, dp_p);
  const int64_t ds = g.virt("mul_dS_attn_scale::Y", kF32, S, Ss);
  TS_PW(g, "mul_dS_attn_scale", CUDNN_POINTWISE_MUL, kF32, dp_p, scale, 0, ds);

  // dK = dS^T Q (summed per KV head for GQA).
  const int64_t dst = g.virt("reshape_dS::Y", kBF16, S, St);
  g.reshape("reshape_dS", ds, dst);
  if (H == KV) {
    g.matmul("matmul_dST_Q", dst, q, dk, seq_kv, 0, seq_q);
  } else {
    const int64_t dk_full = g.virt("matmul_dST_Q::C", kBF16, Hd, Hds);
    g.matmul("matmul_dST_Q", dst, q, dk_full, seq_kv, 0, seq_q);
    TS_RED(g, "red_dK_head", CUDNN_REDUCE_TENSOR_ADD, dk_full, dk);
  }

  // dQ = dS K.
  const int64_t k = g.virt("reshape_k::Y", kF32, {B, KV, T, D}, {T * W, D, W, 1});
  g.reshape("reshape_k", kt, k);
  if (!deterministic) {
    const int64_t acc = g.tensor("dQ_accum", kF32, Hd, Hds, Bind::DqAccum);
    g.matmul("matmul_dS_K", ds, k, acc, seq_q, 0, seq_kv);
    TS_PW(g, "identity_dQ", CUDNN_POINTWISE_IDENTITY, kF32, acc, 0, 0, dq);
  } else {
    g.matmul("matmul_dS_K", ds, k, dq, seq_q, 0, seq_kv);
  }
}

#undef TS_PW
#undef TS_GEN_INDEX
#undef TS_RED

// One built plan with everything it references.
struct Plan {
  CudnnPlanInfo info;
  std::vector<Desc> descs;  // tensors, operations, graph, heuristics, engine configs, plan
  cudnnBackendDescriptor_t plan = nullptr;
  std::vector<GraphBuilder::Binding> bindings;
  // Workspace layout (bytes from the start of the caller's workspace).
  size_t softmax_sum_offset = 0, dq_accum_offset = 0, seq_q_offset = 0, seq_kv_offset = 0;
  size_t cudnn_offset = 0;
  bool padding_workaround = false;
  int64_t batch = 0, seq = 0;
};

std::string engine_notes(const Api& api, cudnnBackendDescriptor_t engine) {
  std::string notes;
  std::array<cudnnBackendBehaviorNote_t, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT> behavior{};
  int64_t n = 0;
  if (api.GetAttribute(engine, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                       static_cast<int64_t>(behavior.size()), &n, behavior.data()) ==
      CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(behavior.size()); ++i) {
      if (behavior[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) notes += " runtime-compiled";
      if (behavior[i] == CUDNN_BEHAVIOR_NOTE_SUPPORTS_CUDA_GRAPH_NATIVE_API) notes += " cuda-graph";
    }
  }
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> numerical{};
  n = 0;
  if (api.GetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                       static_cast<int64_t>(numerical.size()), &n, numerical.data()) ==
      CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(numerical.size()); ++i) {
      if (numerical[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) notes += " nondeterministic";
      if (numerical[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE) notes += " tensor-core";
    }
  }
  return notes.empty() ? notes : notes.substr(1);
}

// Operation graph -> heuristics (mode A, then fallback) -> the first engine config whose
// execution plan finalizes (the frontend's HEURISTICS_CHOICE policy).
void make_plan(const Api& api, cudnnHandle_t handle, GraphBuilder& g, Plan& out) {
  cudnnBackendDescriptor_t graph = g.operation_graph(handle);
  std::string attempts;
  const std::pair<cudnnBackendHeurMode_t, const char*> modes[] = {
      {CUDNN_HEUR_MODE_A, "CUDNN_HEUR_MODE_A"}, {CUDNN_HEUR_MODE_FALLBACK, "CUDNN_HEUR_MODE_FALLBACK"}};
  for (const auto& [mode, mode_name] : modes) {
    g.set_node(mode_name);
    cudnnBackendDescriptor_t heur = g.create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR,
                                             "ENGINEHEUR_DESCRIPTOR");
    g.set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, "CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH",
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
    g.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, "CUDNN_ATTR_ENGINEHEUR_MODE", CUDNN_TYPE_HEUR_MODE, 1,
          &mode);
    cudnnStatus_t st = api.Finalize(heur);
    if (st != CUDNN_STATUS_SUCCESS) {
      attempts += std::string("\n    ") + mode_name + ": heuristics finalize: " + status_text(api, st);
      continue;
    }
    int64_t count = 0;
    st = api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                          &count, nullptr);
    if (st != CUDNN_STATUS_SUCCESS || count <= 0) {
      attempts += std::string("\n    ") + mode_name + ": " +
                  (st != CUDNN_STATUS_SUCCESS ? "results count: " + status_text(api, st)
                                              : std::string("no engine config"));
      continue;
    }
    std::vector<cudnnBackendDescriptor_t> configs(static_cast<size_t>(count));
    for (auto& c : configs) c = g.create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "ENGINECFG_DESCRIPTOR");
    int64_t returned = 0;
    st = api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                          &returned, configs.data());
    if (st != CUDNN_STATUS_SUCCESS) {
      attempts += std::string("\n    ") + mode_name + ": results: " + status_text(api, st);
      continue;
    }
    for (int64_t i = 0; i < returned && i < count; ++i) {
      cudnnBackendDescriptor_t plan =
          g.create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "EXECUTION_PLAN_DESCRIPTOR");
      cudnnBackendDescriptor_t cfg = configs[static_cast<size_t>(i)];
      st = api.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                            CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
      if (st == CUDNN_STATUS_SUCCESS) st = api.Finalize(plan);
      if (st != CUDNN_STATUS_SUCCESS) {
        attempts += std::string("\n    ") + mode_name + " engine config " + std::to_string(i) +
                    ": execution plan: " + status_text(api, st);
        continue;
      }
      int64_t workspace = 0, n = 0;
      st = api.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                            &workspace);
      if (st != CUDNN_STATUS_SUCCESS || workspace < 0) {
        attempts += std::string("\n    ") + mode_name + " engine config " + std::to_string(i) +
                    ": workspace size: " + status_text(api, st);
        continue;
      }
      // Informational: the engine's global index and notes.
      cudnnBackendDescriptor_t engine =
          g.create(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "ENGINE_DESCRIPTOR");
      if (api.GetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                           &engine) == CUDNN_STATUS_SUCCESS) {
        int64_t index = -1;
        if (api.GetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                             &index) == CUDNN_STATUS_SUCCESS) {
          out.info.engine = index;
        }
        out.info.notes = engine_notes(api, engine);
      }
      out.plan = plan;
      out.cudnn_offset = align_up(out.cudnn_offset);
      out.info.workspace_bytes = out.cudnn_offset + static_cast<size_t>(workspace);
      return;
    }
  }
  throw BuildFailure{"no engine of cuDNN " + version_text(api.version) +
                     " takes this graph (" + std::to_string(g.op_count()) + " operations):" +
                     attempts};
}

// Why cuDNN will not be asked at all (empty: try it).
std::string precheck(const AttentionShape& s, const Geometry& G, bool backward, size_t version) {
  if (G.B <= 0 || G.T <= 0 || G.H <= 0 || G.KV <= 0 || G.D <= 0 || G.Dv <= 0 || G.H % G.KV != 0) {
    return "invalid shape";
  }
  if (!(s.scale > 0.0f) || !std::isfinite(s.scale)) return "scale must be positive and finite";
  if (G.D % 8 != 0 || G.D > 256) {
    return "head_dim " + std::to_string(G.D) + ": cuDNN SDPA needs a multiple of 8, at most 256";
  }
  if (G.Dv % 8 != 0 || G.Dv > 256) {
    return "value head_dim " + std::to_string(G.Dv) +
           ": cuDNN SDPA needs a multiple of 8, at most 256";
  }
  if (s.window < 0) return "negative window";
  if (backward && G.T == 1) return "cuDNN SDPA backward does not support T = 1 (s_q = s_kv = 1)";
  if (version == 91400 && !G.causal && G.window > 0 && G.T > 1024) {
    return "cuDNN 9.14.0 computes full attention with a window wrongly for T > 1024 (fixed in "
           "9.14.1)";
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------------------
// CudnnAttention
// ---------------------------------------------------------------------------------------

struct CudnnAttention::Impl {
  const Api* api = nullptr;
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  // (backward, deterministic, B, T, H, KV, D, Dv, causal, window)
  using Key =
      std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t>;
  std::map<Key, std::unique_ptr<Plan>> plans;

  ~Impl() {
    plans.clear();  // descriptors before the handle
    if (handle != nullptr) api->Destroy(handle);
  }

  Plan& plan_for(const AttentionShape& s, bool backward, bool deterministic) {
    const Geometry G = geometry_of(s);
    const Key key{backward, backward && deterministic, G.B, G.T, G.H, G.KV, G.D, G.Dv, G.causal,
                  G.window};
    auto it = plans.find(key);
    if (it != plans.end()) return *it->second;
    auto plan = std::make_unique<Plan>();
    build(*plan, s, G, backward, deterministic);
    return *plans.emplace(key, std::move(plan)).first->second;
  }

  void build(Plan& p, const AttentionShape& s, const Geometry& G, bool backward,
             bool deterministic) {
    const auto t0 = std::chrono::steady_clock::now();
    p.batch = G.B, p.seq = G.T;
    p.info.reason = precheck(s, G, backward, api->version);
    if (!p.info.reason.empty()) return;  // build_ms stays 0: nothing was built
    // Frontend v1.15 always applies it for T % 128 != 0; v1.23 only up to cuDNN 9.15.0. Always:
    // it costs a few mask operations on odd lengths only, and is a no-op mathematically.
    p.padding_workaround = backward && G.T % 128 != 0;
    const std::string what = std::string(backward ? "backward" : "forward") + " (" + shape_text(s) +
                             (backward && deterministic ? ", deterministic" : "") + ")";
    std::string failures;
    const WindowIndex styles[] = {WindowIndex::Int32, WindowIndex::Float};
    for (const WindowIndex style : styles) {
      if (style == WindowIndex::Float && G.window == 0) break;  // same graph: nothing new to try
      GraphBuilder g(*api, what);
      try {
        p.cudnn_offset = 0;
        if (backward) {
          build_backward_graph(g, G, style, deterministic, p.padding_workaround);
          const BackwardWorkspace w =
              backward_workspace(G.B, G.H, G.T, G.D, deterministic, p.padding_workaround);
          p.softmax_sum_offset = w.softmax_sum;
          p.dq_accum_offset = w.dq_accum;
          p.seq_q_offset = w.seq_q;
          p.seq_kv_offset = w.seq_kv;
          p.cudnn_offset = w.engine;
        } else {
          build_forward_graph(g, G, style);
        }
        p.info.graph_ops = g.op_count();
        make_plan(*api, handle, g, p);
        p.descs = std::move(g.descriptors());
        p.bindings = g.bindings();
        p.info.supported = true;
        p.info.reason.clear();
        if (style == WindowIndex::Float) p.info.notes += " (fp32 window indices)";
        break;
      } catch (const BuildFailure& f) {
        failures += (failures.empty() ? "" : "\n  then, with fp32 window indices: ") + f.message;
        if (std::getenv("TESSERA_CUDNN_DEBUG") != nullptr) {
          failures += "\n  graph:\n" + g.listing();
        }
      }
    }
    if (!p.info.supported) p.info.reason = failures;
    p.info.build_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  void execute(Plan& p, const void* q, const void* k, const void* v, const void* o,
               const void* stats, const void* dout, void* dq, void* dk, void* dv, void* workspace,
               float scale) {
    char* ws = static_cast<char*>(workspace);
    if (p.info.workspace_bytes > 0 && ws == nullptr) {
      throw InternalError("cuDNN attention: a workspace of " +
                          std::to_string(p.info.workspace_bytes) + " bytes is required");
    }
    if (p.padding_workaround) {
      const int threads = 128;
      const int64_t blocks = (p.batch + threads - 1) / threads;
      fill_seq_lens_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
          reinterpret_cast<int32_t*>(ws + p.seq_q_offset),
          reinterpret_cast<int32_t*>(ws + p.seq_kv_offset), p.batch, static_cast<int32_t>(p.seq));
      TS_CUDA_CHECK_LAUNCH("fill_seq_lens_kernel");
    }
    const size_t n = p.bindings.size();
    std::vector<int64_t> uids(n);
    std::vector<void*> pointers(n);
    std::vector<float> values(n);  // by-value scalars; must outlive cudnnBackendExecute
    for (size_t i = 0; i < n; ++i) {
      const GraphBuilder::Binding& b = p.bindings[i];
      uids[i] = b.uid;
      void* ptr = nullptr;
      switch (b.bind) {
        case Bind::Q: ptr = const_cast<void*>(q); break;
        case Bind::K: ptr = const_cast<void*>(k); break;
        case Bind::V: ptr = const_cast<void*>(v); break;
        case Bind::O: ptr = const_cast<void*>(o); break;
        case Bind::Stats: ptr = const_cast<void*>(stats); break;
        case Bind::dO: ptr = const_cast<void*>(dout); break;
        case Bind::dQ: ptr = dq; break;
        case Bind::dK: ptr = dk; break;
        case Bind::dV: ptr = dv; break;
        case Bind::SoftmaxSum: ptr = ws + p.softmax_sum_offset; break;
        case Bind::DqAccum: ptr = ws + p.dq_accum_offset; break;
        case Bind::SeqQ: ptr = ws + p.seq_q_offset; break;
        case Bind::SeqKV: ptr = ws + p.seq_kv_offset; break;
        case Bind::Scale: values[i] = scale, ptr = &values[i]; break;
        case Bind::Constant: values[i] = b.value, ptr = &values[i]; break;
      }
      pointers[i] = ptr;
    }
    cudnnBackendDescriptor_t raw = nullptr;
    check(api->CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &raw),
          "cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)");
    Desc pack(api, raw);
    void* cudnn_ws = p.info.workspace_bytes > p.cudnn_offset ? ws + p.cudnn_offset : nullptr;
    check(api->SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                            &cudnn_ws),
          "cudnnBackendSetAttribute(CUDNN_ATTR_VARIANT_PACK_WORKSPACE)");
    check(api->SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                            static_cast<int64_t>(n), pointers.data()),
          "cudnnBackendSetAttribute(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS)");
    check(api->SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                            static_cast<int64_t>(n), uids.data()),
          "cudnnBackendSetAttribute(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS)");
    check(api->Finalize(raw), "cudnnBackendFinalize(VARIANT_PACK)");
    check(api->Execute(handle, p.plan, raw), "cudnnBackendExecute");
  }

  void check(cudnnStatus_t st, const char* call) const {
    if (st != CUDNN_STATUS_SUCCESS) {
      throw InternalError(std::string("cuDNN attention: ") + call + " failed: " +
                          status_text(*api, st));
    }
  }

  Plan& supported_plan(const AttentionShape& s, bool backward, bool deterministic) {
    Plan& p = plan_for(s, backward, deterministic);
    if (!p.info.supported) {
      throw InternalError(std::string("cuDNN attention ") + (backward ? "backward" : "forward") +
                          " called for an unsupported shape (" + shape_text(s) +
                          "): " + p.info.reason);
    }
    return p;
  }
};

std::unique_ptr<CudnnAttention> CudnnAttention::create(cudaStream_t stream, std::string* why) {
  const Api* api = load_api(why);
  if (api == nullptr) return nullptr;
  auto impl = std::make_unique<Impl>();
  impl->api = api;
  impl->stream = stream;
  cudnnStatus_t st = api->Create(&impl->handle);
  if (st != CUDNN_STATUS_SUCCESS) {
    impl->handle = nullptr;
    if (why != nullptr) {
      *why = "cudnnCreate failed with cuDNN " + version_text(api->version) + " (" + api->path +
             "): " + status_text(*api, st);
    }
    return nullptr;
  }
  st = api->SetStream(impl->handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    if (why != nullptr) *why = "cudnnSetStream failed: " + status_text(*api, st);
    return nullptr;
  }
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(impl)));
}

size_t CudnnAttention::version() const { return impl_->api->version; }
std::string CudnnAttention::library_path() const { return impl_->api->path; }

const CudnnPlanInfo& CudnnAttention::forward_plan(const AttentionShape& s) {
  return impl_->plan_for(s, false, false).info;
}

const CudnnPlanInfo& CudnnAttention::backward_plan(const AttentionShape& s,
                                                   const CudnnAttentionOptions& o) {
  return impl_->plan_for(s, true, o.deterministic).info;
}

void CudnnAttention::forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                             void* workspace) {
  NvtxRange range("attention_forward");
  Plan& p = impl_->supported_plan(s, false, false);
  const char* base = static_cast<const char*>(qkv);
  const size_t head = static_cast<size_t>(s.head_dim) * 2;  // bytes per bf16 head
  impl_->execute(p, base, base + s.heads * head, base + (s.heads + s.kv_heads) * head, out, lse,
                 nullptr, nullptr, nullptr, nullptr, workspace, s.scale);
}

void CudnnAttention::backward(void* dqkv, const void* dout, const void* out, const float* lse,
                              const void* qkv, const AttentionShape& s, void* workspace,
                              const CudnnAttentionOptions& o) {
  NvtxRange range("attention_backward");
  Plan& p = impl_->supported_plan(s, true, o.deterministic);
  const char* base = static_cast<const char*>(qkv);
  char* dbase = static_cast<char*>(dqkv);
  const size_t head = static_cast<size_t>(s.head_dim) * 2;
  impl_->execute(p, base, base + s.heads * head, base + (s.heads + s.kv_heads) * head, out, lse,
                 dout, dbase, dbase + s.heads * head, dbase + (s.heads + s.kv_heads) * head,
                 workspace, s.scale);
}

#else  // !TESSERA_CUDNN_HEADERS: built without cudnn_graph.h; cuDNN is never available.

struct CudnnAttention::Impl {
  CudnnPlanInfo none;
};

std::unique_ptr<CudnnAttention> CudnnAttention::create(cudaStream_t, std::string* why) {
  if (why != nullptr) *why = "this build has no cuDNN support (cudnn_graph.h was not found)";
  return nullptr;
}
size_t CudnnAttention::version() const { return 0; }
std::string CudnnAttention::library_path() const { return ""; }
const CudnnPlanInfo& CudnnAttention::forward_plan(const AttentionShape&) { return impl_->none; }
const CudnnPlanInfo& CudnnAttention::backward_plan(const AttentionShape&,
                                                   const CudnnAttentionOptions&) {
  return impl_->none;
}
void CudnnAttention::forward(void*, float*, const void*, const AttentionShape&, void*) {
  throw InternalError("cuDNN attention: not built");
}
void CudnnAttention::backward(void*, const void*, const void*, const float*, const void*,
                              const AttentionShape&, void*, const CudnnAttentionOptions&) {
  throw InternalError("cuDNN attention: not built");
}

#endif  // TESSERA_CUDNN_HEADERS

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;

std::string CudnnAttention::version_string() const { return version_text(version()); }

}  // namespace tessera::cuda
