#include "tessera/distributed/device_mesh.h"

#include <algorithm>
#include <span>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"

namespace tessera::dist {
namespace {

// Each layout's dimensions, fastest-varying first.
constexpr MeshDim kDenseLayout[] = {MeshDim::TP, MeshDim::CP, MeshDim::DP, MeshDim::PP};
constexpr MeshDim kExpertLayout[] = {MeshDim::TP, MeshDim::EP, MeshDim::ExpertDP, MeshDim::PP};

bool is_expert_only(MeshDim d) {
  return d == MeshDim::EP || d == MeshDim::ExpertDP;
}
bool is_dense_only(MeshDim d) {
  return d == MeshDim::CP || d == MeshDim::DP;
}

bool contains(std::initializer_list<MeshDim> dims, MeshDim d) {
  return std::find(dims.begin(), dims.end(), d) != dims.end();
}

}  // namespace

const char* mesh_dim_name(MeshDim dim) {
  switch (dim) {
    case MeshDim::TP:
      return "tp";
    case MeshDim::CP:
      return "cp";
    case MeshDim::DP:
      return "dp";
    case MeshDim::PP:
      return "pp";
    case MeshDim::EP:
      return "ep";
    case MeshDim::ExpertDP:
      return "edp";
  }
  return "?";
}

DeviceMesh::DeviceMesh(int world_size, MeshSizes sizes) : world_size_(world_size), sizes_(sizes) {
  TS_CHECK(world_size >= 1, "device mesh of {} ranks", world_size);
  const std::string source = fmt::format("device mesh of {} ranks", world_size);
  const std::pair<const char*, int> keys[] = {{"tensor_model_parallel_size", sizes.tp},
                                              {"pipeline_model_parallel_size", sizes.pp},
                                              {"context_parallel_size", sizes.cp},
                                              {"expert_model_parallel_size", sizes.ep}};
  for (const auto& [key, value] : keys)
    if (value < 1) throw ConfigError(source, key, std::to_string(value), "a positive integer");
  // Blame the first factor whose product with those before it stops dividing the world.
  int model = 1;
  for (const auto& [key, value] : {keys[0], keys[1], keys[2]}) {
    model *= value;
    if (world_size % model != 0)
      throw ConfigError(source, key, std::to_string(value),
                        fmt::format("tensor x pipeline x context parallel sizes ({} x {} x {}) to "
                                    "divide the world size {}",
                                    sizes.tp, sizes.pp, sizes.cp, world_size));
  }
  dp_ = world_size / model;
  if ((dp_ * sizes.cp) % sizes.ep != 0)
    throw ConfigError(source, "expert_model_parallel_size", std::to_string(sizes.ep),
                      fmt::format("a divisor of data x context parallel size {} x {}: expert "
                                  "layers split those ranks into expert x expert-data parallel "
                                  "(Megatron: world size {} divisible by tensor {} x expert {} x "
                                  "pipeline {})",
                                  dp_, sizes.cp, world_size, sizes.tp, sizes.ep, sizes.pp));
  expert_dp_ = dp_ * sizes.cp / sizes.ep;
}

DeviceMesh::Axis DeviceMesh::axis(MeshDim dim) const {
  const int tp = sizes_.tp;
  switch (dim) {
    case MeshDim::TP:
      return {tp, 1};
    case MeshDim::CP:
      return {sizes_.cp, tp};
    case MeshDim::DP:
      return {dp_, tp * sizes_.cp};
    case MeshDim::EP:
      return {sizes_.ep, tp};
    case MeshDim::ExpertDP:
      return {expert_dp_, tp * sizes_.ep};
    case MeshDim::PP:
      return {sizes_.pp, world_size_ / sizes_.pp};
  }
  throw InternalError("unknown mesh dimension");
}

int DeviceMesh::size(MeshDim dim) const {
  return axis(dim).size;
}

int DeviceMesh::coordinate(int rank, MeshDim dim) const {
  TS_CHECK(rank >= 0 && rank < world_size_, "rank {} of a {}-rank mesh", rank, world_size_);
  const Axis a = axis(dim);
  return rank / a.stride % a.size;
}

std::vector<int> DeviceMesh::group_ranks(int rank, std::initializer_list<MeshDim> dims) const {
  const bool expert = std::any_of(dims.begin(), dims.end(), is_expert_only);
  TS_CHECK(!(expert && std::any_of(dims.begin(), dims.end(), is_dense_only)),
           "a mesh group mixes expert-only dimensions (ep, expert dp) with dense-only ones "
           "(cp, dp): the two layouts are not orthogonal");
  const std::span<const MeshDim> layout = expert ? kExpertLayout : kDenseLayout;
  std::vector<int> ranks;
  for (int r = 0; r < world_size_; ++r) {
    bool same = true;
    for (MeshDim d : layout)
      if (!contains(dims, d) && coordinate(r, d) != coordinate(rank, d)) same = false;
    if (same) ranks.push_back(r);
  }
  return ranks;
}

std::vector<std::vector<int>> DeviceMesh::groups(std::initializer_list<MeshDim> dims) const {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world_size_; ++r) {
    std::vector<int> g = group_ranks(r, dims);
    if (g.front() == r) out.push_back(std::move(g));
  }
  return out;
}

std::string DeviceMesh::description() const {
  std::string s = fmt::format("dp {}", dp_);
  for (MeshDim d : {MeshDim::TP, MeshDim::PP, MeshDim::CP})
    if (size(d) > 1) s += fmt::format(" x {} {}", mesh_dim_name(d), size(d));
  if (sizes_.ep > 1) s += fmt::format(", experts: ep {} x expert dp {}", sizes_.ep, expert_dp_);
  return s;
}

std::unique_ptr<Communicator> split_mesh_group(Communicator& world, const DeviceMesh& mesh,
                                               std::initializer_list<MeshDim> dims) {
  TS_CHECK(world.size() == mesh.world_size(), "a {}-rank communicator for a {}-rank mesh",
           world.size(), mesh.world_size());
  const std::vector<int> ranks = mesh.group_ranks(world.rank(), dims);
  std::string label;
  for (MeshDim d : dims) label += std::string(label.empty() ? "" : "-") + mesh_dim_name(d);
  // The smallest rank names the group uniquely; keys by rank keep group_ranks' order.
  return world.split(ranks.front(), world.rank(), label);
}

}  // namespace tessera::dist
