#include "tessera/model/param_layout.h"

#include <algorithm>

#include "tessera/model/decoder_layer.h"

namespace tessera {
namespace {

constexpr int64_t kAlignElements = 64;

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
  p.offset = l_.total;
  p.layer = layer_;
  p.unit = static_cast<int>(l_.units.size()) - 1;
  p.decay = decay;
  p.init = init;
  p.tp = tp;
  p.fused_rows = std::move(fused_rows);
  l_.total += (p.numel() + kAlignElements - 1) / kAlignElements * kAlignElements;
  l_.units.back().end = l_.total;
  l_.params.push_back(std::move(p));
  return static_cast<int>(l_.params.size()) - 1;
}

ParamLayout make_param_layout(const ModelSpec& spec) {
  return decoder_param_layout(spec, make_decoder_layers(spec));
}

}  // namespace tessera
