#include "tessera/dist/communicator.h"

#include "tessera/core/error.h"

namespace tessera::dist {

// Builds with NCCL define make_communicator in nccl_communicator.cpp.
#ifndef TESSERA_WITH_NCCL
std::unique_ptr<Communicator> make_communicator(Backend&, Rendezvous&, double, Logger&) {
  throw ConfigError("environment", "WORLD_SIZE", "more than 1",
                    "1: this build of Tessera has no NCCL (CUDA toolkit with nccl.h and libnccl "
                    "at configure time), so it cannot train on several processes");
}
#endif

}  // namespace tessera::dist
