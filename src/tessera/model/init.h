#pragma once
#include <cstdint>
#include <vector>

#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Megatron's initialisation into fp32 (or bf16) slices of the flat layout: weights N(0, init_std),
// output projections (o_proj, down_proj) N(0, init_std / sqrt(2 L)), norm weights 1, biases 0,
// alignment padding 0. Each element's value depends only on the seed and its offset in the
// one-device layout (ParamInfo::full_offset and its place in the whole parameter), so every
// backend, sharding and tensor-parallel split initialises identically.
void init_parameters(Backend& backend, const ModelSpec& spec, const ParamLayout& layout,
                     const std::vector<FlatSlice>& slices, uint64_t seed);
// The same into one (layout.total) fp32 buffer.
void init_parameters(Backend& backend, const ModelSpec& spec, const ParamLayout& layout,
                     const Tensor& flat_fp32, uint64_t seed);

}  // namespace tessera
