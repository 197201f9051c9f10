#include "tessera/model/init.h"

#include <cmath>

namespace tessera {

void init_parameters(Backend& backend, const ModelSpec& spec, const ParamLayout& layout,
                     const Tensor& flat, uint64_t seed) {
  expect_dtype(flat, DType::F32, "flat parameters");
  expect_numel(flat, layout.total, "flat parameters");
  backend.fill(flat, 0.0f);
  const float scaled_std = spec.init_std / std::sqrt(2.0f * static_cast<float>(spec.num_layers));
  for (const ParamInfo& p : layout.params) {
    const Tensor t = flat.flat_range(p.offset, p.numel());
    switch (p.init) {
      case ParamInit::Normal:
        backend.init_normal(t, seed, static_cast<uint64_t>(p.offset), 0.0f, spec.init_std);
        break;
      case ParamInit::ScaledNormal:
        backend.init_normal(t, seed, static_cast<uint64_t>(p.offset), 0.0f, scaled_std);
        break;
      case ParamInit::Ones: backend.fill(t, 1.0f); break;
      case ParamInit::Zeros: break;
    }
  }
}

}  // namespace tessera
