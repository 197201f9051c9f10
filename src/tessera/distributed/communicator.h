#pragma once
// Collectives between the ranks of a job over device tensors, independent of the vendor
// library (NCCL here; RCCL would be another implementation). Every collective is queued on
// a device stream and returns at once, like the backend's ops:
//   Lane::Compute  the backend's own stream, ordered with the ops before and after it;
//   Lane::Comm     a separate stream that first waits for the compute work queued so far,
//                  so the collective overlaps with compute queued later; wait_comm() makes
//                  compute wait for every collective queued on Lane::Comm, wait_comm_mark()
//                  for those before a mark.
// Collectives run in the order they are issued on every rank: one on Lane::Compute first
// waits for any still queued on Lane::Comm (one communicator runs one collective at a time).
// Sum reductions of fp32/bf16 data; counts are elements. A failed or timed-out collective
// never returns an error to the caller: the communicator's watchdog aborts it and ends the
// process with a message naming the collective, its bytes and, where known, the late rank.
//
// split() makes communicators over sub-groups of the ranks (tensor, pipeline, ... parallel
// groups; see device_mesh.h); each has its own Lane::Comm stream and watchdog, and ranks and
// peers in its calls are ranks within it. Point-to-point transfers (send_recv) follow the same
// lanes and ordering as the collectives.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/backend.h"

namespace tessera::dist {

enum class Lane { Compute, Comm };
enum class ReduceOp { Sum, Max };

// One send or receive of a whole tensor to or from `peer` (a rank of the communicator).
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind;
  Tensor tensor;
  int peer;
};

