#pragma once
// A linear layer's input: a tensor, or the SwiGLU of a gate_up tensor. An FP8 linear with
// per-tensor scaling casts the latter straight from gate_up (Fp8CastArgs::swiglu), in its
// forward and again for its weight gradient, so that the SwiGLU's output is never written
// nor read back: 2 x N x F elements of traffic a pass that the cast would otherwise re-read
// (LayerOps::linear_reads_swiglu says which layers do). Every other path takes the tensor.
#include <cstdint>

#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct LinearInput {
  Tensor x;  // the input (N, in), or with swiglu the gate_up (N, 2 in) = [gate | up]
  bool swiglu = false;

  // Implicit: a tensor is an input as it is.
  LinearInput(const Tensor& t) : x(t) {}
  static LinearInput swiglu_of(const Tensor& gate_up) {
    LinearInput in(gate_up);
    in.swiglu = true;
    return in;
  }
  // The input's elements (N x in), whichever it is.
  int64_t numel() const { return swiglu ? x.numel() / 2 : x.numel(); }
  // The input itself, on a path that multiplies a materialized tensor.
  const Tensor& tensor() const {
    TS_CHECK(!swiglu, "a linear layer that cannot read a SwiGLU was given one ({})",
             x.shape.str());
    return x;
  }
};

}  // namespace tessera
