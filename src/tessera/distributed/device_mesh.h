#pragma once
// Which ranks work together in each kind of parallelism, in Megatron-Core's rank order
// (parallel_state.py's RankGenerator, order "tp-cp-ep-dp-pp"): tensor-parallel ranks are
// neighbours (rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp))), so the busiest
// traffic (TP's per-layer all-reduces, then CP's ring) stays inside a node, and pipeline
// stages, which exchange only activations, are the farthest apart. Following Megatron's
// order rather than inventing one lets a Megatron launch script, its checkpoints' shard
// names and its profiles be read against ours rank for rank.
//
// Dense layers see the grid tp x cp x dp x pp. Expert (MoE) layers re-split the dp x cp ranks
// of each tp/pp slice into ep x expert-dp (Megatron's second RankGenerator, with cp 1):
// rank = tp + tp_size * (ep + ep_size * (edp + edp_size * pp)). Expert tensor parallelism is
// Megatron's default, the same as tp (expert_tensor_parallel_size is not modelled).
//
// Groups over several dimensions are Megatron's combined tokens:
//   {DP, CP}      data parallel with context parallel (the gradient reduction under CP)
//   {TP, PP}      model parallel
//   {TP, CP}      tensor and context parallel
//   {TP, DP, CP}  tensor and data parallel with context parallel (FP8 amax reduction)
//   {TP, EP}      expert tensor and model parallel (the MoE token all-to-all with TP)
// A group never mixes dense-only dimensions (CP, DP) with expert-only ones (EP, ExpertDP).
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace tessera::dist {

class Communicator;

enum class MeshDim { TP, CP, DP, PP, EP, ExpertDP };

// "tp", "cp", "dp", "pp", "ep", "edp" (expert data parallel).
const char* mesh_dim_name(MeshDim dim);

// Megatron's sizes; dp (and the expert-dp size) follow from the world size.
struct MeshSizes {
  int tp = 1;  // tensor_model_parallel_size
  int pp = 1;  // pipeline_model_parallel_size
  int cp = 1;  // context_parallel_size
  int ep = 1;  // expert_model_parallel_size
};

class DeviceMesh {
 public:
  // Throws ConfigError naming the Megatron key when a size is below 1, when tp x pp x cp
  // does not divide world_size, or when ep does not divide dp x cp (Megatron's rule:
  // world_size divisible by expert tp x ep x pp).
  DeviceMesh(int world_size, MeshSizes sizes);

  int world_size() const { return world_size_; }
  int size(MeshDim dim) const;
  // rank's index along dim, in [0, size(dim)).
  int coordinate(int rank, MeshDim dim) const;

  // The ranks that share every coordinate with `rank` except those along `dims`, ascending.
  // A rank's position in the list is its rank in the group's communicator (for one
  // dimension, its coordinate).
  std::vector<int> group_ranks(int rank, std::initializer_list<MeshDim> dims) const;
  std::vector<int> group_ranks(int rank, MeshDim dim) const { return group_ranks(rank, {dim}); }
  std::vector<int> data_parallel_with_context_ranks(int rank) const {
    return group_ranks(rank, {MeshDim::DP, MeshDim::CP});
  }
  std::vector<int> model_parallel_ranks(int rank) const {
    return group_ranks(rank, {MeshDim::TP, MeshDim::PP});
  }
  // Every group over `dims`, by smallest rank: Megatron's RankGenerator.get_ranks(token).
  std::vector<std::vector<int>> groups(std::initializer_list<MeshDim> dims) const;

  // "dp 2 x tp 2 x pp 2" (dimensions of size 1 other than dp left out), with
  // ", experts: ep 4 x expert dp 1" when ep > 1.
  std::string description() const;

 private:
  struct Axis {
    int size, stride;
  };
  Axis axis(MeshDim dim) const;

  int world_size_;
  MeshSizes sizes_;
  int dp_, expert_dp_;
};

// The communicator of `rank`'s group over `dims` (ranks in group_ranks order), split from
// `world`, whose ranks are the mesh's. Collective over `world`, like Communicator::split.
std::unique_ptr<Communicator> split_mesh_group(Communicator& world, const DeviceMesh& mesh,
                                               std::initializer_list<MeshDim> dims);

}  // namespace tessera::dist
