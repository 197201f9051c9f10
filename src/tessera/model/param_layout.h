#pragma once
// Where every parameter lives in the one flat parameter buffer. A flat buffer makes the
// optimizer one fused pass, the gradient norm one reduction, data-parallel reduction a few
// large buckets and ZeRO shards contiguous ranges. Each layer's tensors are contiguous so a
// layer can be gathered or freed as a unit.
#include <cstdint>
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

  const ParamInfo* find(const std::string& name) const;
  // Maximal runs of equal decay flag, for AdamW.
  std::vector<ParamSegment> decay_segments() const;
};

// Order: embedding; per layer: input norm, qkv (+bias), o_proj, post-attention norm,
// gate_up, down; final norm; output head (if untied). Each offset is rounded up to a
// multiple of 64 elements so every tensor starts 128-byte aligned for vector loads.
ParamLayout make_param_layout(const ModelSpec& spec);

}  // namespace tessera
