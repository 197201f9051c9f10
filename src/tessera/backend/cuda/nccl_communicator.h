#pragma once
// The NCCL communicator behind CudaPlatform::make_communicator (nccl_communicator.cpp,
// compiled only when NCCL is found). Plain C++.
#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/distributed/rendezvous.h"

namespace tessera {
class Backend;
class Logger;
}  // namespace tessera

namespace tessera::cuda {

std::unique_ptr<dist::Communicator> make_nccl_communicator(Backend& backend,
                                                           dist::Rendezvous& rendezvous,
                                                           double timeout_s, Logger& log);

}  // namespace tessera::cuda
