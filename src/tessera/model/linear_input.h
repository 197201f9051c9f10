#pragma once
// A linear layer's input, and whether the FP8 codes its forward multiplies are already written.
// An FP8 linear casts its input before its GEMM; where the input's producer writes the codes
// on the way (swiglu_forward_cast into LayerOps::linear_input_cast's target), that cast and
// its re-read of the input go. The input itself stays: the weight gradient's transposed cast
// and LoRA's adapters read it.
#include "tessera/core/tensor.h"

namespace tessera {

struct LinearInput {
  Tensor x;
  bool cast = false;  // x's codes are in the layer's input_cast target, with its scale and amax

  // Implicit: a tensor is an input as it is.
  LinearInput(const Tensor& t) : x(t) {}
  static LinearInput with_codes(const Tensor& t) {
    LinearInput in(t);
    in.cast = true;
    return in;
  }
};

}  // namespace tessera