// Device memory that a communicator's collectives read and write (collective_buffer()).
class CollectiveBuffer {
 public:
  CollectiveBuffer() = default;
  CollectiveBuffer(void* data, size_t bytes, Device device, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), device_(device), release_(std::move(release)) {}
  ~CollectiveBuffer() { reset(); }
  CollectiveBuffer(const CollectiveBuffer&) = delete;
  CollectiveBuffer& operator=(const CollectiveBuffer&) = delete;
  CollectiveBuffer(CollectiveBuffer&& o) noexcept { *this = std::move(o); }
  CollectiveBuffer& operator=(CollectiveBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(data_, o.data_);
      std::swap(bytes_, o.bytes_);
      std::swap(device_, o.device_);
      std::swap(release_, o.release_);
    }
    return *this;
  }
  void reset() {
    if (data_) release_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  // A tensor over the buffer starting at byte_offset.
  Tensor tensor(DType dtype, Shape shape, size_t byte_offset = 0) const {
    TS_CHECK(byte_offset + static_cast<size_t>(shape.numel()) * dtype_size(dtype) <= bytes_,
             "tensor {} at offset {} exceeds a collective buffer of {} bytes", shape.str(),
             byte_offset, bytes_);
    return Tensor{static_cast<char*>(data_) + byte_offset, dtype, shape, device_};
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_{};
  std::function<void(void*)> release_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "NCCL 2.28.3, 2 ranks, non-blocking, timeout 600 s" for logs.
  virtual std::string description() const = 0;

  // In place: every rank's `buffer` becomes the elementwise reduction over ranks.
  virtual void all_reduce(const Tensor& buffer, ReduceOp op, Lane lane) = 0;
  // in: size() * n elements; out: n elements, this rank's reduced slice [rank*n, (rank+1)*n).
  // out may be that slice of `in` (in place).
  virtual void reduce_scatter(const Tensor& out, const Tensor& in, Lane lane) = 0;
  // in: n elements; out: size() * n elements, rank r's input at [r*n, (r+1)*n). in may be
  // this rank's slice of `out` (in place).
  virtual void all_gather(const Tensor& out, const Tensor& in, Lane lane) = 0;
  // In place: every rank's `buffer` becomes root's.
  virtual void broadcast(const Tensor& buffer, int root, Lane lane) = 0;
  // in and out: size() * n elements; out block r = rank r's in block rank() (grouped
  // sends and receives). out must not alias in.
  virtual void all_to_all(const Tensor& out, const Tensor& in, Lane lane) = 0;

  // Issues `ops` together (ncclGroupStart..End, torch's batch_isend_irecv) and completes
  // when all of them have. The k-th send from a to b pairs with the k-th receive on b from a,
  // of the same dtype and size. A send may wait until its peer posts the receive (NCCL's
  // rendezvous), so ranks that send to each other (a pipeline stage sending to the next while
  // receiving from the previous one, a ring) must post both directions in one call.
  virtual void send_recv(std::span<const P2POp> ops, Lane lane) = 0;
  void send(const Tensor& tensor, int peer, Lane lane) {
    const P2POp op{P2POp::Kind::Send, tensor, peer};
    send_recv({&op, 1}, lane);
  }
  void recv(const Tensor& tensor, int peer, Lane lane) {
    const P2POp op{P2POp::Kind::Recv, tensor, peer};
    send_recv({&op, 1}, lane);
  }

  // Variable-size all-to-all (MoE token dispatch): elements [send_offsets[j], + send_counts[j])
  // of `in` go to rank j, which receives them at [recv_offsets[r], + recv_counts[r]) of its
  // `out` (r: this rank). Host spans of size() entries; rank j's recv_counts[r] must equal rank
  // r's send_counts[j]. One send_recv call (ncclSend/ncclRecv in one group under NCCL), empty
  // transfers left out; out must not alias in.
  void all_to_allv(const Tensor& out, std::span<const int64_t> recv_counts,
                   std::span<const int64_t> recv_offsets, const Tensor& in,
                   std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                   Lane lane) {
    const auto n = static_cast<size_t>(size());
    TS_CHECK(recv_counts.size() == n && recv_offsets.size() == n && send_counts.size() == n &&
                 send_offsets.size() == n,
             "all_to_allv: counts and offsets for {} ranks", n);
    std::vector<P2POp> ops;
    for (int j = 0; j < size(); ++j)
      if (send_counts[j] > 0)
        ops.push_back({P2POp::Kind::Send, in.flat_range(send_offsets[j], send_counts[j]), j});
    for (int j = 0; j < size(); ++j)
      if (recv_counts[j] > 0)
        ops.push_back({P2POp::Kind::Recv, out.flat_range(recv_offsets[j], recv_counts[j]), j});
    if (!ops.empty()) send_recv(ops, lane);
  }

  // Collective over every rank: the ranks passing the same color >= 0 form a new
  // communicator, ranked by key (ties by rank here); a negative color joins none and gets
  // nullptr (ncclCommSplit). `label` names the group in descriptions and errors ("tp").
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& label) = 0;

  // Device memory on `backend` for this communicator's collectives, made collectively: every
  // rank asks for the same bytes, in the same order. A collective whose input and output both
  // lie in such buffers, at the same offsets on every rank, may move its data without the
  // GPU's cores: NCCL all-gathers between symmetric windows on one node with the copy engines,
  // so that the compute they overlap keeps every SM. Anywhere else (thread ranks, another
  // node, no symmetric memory) it is ordinary memory from the backend.
  virtual CollectiveBuffer collective_buffer(Backend& backend, size_t bytes, const char* what) {
    void* data = bytes ? backend.allocate(bytes, what) : nullptr;
    return {data, bytes, backend.device(), [&backend](void* p) { backend.release(p); }};
  }

  // Compute waits for everything queued on Lane::Comm so far.
  virtual void wait_comm() = 0;
  // A point in Lane::Comm's queue: wait_comm_mark(m) makes compute wait for the collectives
  // queued on Lane::Comm before comm_mark() returned m, not for later ones. A mark is valid
  // until the next wait_comm().
  virtual int comm_mark() = 0;
  virtual void wait_comm_mark(int mark) = 0;
  // Waits on the host for all queued collectives (barrier-like when every rank calls it).
  virtual void synchronize() = 0;
  // Ends the communicator collectively (all ranks call it); after this the watchdog is off.
  virtual void finalize() = 0;
};

}  // namespace tessera::dist
