#pragma once
// Applies a run's parallel layout to a single-device model (model code never knows ranks), in
// the fixed order TP/SP -> EP -> CP -> PP stages -> recompute -> ZeRO/FSDP, and returns what
// the trainer drives (Parallelism). Recompute is part of the model's runtime: it decides the
// activations the model plans when it is constructed, before parallelize runs.
//
// Implemented today: tensor (and sequence) parallelism and pipeline stages composed with data
// parallelism (plain or ZeRO-1; distributed/mesh_parallelism.h), expert parallelism over the
// mesh's ep dimension (each rank holds its experts' weights, MoE layers send their rows to
// the ranks of their experts, model/expert_exchange.h; plain DP or ZeRO-1 over every rank, the
// experts' over the expert-data-parallel ranks), data parallelism alone
// (plain, ZeRO-1 or FSDP: distributed/data_parallel.h), and a single device. Expert
// parallelism together with tensor or pipeline parallelism, and context parallelism, are not
// laid out yet; parallelize refuses a mesh it cannot lay out.
#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/device_mesh.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/model/model.h"

namespace tessera::dist {

// `world` spans the mesh's ranks (null for a mesh of one). The model must have been built
// with the runtime make_run_setup derives for this rank of the mesh (its tensor-parallel part,
// flat-buffer padding, sharded parameters for FSDP). Installs the model's unit observer and
// tensor-parallel group where the layout needs them.
std::unique_ptr<Parallelism> parallelize(Model& model, const DeviceMesh& mesh, Communicator* world,
                                         const DataParallelOptions& data_parallel);

}  // namespace tessera::dist
