#pragma once
// Argument checks whose failure messages start "<backend> <op>: ", so that a wrong call fails
// with the same rule and words on every backend. The op facade (ops/backend.cpp) runs the
// placement, shape and dtype checks; backends use the same helpers for what only they know. A
// failure is a bug in the caller (InternalError through TS_CHECK), never bad user input.
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>

#include "tessera/core/error.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/backend.h"

namespace tessera {

// A tensor seen as a matrix: the last dimension is the columns, all leading ones the rows.
struct MatrixDims {
  int64_t rows = 1, cols = 1;
  int64_t elements() const { return rows * cols; }
};
MatrixDims matrix_dims(const Tensor& t);

class OpChecks {
 public:
  OpChecks(std::string_view backend, DeviceKind kind, const char* op)
      : backend_(backend), kind_(kind), op_(op) {}
  OpChecks(const Backend& b, const char* op) : OpChecks(b.name(), b.device().kind, op) {
    backend_object_ = &b;
  }
  // The backend it checks for (the facade's checks only).
  const Backend& backend() const {
    TS_CHECK(backend_object_ != nullptr, "{} {}: checks made without their backend", backend_, op_);
    return *backend_object_;
  }

  // t is defined (or empty: empty tensors may have no memory at all) and on the backend's
  // device.
  void placed(const Tensor& t, const char* what) const;
  // placed, with n elements.
  void count(const Tensor& t, int64_t n, const char* what) const;
  // placed, with dtype d.
  void dtype(const Tensor& t, DType d, const char* what) const;
  // Non-empty, heads a multiple of kv_heads, a non-negative window, a positive scale.
  void attention_shape(const AttentionShape& s) const;
  // qkv holds s's tokens x qkv width, head_dim is even, freqs is (>= T, head_dim).
  void rope(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) const;
  // An op's dtype signature (ops/op_table.inc) on a backend computing in `compute`; undefined
  // tensors are not checked.
  void dtypes(std::initializer_list<TensorDtype> rules, std::span<const DType> compute) const;

  template <class... Args>
  void that(bool ok, std::string_view f, const Args&... args) const {
    if (!ok) [[unlikely]]
      fail(format_message(f, args...));
  }
  [[noreturn]] void fail(const std::string& message) const;

 private:
  std::string_view backend_;
  DeviceKind kind_;
  const char* op_;
  const Backend* backend_object_ = nullptr;
};

}  // namespace tessera
