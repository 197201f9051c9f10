// DeviceMesh against Megatron-Core: every expected group below is what
// megatron/core/parallel_state.py's RankGenerator.get_ranks(token) returns for the same sizes
// (order "tp-cp-ep-dp-pp"; the dense generator with ep 1, the expert one with cp 1 and
// expert tp = tp), printed from Megatron's code and pasted here.
#include <gtest/gtest.h>

#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/device_mesh.h"

namespace tessera::dist {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(DeviceMeshTest, World8Tp2Pp2MatchesMegatron) {
  const DeviceMesh mesh(8, {.tp = 2, .pp = 2});
  EXPECT_EQ(mesh.size(MeshDim::DP), 2);
  EXPECT_EQ(mesh.description(), "dp 2 x tp 2 x pp 2");
  EXPECT_EQ(mesh.groups({MeshDim::TP}), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::DP}), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::PP}), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::CP}), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(mesh.groups({MeshDim::DP, MeshDim::CP}), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::PP}), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::DP, MeshDim::CP}),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  // Rank 6: tp 0, dp 1, pp 1.
  EXPECT_EQ(mesh.coordinate(6, MeshDim::TP), 0);
  EXPECT_EQ(mesh.coordinate(6, MeshDim::DP), 1);
  EXPECT_EQ(mesh.coordinate(6, MeshDim::PP), 1);
  EXPECT_EQ(mesh.group_ranks(6, MeshDim::PP), (std::vector<int>{2, 6}));
  EXPECT_EQ(mesh.model_parallel_ranks(6), (std::vector<int>{2, 3, 6, 7}));
  EXPECT_EQ(mesh.data_parallel_with_context_ranks(6), (std::vector<int>{4, 6}));
}

TEST(DeviceMeshTest, World16Tp2Cp2Pp2MatchesMegatron) {
  const DeviceMesh mesh(16, {.tp = 2, .pp = 2, .cp = 2});
  EXPECT_EQ(mesh.description(), "dp 2 x tp 2 x pp 2 x cp 2");
  EXPECT_EQ(mesh.groups({MeshDim::TP}),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::CP}),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::DP}),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::PP}),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::DP, MeshDim::CP}),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::PP}),
            (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::CP}),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::DP, MeshDim::CP}),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  // Megatron's rank formula, and a rank's place in each single-dimension group is its
  // coordinate.
  for (int r = 0; r < 16; ++r) {
    const int tp = mesh.coordinate(r, MeshDim::TP), cp = mesh.coordinate(r, MeshDim::CP);
    const int dp = mesh.coordinate(r, MeshDim::DP), pp = mesh.coordinate(r, MeshDim::PP);
    EXPECT_EQ(r, tp + 2 * (cp + 2 * (dp + 2 * pp))) << r;
    for (MeshDim d : {MeshDim::TP, MeshDim::CP, MeshDim::DP, MeshDim::PP})
      EXPECT_EQ(mesh.group_ranks(r, d)[mesh.coordinate(r, d)], r) << r << " " << mesh_dim_name(d);
  }
}

TEST(DeviceMeshTest, ExpertLayoutResplitsDataAndContextRanksLikeMegatron) {
  const DeviceMesh mesh(8, {.tp = 2, .ep = 4});
  EXPECT_EQ(mesh.description(), "dp 4 x tp 2, experts: ep 4 x expert dp 1");
  EXPECT_EQ(mesh.groups({MeshDim::DP}), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::EP}), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.groups({MeshDim::ExpertDP}), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(mesh.groups({MeshDim::TP, MeshDim::EP}), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));

  // ep 2 takes the place of cp, not of dp.
  const DeviceMesh cp_mesh(16, {.tp = 2, .pp = 2, .cp = 2, .ep = 2});
  EXPECT_EQ(cp_mesh.size(MeshDim::ExpertDP), 2);
  EXPECT_EQ(cp_mesh.groups({MeshDim::EP}),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(cp_mesh.groups({MeshDim::ExpertDP}),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(cp_mesh.groups({MeshDim::TP, MeshDim::EP}),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(cp_mesh.groups({MeshDim::TP, MeshDim::EP, MeshDim::PP}),
            (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // ep 4 spans dp x cp.
  const DeviceMesh wide(16, {.tp = 2, .pp = 2, .cp = 2, .ep = 4});
  EXPECT_EQ(wide.groups({MeshDim::EP}),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(wide.groups({MeshDim::TP, MeshDim::EP, MeshDim::PP}),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}}));
  // The pipeline groups are the same in both layouts (Megatron asserts it).
  EXPECT_EQ(wide.groups({MeshDim::PP}),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_THROW(wide.group_ranks(0, {MeshDim::EP, MeshDim::DP}), InternalError);
}

TEST(DeviceMeshTest, OneRankIsOneOfEverything) {
  const DeviceMesh mesh(1, {});
  EXPECT_EQ(mesh.description(), "dp 1");
  for (MeshDim d : {MeshDim::TP, MeshDim::CP, MeshDim::DP, MeshDim::PP, MeshDim::EP})
    EXPECT_EQ(mesh.group_ranks(0, d), std::vector<int>{0});
}

void expect_rejected(int world, MeshSizes sizes, const std::string& key, const std::string& value,
                     const std::string& says = "") {
  try {
    DeviceMesh mesh(world, sizes);
    ADD_FAILURE() << "accepted " << mesh.description() << " on " << world << " ranks";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), key) << e.what();
    EXPECT_EQ(e.value(), value) << e.what();
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(DeviceMeshTest, InvalidMeshesNameTheMegatronKey) {
  expect_rejected(8, {.tp = 0}, "tensor_model_parallel_size", "0");
  expect_rejected(8, {.pp = -1}, "pipeline_model_parallel_size", "-1");
  expect_rejected(8, {.cp = 0}, "context_parallel_size", "0");
  expect_rejected(8, {.ep = 0}, "expert_model_parallel_size", "0");
  expect_rejected(8, {.tp = 3}, "tensor_model_parallel_size", "3",
                  "tensor x pipeline x context parallel sizes (3 x 1 x 1) to divide the world "
                  "size 8");
  expect_rejected(8, {.tp = 2, .pp = 3}, "pipeline_model_parallel_size", "3");
  expect_rejected(8, {.tp = 4, .cp = 4}, "context_parallel_size", "4");
  expect_rejected(8, {.tp = 2, .ep = 3}, "expert_model_parallel_size", "3");
  // dp x cp = 2 ranks per tp/pp slice cannot hold 4 expert-parallel ranks.
  expect_rejected(8, {.tp = 2, .pp = 2, .ep = 4}, "expert_model_parallel_size", "4",
                  "a divisor of data x context parallel size 2 x 1");
}

}  // namespace
}  // namespace tessera::dist
