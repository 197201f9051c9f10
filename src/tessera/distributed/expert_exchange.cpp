#include "tessera/distributed/expert_exchange.h"

#include <vector>

#include "tessera/core/error.h"

namespace tessera::dist {

CommExpertExchange::CommExpertExchange(Backend& backend, Communicator& comm)
    : backend_(backend), comm_(comm) {}

// Row counts stay below 2^24, so fp32 (a dtype every communicator moves) carries them exactly.
void CommExpertExchange::exchange_counts(std::span<const int64_t> send, std::span<int64_t> recv,
                                         int64_t per_peer) {
  const int64_t n = per_peer * size();
  TS_CHECK(static_cast<int64_t>(send.size()) == n && static_cast<int64_t>(recv.size()) == n,
           "exchange_counts: {} and {} counts for {} ranks x {}", send.size(), recv.size(), size(),
           per_peer);
  if (n > counts_capacity_) {
    counts_ = DeviceBuffer(backend_, counts_bytes(n), "expert counts");
    counts_capacity_ = n;
  }
  const Tensor out = counts_.tensor(DType::F32, {n});
  const Tensor in = counts_.tensor(DType::F32, {n}, static_cast<size_t>(n) * sizeof(float));
  std::vector<float> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    TS_CHECK(send[i] >= 0 && send[i] < (int64_t{1} << 24), "exchange_counts: count {}", send[i]);
    host[i] = static_cast<float>(send[i]);
  }
  backend_.upload(in, host.data());
  comm_.all_to_all(out, in, Lane::Compute);
  backend_.download(host.data(), out);
  for (int64_t i = 0; i < n; ++i) recv[i] = static_cast<int64_t>(host[i]);
}

void CommExpertExchange::exchange_rows(const Tensor& out, std::span<const int64_t> recv_rows,
                                       std::span<const int64_t> recv_first, const Tensor& in,
                                       std::span<const int64_t> send_rows,
                                       std::span<const int64_t> send_first) {
  const int64_t cols = in.shape[in.shape.rank() - 1];
  TS_CHECK(out.shape[out.shape.rank() - 1] == cols, "exchange_rows: {} and {} columns",
           out.shape.str(), in.shape.str());
  std::vector<int64_t> rc, ro, sc, so;
  for (int j = 0; j < size(); ++j) {
    rc.push_back(recv_rows[j] * cols);
    ro.push_back(recv_first[j] * cols);
    sc.push_back(send_rows[j] * cols);
    so.push_back(send_first[j] * cols);
  }
  comm_.all_to_allv(out, rc, ro, in, sc, so, Lane::Compute);
}

}  // namespace tessera::dist
