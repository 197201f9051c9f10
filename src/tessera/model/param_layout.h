#pragma once
// Where every parameter lives in the one flat parameter buffer. A flat buffer makes the
// optimizer one fused pass, the gradient norm one reduction, data-parallel reduction a few
// large buckets and ZeRO shards contiguous ranges. The buffer is cut into units, each
// contiguous and read by one stage of the model (the embedding, each decoder layer, the final
// norm with the output head), so a unit can be gathered or freed as a whole (FSDP).
//
// The layout is built by the model family's blocks (model/block.h), each declaring its own
// parameters; nothing here knows which projections a layer has.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/backend.h"

namespace tessera {

struct ModelSpec;

// LowRankNormal: a LoRA A matrix (rank, in), normal with std 1 / rank (peft's gaussian
// init_lora_weights).
enum class ParamInit { Normal, ScaledNormal, Ones, Zeros, LowRankNormal };

// How tensor parallelism splits a parameter across the ranks of a group (Megatron's layer
// kinds): the family's blocks declare it with each parameter, parallelize applies it.
enum class TensorParallelStyle {
  Replicated,  // every rank holds all of it (norms)
  // Every rank holds all of it, and each computes the part of its gradient that its slice of
  // a split layer sees: the parts add up over the tensor-parallel ranks. LoRA's A of a
  // column-parallel weight (each rank's output rows) and B of a row-parallel one (each rank's
  // input columns).
  ReplicatedPartialGrads,
  Column,      // output rows split: each rank computes a slice of the outputs
  Row,         // input columns split: each rank computes partial sums of every output
  Vocab,       // embedding/output-head rows split by vocabulary range
  // An MoE layer's stack of experts' weights (E, rows, cols): split by whole experts (the first
  // dimension) over the expert-parallel ranks instead, each holding the experts it runs.
  Expert,
};

// Which part of the whole parameter (as one device holds it) a rank holds: part `index` of
// `parts` equal parts along the dimension its TensorParallelStyle splits (Megatron's layout):
// rows for Column and Vocab, each fused piece split alike, so that part r holds rows r of
// q, k and v (or gate and up) one after another; columns for Row; experts for Expert (part r
// holds experts [r x E / parts, (r + 1) x E / parts)). Every parameter is whole (parts 1)
// without tensor or expert parallelism, and Replicated ones always are.
struct ParamPlacement {
  int parts = 1, index = 0;
};

struct ParamInfo {
  std::string name;  // e.g. "model.layers.3.self_attn.qkv_proj.weight"
  Shape shape;       // of this rank's part
  int64_t offset = 0;  // elements from the start of the flat buffer
  int layer = -1;      // -1 for embedding, final norm and output head
  int unit = 0;        // the ParamLayout::units entry holding it
  bool decay = true;   // weight matrices decay; norms and biases do not
  ParamInit init = ParamInit::Normal;
  TensorParallelStyle tp = TensorParallelStyle::Replicated;
  // A fused projection's pieces, as rows stacked along the first dimension in order (q, k, v;
  // gate, up), in this rank's part: column parallelism splits each piece, and Hugging Face
  // stores them apart. Empty for a parameter that is one piece.
  std::vector<int64_t> fused_rows;
  ParamPlacement placement;
  Shape full_shape;         // of the whole parameter (= shape when whole)
  int64_t full_offset = 0;  // in the one-device layout: what keys its initialisation
  int64_t numel() const { return shape.numel(); }
  bool whole() const { return placement.parts == 1; }
  // The whole parameter's fused pieces (fused_rows of the whole).
  std::vector<int64_t> full_fused_rows() const;
  // Calls f(begin, count, full_begin) for the runs of this part's elements [begin, begin +
  // count) (offsets within the parameter, row-major) that are consecutive in the whole
  // parameter too, from its element full_begin; together they cover [lo, hi).
  void for_each_run(
      int64_t lo, int64_t hi,
      const std::function<void(int64_t begin, int64_t count, int64_t full_begin)>& f) const;
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

// What an optimizer updates of the flat layout: a range, with where this rank keeps its
// compute-dtype parameters and fp32 gradients (range.count() elements each). Data
// parallelism that shards the optimizer hands these out.
struct OwnedParams {
  ParamRange range;
  Tensor params, grads;
};

struct ParamLayout {
  std::vector<ParamInfo> params;
  // Ranges of the flat buffer holding only expert stacks (and alignment padding) when the
  // layout splits them over expert-parallel ranks (ParamSplit::expert_run_multiple), in
  // increasing order; empty otherwise.
  std::vector<ParamRange> expert_runs;
  // -1 where a pipeline stage does not hold them; lm_head == embedding when tied.
  int embedding = -1, final_norm = -1, lm_head = -1;
  int64_t total = 0;
  // Consecutive ranges covering [0, total): 0 the embedding, 1 + l decoder layer l, and last
  // the final norm with the output head (with tied embeddings the head is unit 0's table). A
  // pipeline stage's layout has the units of the parts it holds, in that order.
  std::vector<ParamRange> units;
  int tail_unit() const { return static_cast<int>(units.size()) - 1; }

  const ParamInfo* find(const std::string& name) const;
  // Calls f(p, part) for every parameter p with elements in r; part is [begin, end) of them.
  void for_each_param_in(const ParamRange& r,
                         const std::function<void(const ParamInfo&, const ParamRange&)>& f) const;
  // Maximal runs of equal decay flag, for AdamW.
  std::vector<ParamSegment> decay_segments() const;
};

// What of the model one rank's layout holds.
struct ParamSplit {
  // The part of every tensor-parallel (Column, Row, Vocab) parameter. Blocks declare the
  // shapes of that part (they are built from the tensor-parallel share of the model's sizes,
  // tensor_parallel_shard in model_spec.h); the builder derives the whole shapes.
  ParamPlacement tensor_parallel;
  // The part of every expert stack. Blocks declare the whole stack (the router needs every
  // expert); the builder keeps this part's experts.
  ParamPlacement expert_parallel;
  // With expert parallelism the expert stacks' gradients are reduced over other ranks than
  // the rest (the expert-data-parallel ones): each run of consecutive expert stacks starts and
  // ends at a multiple of this many elements, so both kinds of runs split evenly into shards.
  int64_t expert_run_multiple = 1;
};

// Appends parameters to a layout unit by unit. Each offset is rounded up to a multiple of 64
// elements so every tensor starts 128-byte aligned for vector loads.
class ParamLayoutBuilder {
 public:
  explicit ParamLayoutBuilder(ParamLayout& layout, ParamSplit split = {})
      : l_(layout), split_(split) {}
  // Starts the next unit; parameters added to it are named prefix + name and belong to
  // `layer` (-1: none).
  void begin_unit(std::string prefix, int layer);
  int add(std::string_view name, Shape shape, ParamInit init, bool decay,
          TensorParallelStyle tp = TensorParallelStyle::Replicated,
          std::vector<int64_t> fused_rows = {});

 private:
  ParamLayout& l_;
  ParamSplit split_;
  bool last_was_expert_ = false;
  std::string prefix_;
  int layer_ = -1;
};

// The layout of `spec`'s model (model/decoder_layer.h: decoder_param_layout).
ParamLayout make_param_layout(const ModelSpec& spec);

// Sets every parameter's full_offset to its offset in `whole`, the one-device layout of the
// same model, found by name.
void set_full_offsets(ParamLayout& layout, const ParamLayout& whole);

}  // namespace tessera
