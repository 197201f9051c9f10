#pragma once
// Picks, by the mesh, what the trainer drives (Parallelism) for a model built for its rank's
// place in the mesh (its tensor-parallel part, its share of each sequence and its pipeline
// chunks come from its runtime; its parallel layers do their collectives, model/parallel_layers.h):
//   one device                              SingleDevice
//   data parallelism alone                  plain, ZeRO-1 or FSDP (distributed/data_parallel.h)
//   tensor, context, pipeline or expert     MeshParallelism, with plain DP, ZeRO-1 or (without
//   parallelism                             pipeline stages or experts) FSDP over the data
//                                           (x context) ranks, and the experts' exchange over
//                                           the data-parallel ranks of a tensor-parallel part
//                                           and pipeline stage (distributed/mesh_parallelism.h)
// Expert parallelism with context parallelism, and FSDP with expert or pipeline parallelism,
// are not laid out yet: validation refuses them naming the key, and parallelize checks.
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
