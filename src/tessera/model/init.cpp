#include "tessera/model/init.h"

#include <cmath>

namespace tessera {

void init_parameters(Backend& backend, const ModelSpec& spec, const ParamLayout& layout,
                     const std::vector<FlatSlice>& slices, uint64_t seed) {
  const float scaled_std = spec.init_std / std::sqrt(2.0f * static_cast<float>(spec.num_layers));
  for (const FlatSlice& s : slices) {
    // bf16 slices (bf16 main parameters) receive the fp32 values rounded, as a conversion
    // of fp32 master weights would give them.
    TS_CHECK(s.values.dtype == DType::F32 || s.values.dtype == DType::BF16,
             "initialised parameters: dtype {}, expected fp32 or bf16", dtype_name(s.values.dtype));
    expect_numel(s.values, s.range.count(), "initialised parameters");
    backend.fill(s.values, 0.0f);
    layout.for_each_param_in(s.range, [&](const ParamInfo& p, const ParamRange& part) {
      // A tensor-parallel part draws the values of its elements' places in the whole
      // parameter, run by run, so that every mesh initialises the same model.
      p.for_each_run(part.begin - p.offset, part.end - p.offset,
                     [&](int64_t begin, int64_t count, int64_t full_begin) {
                       const Tensor t =
                           s.values.flat_range(p.offset + begin - s.range.begin, count);
                       // The stream index of t[0]: its offset in the one-device layout.
                       const auto first = static_cast<uint64_t>(p.full_offset + full_begin);
                       switch (p.init) {
                         case ParamInit::Normal:
                           backend.init_normal(t, seed, first, 0.0f, spec.init_std);
                           break;
                         case ParamInit::ScaledNormal:
                           backend.init_normal(t, seed, first, 0.0f, scaled_std);
                           break;
                         case ParamInit::Ones:
                           backend.fill(t, 1.0f);
                           break;
                         case ParamInit::Zeros:
                           break;
                         case ParamInit::LowRankNormal:
                           backend.init_normal(t, seed, first, 0.0f,
                                               1.0f / static_cast<float>(p.shape[0]));
                           break;
                       }
                     });
    });
  }
}

void init_parameters(Backend& backend, const ModelSpec& spec, const ParamLayout& layout,
                     const Tensor& flat_fp32, uint64_t seed) {
  init_parameters(backend, spec, layout, {{{0, layout.total}, flat_fp32}}, seed);
}

}  // namespace tessera
