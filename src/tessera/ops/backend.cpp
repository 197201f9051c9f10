// The op facade: for every line of the op table (ops/op_table.inc), the op's checks (support,
// placement and shapes, its dtype signature), observer and timing once for every backend, then
// the backend's do_<op> (ops/backend.h).
#include "tessera/ops/backend.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/core/fp8.h"
#include "tessera/ops/op_checks.h"
#include "tessera/ops/op_defs.h"
#include "tessera/ops/op_observer.h"

namespace tessera {

// Brackets one op: a timing event pair while op timing is on, and op_begin(name, make_args())
// / op_end() to the observer when one is set. Without either it costs two tests: make_args is
// never called.
template <class MakeArgs>
class OpScope {
 public:
  OpScope(Backend& b, const char* name, MakeArgs&& make_args) : b_(b), name_(name) {
    if (b_.timing_) [[unlikely]] {
      start_ = b_.take_event();
      b_.record_event(start_);
    }
    if (b_.op_observer_ != nullptr) [[unlikely]]
      b_.op_observer_->op_begin(name, make_args());
  }
  ~OpScope() {
    if (b_.op_observer_ != nullptr) [[unlikely]]
      b_.op_observer_->op_end();
    if (start_.defined()) [[unlikely]] {
      const EventHandle end = b_.take_event();
      b_.record_event(end);
      b_.timed_.push_back({name_, start_, end});
    }
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  Backend& b_;
  const char* name_;
  EventHandle start_;
};

template <class MakeArgs>
OpScope(Backend&, const char*, MakeArgs&&) -> OpScope<MakeArgs>;

// ---- timing ----

EventHandle Backend::take_event() {
  if (spare_events_.empty()) return create_event();
  const EventHandle e = spare_events_.back();
  spare_events_.pop_back();
  return e;
}

void Backend::fold_timed_ops() {
  for (const TimedOp& t : timed_) {
    const double ms = elapsed_ms(t.start, t.end);
    auto it = std::find_if(op_totals_ms_.begin(), op_totals_ms_.end(),
                           [&](const auto& total) { return total.first == t.name; });
    if (it == op_totals_ms_.end()) {
      op_totals_ms_.emplace_back(t.name, ms);
    } else {
      it->second += ms;
    }
    spare_events_.push_back(t.start);
    spare_events_.push_back(t.end);
  }
  timed_.clear();
}

void Backend::enable_op_timing(bool on) {
  if (on && !timing_) {  // a fresh measurement: drop totals and pairs from earlier ones
    for (const TimedOp& t : timed_) {
      spare_events_.push_back(t.start);
      spare_events_.push_back(t.end);
    }
    timed_.clear();
    op_totals_ms_.clear();
  }
  timing_ = on;
}

std::vector<std::pair<std::string, double>> Backend::op_times_ms() {
  synchronize();
  fold_timed_ops();
  auto totals = op_totals_ms_;
  std::sort(totals.begin(), totals.end());
  return totals;
}

std::unique_ptr<CapturedWork> Backend::capture(const std::function<void()>& work) {
  if (op_observer_ || timing_ || !supports(Capability::CapturesWork)) return nullptr;
  return do_capture(work);
}

// ---- memory and ranges ----

void* Backend::allocate_host(size_t bytes, const char* what) {
  void* ptr = std::malloc(std::max<size_t>(bytes, 1));
  if (ptr == nullptr)
    throw OutOfMemoryError(fmt::format("out of host memory allocating {}: {} bytes", what ? what : "a buffer", bytes));
  return ptr;
}

void Backend::release_host(void* ptr) {
  std::free(ptr);
}

void Backend::upload(const Tensor& dst, const void* host_src) {
  const OpScope scope(*this, "upload", [&] { return op_args::transfer(dst); });
  OpChecks(*this, "upload").placed(dst, "dst");
  do_upload(dst, host_src);
}

void Backend::download(void* host_dst, const Tensor& src) {
  const OpScope scope(*this, "download", [&] { return op_args::transfer(src); });
  OpChecks(*this, "download").placed(src, "src");
  do_download(host_dst, src);
}

void Backend::copy(const Tensor& dst, const Tensor& src) {
  const OpScope scope(*this, "copy", [&] { return op_args::transfer(src); });
  const OpChecks check(*this, "copy");
  check.placed(dst, "dst");
  check.placed(src, "src");
  check.that(dst.dtype == src.dtype && dst.numel() == src.numel(), "dst {} {} and src {} {} differ",
             dtype_name(dst.dtype), dst.shape.str(), dtype_name(src.dtype), src.shape.str());
  if (dst.data == src.data || dst.nbytes() == 0) return;
  do_copy(dst, src);
}

void Backend::range_push(const char* name) {
  do_range_push(name);
  if (op_observer_ != nullptr) op_observer_->range_begin(name);
}

void Backend::range_pop() {
  if (op_observer_ != nullptr) op_observer_->range_end();
  do_range_pop();
}

std::span<const int32_t> Backend::host_group_offsets(const Tensor& offsets,
                                                     std::span<const int32_t> host,
                                                     std::vector<int32_t>& storage) {
  if (!host.empty()) return host;
  storage.resize(static_cast<size_t>(offsets.numel()));
  do_download(storage.data(), offsets);
  return storage;
}

std::span<const DType> Backend::compute_dtypes() const {
  static constexpr DType kWithBf16[] = {DType::F32, DType::BF16}, kF32[] = {DType::F32};
  if (supports(Capability::Bf16Compute)) return kWithBf16;
  return kF32;
}

namespace {

// An op's arguments for the observer, with its cost.
OpArgs with_cost(OpArgs args, const OpCost& cost) {
  return args.add_double("op_flops", cost.flops).add_double("op_bytes", cost.bytes);
}

}  // namespace

// ---- the ops of the table ----

#define TS_OP(name, params, args, signature)                                         \
  void Backend::name params {                                                     \
    const OpScope scope(*this, #name, [&] {                                       \
      return with_cost(op_defs::describe_##name args, op_defs::cost_##name args); \
    });                                                                           \
    const OpChecks check(*this, #name);                                           \
    if (!supports_op(OpId::name)) check.fail("not implemented by this backend");  \
    op_defs::check_##name(check, TS_UNPAREN args);                                \
    check.dtypes({TS_UNPAREN signature}, compute_dtypes());                        \
    do_##name args;                                                               \
  }
#include "tessera/ops/op_table.inc"

namespace {

// `out` itself, or a host tensor of `dtype` and `shape` on `storage`.
Tensor host_output(const Tensor& out, DType dtype, Shape shape, std::vector<std::byte>& storage) {
  if (out.defined()) return out;
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  storage.resize(t.nbytes());
  t.data = storage.data();
  return t;
}

}  // namespace

void Backend::host_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up,
                                       const Fp8CastArgs& codes) {
  std::vector<std::byte> storage;
  const MatrixDims d = matrix_dims(gate_up);
  const Tensor h = host_output(out, gate_up.dtype, {d.rows, d.cols / 2}, storage);
  do_swiglu_forward(h, gate_up);
  cast_output(h, codes);
}

void Backend::host_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                        const Tensor& weight, float eps, const Fp8CastArgs& codes) {
  std::vector<std::byte> storage;
  const Tensor y = host_output(out, x.dtype, x.shape, storage);
  do_rmsnorm_forward(y, rstd, x, weight, eps);
  cast_output(y, codes);
}

void Backend::host_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x,
                                            const Tensor& weight, float eps) {
  std::vector<std::byte> out_storage, rstd_storage;
  const Tensor y = host_output({}, x.dtype, x.shape, out_storage);
  do_rmsnorm_forward(y, host_output({}, DType::F32, {x.dim(0)}, rstd_storage), x, weight, eps);
  cast_output(y, codes);
}

}  // namespace tessera
