// Builds the cuDNN SDPA graphs of src/tessera/backend/cuda/cudnn_attention.cu on a machine
// WITHOUT a GPU: every tensor and operation descriptor is created, every attribute set and
// every descriptor finalized by the real libcudnn, and the operation graph finalized (without a
// handle). This catches wrong attribute types, values and shapes before device time is spent;
// engine heuristics and plans need a GPU and are left to the lab (cudnn part of
// attention_lab). Prints each graph's node listing with --print.
//
//   nvcc -std=c++20 -O1 -gencode=arch=compute_90a,code=sm_90a -I src \
//     dev/attention/cudnn_graph_check.cu -o /tmp/cudnn_graph_check -ldl
//   LD_LIBRARY_PATH=/usr/local/cuda/lib64 /tmp/cudnn_graph_check [--print]
//
// Exit status 0 only if every graph finalizes.
#include "../../src/tessera/backend/cuda/cudnn_attention.cu"

#include <cstdio>
#include <cstring>

using namespace tessera;
using namespace tessera::cuda;

int main(int argc, char** argv) {
  const bool print = argc > 1 && std::strcmp(argv[1], "--print") == 0;
#if !TESSERA_CUDNN_HEADERS
  std::printf("built without cudnn_graph.h\n");
  return 1;
#else
  std::string why;
  const Api* api = load_api(&why);
  if (api == nullptr) {
    std::printf("cuDNN unavailable: %s\n", why.c_str());
    return 1;
  }
  std::printf("cuDNN %s from %s\n", version_text(api->version).c_str(), api->path.c_str());
  struct Case {
    int64_t B, T, H, KV, D;
    bool causal;
    int64_t window;
  };
  const Case cases[] = {
      {1, 77, 4, 4, 64, true, 0},    {2, 200, 4, 2, 128, true, 0}, {1, 200, 8, 1, 128, true, 33},
      {1, 200, 4, 2, 64, false, 0},  {1, 200, 4, 4, 128, false, 33},
      {1, 8192, 32, 8, 128, true, 4096},
  };
  int failures = 0, graphs = 0;
  for (const Case& c : cases) {
    AttentionShape s;
    s.batch = c.B, s.seq = c.T, s.heads = c.H, s.kv_heads = c.KV, s.head_dim = c.D;
    s.causal = c.causal, s.window = c.window, s.scale = 0.125f;
    const Geometry G = geometry_of(s);
    for (int dir = 0; dir < 2; ++dir) {
      for (WindowIndex style : {WindowIndex::Int32, WindowIndex::Float}) {
        if (style == WindowIndex::Float && G.window == 0) continue;
        for (bool det : {false, true}) {
          if (dir == 0 && det) continue;
          for (bool padding : {false, true}) {
            if (dir == 0 && padding) continue;
            const std::string name = std::string(dir ? "backward" : "forward") + " (" +
                                     shape_text(s) + (det ? ", deterministic" : "") +
                                     (padding ? ", padding workaround" : "") +
                                     (style == WindowIndex::Float ? ", fp32 window index" : "") + ")";
            GraphBuilder g(*api, name);
            ++graphs;
            try {
              if (dir) {
                build_backward_graph(g, G, style, det, padding);
              } else {
                build_forward_graph(g, G, style);
              }
              g.operation_graph(nullptr);
              std::printf("ok    %-90s %2d operations\n", name.c_str(), g.op_count());
              if (print) std::printf("%s", g.listing().c_str());
            } catch (const BuildFailure& f) {
              ++failures;
              std::printf("FAIL  %s\n  %s\n%s", name.c_str(), f.message.c_str(), g.listing().c_str());
            }
          }
        }
      }
    }
  }
  std::printf("%d passed, %d failed\n", graphs - failures, failures);
  return failures == 0 ? 0 : 1;
#endif
}
