#pragma once
// Applies a run's parallel layout to a single-device model (model code never knows ranks), in
// the fixed order TP/SP -> EP -> CP -> PP stages -> recompute -> ZeRO/FSDP, and returns what
// the trainer drives (Parallelism). Recompute is part of the model's runtime: it decides the
// activations the model plans when it is constructed, before parallelize runs.
//
// Implemented today: data parallelism over the mesh's dp dimension (plain, ZeRO-1 or FSDP:
// distributed/data_parallel.h), expert parallelism over its ep dimension (MoE layers send
// their rows to the ranks of their experts, model/expert_exchange.h; with plain DP or ZeRO-1),
// and a single device. The mesh's other dimensions are 1 until the layouts that use them
// exist; parallelize refuses a mesh it cannot lay out.
#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/device_mesh.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/model/model.h"

namespace tessera::dist {

// `world` spans the mesh's ranks (null for a mesh of one). The model must have been built
// with the runtime make_run_setup derives for the mesh (flat-buffer padding, sharded
// parameters for FSDP). Installs the model's unit observer where the layout needs one.
std::unique_ptr<Parallelism> parallelize(Model& model, const DeviceMesh& mesh, Communicator* world,
                                         const DataParallelOptions& data_parallel);

}  // namespace tessera::dist
