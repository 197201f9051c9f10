#pragma once
// Where every parameter lives in the one flat parameter buffer. A flat buffer makes the
// optimizer one fused pass, the gradient norm one reduction, data-parallel reduction a few
// large buckets and ZeRO shards contiguous ranges. The buffer is cut into units, each
// contiguous and read by one stage of the model (the embedding, each decoder layer, the final
// norm with the output head), so a unit can be gathered or freed as a whole (FSDP).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/model/model_spec.h"
#include "tessera/ops/backend.h"

namespace tessera {

enum class ParamInit { Normal, ScaledNormal, Ones, Zeros };

struct ParamInfo {
  std::string name;   // e.g. "model.layers.3.self_attn.qkv_proj.weight"
  Shape shape;
  int64_t offset = 0; // elements from the start of the flat buffer
  int layer = -1;     // -1 for embedding, final norm and output head
  int unit = 0;       // the ParamLayout::units entry holding it
  bool decay = true;  // weight matrices decay; norms and biases do not
  ParamInit init = ParamInit::Normal;
  int64_t numel() const { return shape.numel(); }
};

// [begin, end) in elements of the flat parameter buffer: a ZeRO-1 shard, a gradient bucket,
// a slice of a sharded checkpoint.
struct ParamRange {
  int64_t begin = 0, end = 0;
  int64_t count() const { return end - begin; }
};

// Device values of a range of the flat layout (range.count() elements of `values`): where an
// optimizer keeps its master weights of that range, for initialisation and loading.
struct FlatSlice {
  ParamRange range;
  Tensor values;
};

// Indices into ParamLayout::params for one decoder layer (-1 when absent).
struct LayerParamIndex {
  int attn_norm = -1, qkv_weight = -1, qkv_bias = -1, o_proj = -1, mlp_norm = -1,
      gate_up = -1, down_proj = -1;
};

struct ParamLayout {
  std::vector<ParamInfo> params;
  std::vector<LayerParamIndex> layers;
  int embedding = -1, final_norm = -1, lm_head = -1;  // lm_head == embedding when tied
  int64_t total = 0;
  // Consecutive ranges covering [0, total): 0 the embedding, 1 + l decoder layer l, and last
  // the final norm with the output head (with tied embeddings the head is unit 0's table).
  std::vector<ParamRange> units;
  int tail_unit() const { return static_cast<int>(units.size()) - 1; }

  const ParamInfo* find(const std::string& name) const;
  // Calls f(p, part) for every parameter p with elements in r; part is [begin, end) of them.
  void for_each_param_in(const ParamRange& r,
                         const std::function<void(const ParamInfo&, const ParamRange&)>& f) const;
  // Maximal runs of equal decay flag, for AdamW.
  std::vector<ParamSegment> decay_segments() const;
};

// Order: embedding; per layer: input norm, qkv (+bias), o_proj, post-attention norm,
// gate_up, down; final norm; output head (if untied). Each offset is rounded up to a
// multiple of 64 elements so every tensor starts 128-byte aligned for vector loads.
ParamLayout make_param_layout(const ModelSpec& spec);

}  // namespace tessera
