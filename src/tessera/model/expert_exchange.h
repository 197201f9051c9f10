#pragma once
// How an MoE layer's permuted rows reach the ranks that run their experts and come back
// (expert parallelism). Model code stays rank-free: distributed/parallelize.h installs an
// exchange over the expert-parallel group (Model::set_expert_exchange); without one every
// expert runs where its tokens are.
//
// Experts are split evenly and in order: expert-parallel rank r runs experts
// [r E / size, (r + 1) E / size). Every rank keeps the weights of all experts (and, being data
// parallel over all ranks, the same values of them after each step): a rank's gradient of an
// expert it does not run is zero, so the data-parallel sum of gradients is the expert's
// gradient over every token routed to it.
#include <cstdint>
#include <span>

#include "tessera/core/tensor.h"

namespace tessera {

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // The expert-parallel group: its size and this rank's place in it.
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // An all-to-all of host counts: send holds size() blocks of per_peer values, block j for
  // rank j; recv receives block i from rank i.
  virtual void exchange_counts(std::span<const int64_t> send, std::span<int64_t> recv,
                               int64_t per_peer) = 0;
  // Rows of in (rows, cols) [send_first[j], + send_rows[j]) go to rank j, which receives
  // them at out rows [recv_first[i], + recv_rows[i]) for this rank i. Host spans of size().
  virtual void exchange_rows(const Tensor& out, std::span<const int64_t> recv_rows,
                             std::span<const int64_t> recv_first, const Tensor& in,
                             std::span<const int64_t> send_rows,
                             std::span<const int64_t> send_first) = 0;
};

}  // namespace tessera
