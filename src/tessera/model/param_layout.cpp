#include "tessera/model/param_layout.h"

#include <algorithm>
#include <unordered_map>

#include "tessera/core/error.h"
#include "tessera/model/decoder_layer.h"

namespace tessera {
namespace {

constexpr int64_t kAlignElements = 64;

// `s` with dimension `dim` multiplied by `factor`.
Shape scaled(const Shape& s, int dim, int64_t factor) {
  int64_t d[Shape::kMaxRank] = {};
  for (int i = 0; i < s.rank(); ++i) d[i] = s[i] * (i == dim ? factor : 1);
  switch (s.rank()) {
    case 1:
      return {d[0]};
    case 2:
      return {d[0], d[1]};
    case 3:
      return {d[0], d[1], d[2]};
    default:
      return {d[0], d[1], d[2], d[3]};
  }
}

}  // namespace

const ParamInfo* ParamLayout::find(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

void ParamLayout::for_each_param_in(
    const ParamRange& r, const std::function<void(const ParamInfo&, const ParamRange&)>& f) const {
  for (const ParamInfo& p : params) {
    const int64_t begin = std::max(p.offset, r.begin), end = std::min(p.offset + p.numel(), r.end);
    if (begin < end) f(p, {begin, end});
  }
}

std::vector<int64_t> ParamInfo::full_fused_rows() const {
  std::vector<int64_t> rows = fused_rows;
  // Column parallelism splits every piece: the whole has parts times each.
  if (tp == TensorParallelStyle::Column)
    for (int64_t& r : rows) r *= placement.parts;
  return rows;
}

void ParamInfo::for_each_run(
    int64_t lo, int64_t hi,
    const std::function<void(int64_t begin, int64_t count, int64_t full_begin)>& f) const {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min(hi, numel());
  if (lo >= hi) return;
  if (whole()) return f(lo, hi - lo, lo);
  // The runs of this part, as (first element, count, first element in the whole); each
  // clipped to [lo, hi).
  auto run = [&](int64_t begin, int64_t count, int64_t full_begin) {
    const int64_t b = std::max(begin, lo), e = std::min(begin + count, hi);
    if (b < e) f(b, e - b, full_begin + (b - begin));
  };
  const int64_t rows = shape[0], cols = numel() / rows;
  if (tp == TensorParallelStyle::Row) {
    // Row i of the part is columns [index x cols, (index + 1) x cols) of the whole's row i.
    const int64_t full_cols = full_shape.numel() / full_shape[0];
    const int64_t first_row = lo / cols, last_row = (hi - 1) / cols;
    for (int64_t i = first_row; i <= last_row; ++i)
      run(i * cols, cols, i * full_cols + placement.index * cols);
    return;
  }
  // Column, Vocab and Expert: each piece's rows of the part are rows [index x n, (index + 1) x
  // n) of the whole's piece of parts x n rows (an expert stack is one piece of experts).
  const std::vector<int64_t> pieces = fused_rows.empty() ? std::vector<int64_t>{rows} : fused_rows;
  int64_t row = 0, full_row = 0;
  for (const int64_t n : pieces) {
    run(row * cols, n * cols, (full_row + placement.index * n) * cols);
    row += n;
    full_row += n * placement.parts;
  }
}

std::vector<ParamSegment> ParamLayout::decay_segments() const {
  std::vector<ParamSegment> segs;
  for (const auto& p : params) {
    const int64_t end = p.offset + p.numel();
    // Alignment padding between tensors is folded into a neighbouring run: the model never
    // reads it and its gradient stays zero, so its decay flag does not matter.
    if (!segs.empty() && segs.back().decay == p.decay) {
      segs.back().count = end - segs.back().offset;
    } else {
      const int64_t start = segs.empty() ? 0 : segs.back().offset + segs.back().count;
      segs.push_back({start, end - start, p.decay});
    }
  }
  if (!segs.empty()) segs.back().count = total - segs.back().offset;
  return segs;
}

void ParamLayoutBuilder::begin_unit(std::string prefix, int layer) {
  l_.units.push_back({l_.total, l_.total});
  prefix_ = std::move(prefix);
  layer_ = layer;
}

int ParamLayoutBuilder::add(std::string_view name, Shape shape, ParamInit init, bool decay,
                            TensorParallelStyle tp, std::vector<int64_t> fused_rows) {
  ParamInfo p;
  p.name = prefix_ + std::string(name);
  p.shape = shape;
  p.full_shape = shape;
  const bool expert = tp == TensorParallelStyle::Expert;
  if (expert && split_.expert_parallel.parts > 1) {
    TS_CHECK(shape.rank() == 3 && shape[0] % split_.expert_parallel.parts == 0,
             "{}: {} experts do not split over {} expert-parallel ranks", p.name, shape.str(),
             split_.expert_parallel.parts);
    p.placement = split_.expert_parallel;
    p.shape = {shape[0] / split_.expert_parallel.parts, shape[1], shape[2]};
  } else if (!expert && tp != TensorParallelStyle::Replicated && tp != TensorParallelStyle::ReplicatedPartialGrads &&
             split_.tensor_parallel.parts > 1) {
    p.placement = split_.tensor_parallel;
    // Row splits the columns (the last dimension), the others the rows.
    p.full_shape = scaled(shape, tp == TensorParallelStyle::Row ? shape.rank() - 1 : 0,
                          split_.tensor_parallel.parts);
  }
  // Runs of expert stacks start and end on the reduction groups' boundaries.
  const int64_t run_multiple = split_.expert_run_multiple;
  if (run_multiple > 1 && expert != last_was_expert_) {
    l_.total = (l_.total + run_multiple - 1) / run_multiple * run_multiple;
    if (expert) {
      l_.expert_runs.push_back({l_.total, l_.total});
    }
  }
  last_was_expert_ = expert;
  p.offset = l_.total;
  p.full_offset = l_.total;
  p.layer = layer_;
  p.unit = static_cast<int>(l_.units.size()) - 1;
  p.decay = decay;
  p.init = init;
  p.tp = tp;
  p.fused_rows = std::move(fused_rows);
  l_.total += (p.numel() + kAlignElements - 1) / kAlignElements * kAlignElements;
  if (expert && run_multiple > 1)
    l_.expert_runs.back().end = (l_.total + run_multiple - 1) / run_multiple * run_multiple;
  l_.units.back().end = l_.total;
  l_.params.push_back(std::move(p));
  return static_cast<int>(l_.params.size()) - 1;
}

ParamLayout make_param_layout(const ModelSpec& spec) {
  return decoder_param_layout(spec, make_decoder_layers(spec));
}

void set_full_offsets(ParamLayout& layout, const ParamLayout& whole) {
  std::unordered_map<std::string_view, const ParamInfo*> by_name;
  for (const ParamInfo& p : whole.params) by_name.emplace(p.name, &p);
  for (ParamInfo& p : layout.params) {
    const auto it = by_name.find(p.name);
    TS_CHECK(it != by_name.end() && it->second->shape == p.full_shape,
             "parameter {} {} is not in the one-device layout", p.name, p.full_shape.str());
    p.full_offset = it->second->offset;
  }
}

}  // namespace tessera
