#pragma once
// The expert exchange (model/expert_exchange.h) over a communicator of the expert-parallel
// group: counts and rows move with variable-size all-to-alls on the compute lane, ordered with
// the layer's ops around them.
#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/model/expert_exchange.h"
#include "tessera/ops/backend.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::dist {

class CommExpertExchange final : public ExpertExchange {
 public:
  // `comm` spans the expert-parallel group (not owned; it outlives this).
  CommExpertExchange(Backend& backend, Communicator& comm);

  // Device bytes the exchange holds for `counts` per-expert counts per direction (the memory
  // planner counts them).
  static size_t counts_bytes(int64_t counts) {
    return static_cast<size_t>(2 * counts) * sizeof(float);
  }

  int size() const override { return comm_.size(); }
  int rank() const override { return comm_.rank(); }
  void exchange_counts(std::span<const int64_t> send, std::span<int64_t> recv,
                       int64_t per_peer) override;
  void exchange_rows(const Tensor& out, std::span<const int64_t> recv_rows,
                     std::span<const int64_t> recv_first, const Tensor& in,
                     std::span<const int64_t> send_rows,
                     std::span<const int64_t> send_first) override;

 private:
  Backend& backend_;
  Communicator& comm_;
  DeviceBuffer counts_;  // 2 x size x per_peer fp32: the counts travel as exact whole floats
  int64_t counts_capacity_ = 0;
};

}  // namespace tessera::dist
