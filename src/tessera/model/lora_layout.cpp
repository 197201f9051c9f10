#include "tessera/model/lora_layout.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/config/lora_targets.h"
#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera {
namespace {

// "model.layers.3.self_attn.q_proj.weight" -> "q_proj".
std::string module_of(const std::string& hf_name) {
  const size_t end = hf_name.rfind('.');
  const size_t begin = hf_name.rfind('.', end - 1);
  return hf_name.substr(begin + 1, end - begin - 1);
}

}  // namespace

std::optional<LoraOptions> lora_options(const TrainingConfig& t) {
  if (t.lora_rank <= 0) return std::nullopt;
  return LoraOptions{t.lora_rank, t.lora_alpha, lora_targets(t.lora_target_modules)};
}

LoraLayout make_lora_layout(const ModelSpec& spec, const ParamLayout& base, const LoraOptions& options) {
  const ModelFamily& family = model_family(spec.family);
  // Under tensor parallelism the adapters split with their weight: a column-parallel weight's
  // B by rows (this rank's output rows), a row-parallel one's A by columns (its input columns).
  // The other factor is whole on every rank, its gradient a partial sum over the ranks.
  ParamSplit split;
  for (const ParamInfo& p : base.params)
    if (p.tp == TensorParallelStyle::Column || p.tp == TensorParallelStyle::Row) split.tensor_parallel = p.placement;
  LoraLayout out;
  ParamLayoutBuilder builder(out.adapters, split);
  for (size_t u = 0; u < base.units.size(); ++u) {
    int layer = -1;
    for (const ParamInfo& p : base.params)
      if (p.unit == static_cast<int>(u)) layer = p.layer;
    builder.begin_unit("", layer);
    for (size_t w = 0; w < base.params.size(); ++w) {
      const ParamInfo& p = base.params[w];
      if (p.unit != static_cast<int>(u) || p.shape.rank() != 2 || p.layer < 0) continue;
      for (const HfTensorPiece& piece : family.hf_pieces(p, spec)) {
        if (piece.shape.size() != 2 ||
            std::find(options.targets.begin(), options.targets.end(), module_of(piece.name)) ==
                options.targets.end())
          continue;
        const std::string stem = piece.name.substr(0, piece.name.size() - std::string(".weight").size());
        LoraAdapted a;
        a.base_weight = static_cast<int>(w);
        a.cols = piece.shape[1];
        a.row0 = piece.offset / a.cols;
        a.rows = piece.shape[0];
        using enum TensorParallelStyle;
        const bool column = p.tp == Column, row = p.tp == Row;
        a.a = builder.add(stem + ".lora_A.weight", {options.rank, a.cols}, ParamInit::LowRankNormal, true,
                          row ? Row : column ? ReplicatedPartialGrads : Replicated);
        a.b = builder.add(stem + ".lora_B.weight", {a.rows, options.rank}, ParamInit::Zeros, true,
                          column ? Column : row ? ReplicatedPartialGrads : Replicated);
        out.adapted.push_back(a);
      }
    }
  }
  if (out.adapted.empty())
    throw ConfigError("configuration", "lora_target_modules", fmt::format("{}", fmt::join(options.targets, ",")),
                      "projections the " + spec.family + " model has");
  // A split layout's adapters are keyed (initialisation, checkpoints) by their place in the
  // one-device layout, as the base's are.
  if (split.tensor_parallel.parts > 1)
    set_full_offsets(out.adapters, make_lora_layout(spec, make_param_layout(spec), options).adapters);
  return out;
}

}  // namespace tessera
