#pragma once
// An operand an FP8 linear layer casts before its GEMMs (its input in the forward, its output
// gradient in the backward), and whether those FP8 codes are already written. Where the
// operand's producer writes the codes on the way (the *_forward_cast ops into
// LayerOps::linear_input_cast's target, swiglu_backward_cast into linear_output_grad_cast's),
// the linear's cast and its re-read of the operand go. The tensor itself stays where others
// read it (LoRA's adapters read the input), but for an input whose transposed codes the
// producer wrote for the weight gradient instead (LayerOps::linear_keeps_input_codes).
#include "tessera/core/tensor.h"

namespace tessera {

struct LinearOperand {
  Tensor x;
  // x's codes are in the layer's cast target (input_cast / output_grad_cast), with its scale
  // and amax.
  bool cast = false;
  // An input of the backward: its codes transposed, (in, rows), written by its producer in the
  // forward with the forward cast's scale and kept, in place of x (undefined).
  Tensor codes_t;

  // Implicit: a tensor is an operand as it is.
  LinearOperand(const Tensor& t) : x(t) {}
  static LinearOperand with_codes(const Tensor& t) {
    LinearOperand in(t);
    in.cast = true;
    return in;
  }
  static LinearOperand transposed_codes(const Tensor& codes_t) {
    LinearOperand in{Tensor{}};
    in.codes_t = codes_t;
    return in;
  }
};

// The memory of an operand x (R, C) of 2 or 4 bytes an element seen as its transposed FP8 codes
// (C, R), e4m3: where a producer keeps those codes in the operand's place.
inline Tensor transposed_codes_in(const Tensor& x) {
  Tensor t = x;
  t.dtype = DType::E4M3;
  t.shape = Shape{x.dim(1), x.dim(0)};
  return t;
}

}  // namespace tessera
