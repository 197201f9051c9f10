#include "tessera/model/param_layout.h"

#include <algorithm>

#include <fmt/format.h>

namespace tessera {
namespace {

constexpr int64_t kAlignElements = 64;

// Appends a parameter to the last unit.
int add(ParamLayout& l, std::string name, Shape shape, int layer, bool decay, ParamInit init) {
  const int unit = static_cast<int>(l.units.size()) - 1;
  ParamInfo p{std::move(name), shape, l.total, layer, unit, decay, init};
  l.total += (p.numel() + kAlignElements - 1) / kAlignElements * kAlignElements;
  l.units.back().end = l.total;
  l.params.push_back(std::move(p));
  return static_cast<int>(l.params.size()) - 1;
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

ParamLayout make_param_layout(const ModelSpec& s) {
  ParamLayout l;
  const int64_t C = s.hidden;
  auto begin_unit = [&l] { l.units.push_back({l.total, l.total}); };
  begin_unit();
  l.embedding = add(l, "model.embed_tokens.weight", {s.vocab_size, C}, -1, true, ParamInit::Normal);
  for (int i = 0; i < s.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    LayerParamIndex li;
    begin_unit();
    li.attn_norm = add(l, p + "input_layernorm.weight", {C}, i, false, ParamInit::Ones);
    li.qkv_weight = add(l, p + "self_attn.qkv_proj.weight", {s.qkv_width(), C}, i, true, ParamInit::Normal);
    if (s.qkv_bias)
      li.qkv_bias = add(l, p + "self_attn.qkv_proj.bias", {s.qkv_width()}, i, false, ParamInit::Zeros);
    li.o_proj = add(l, p + "self_attn.o_proj.weight", {C, s.attn_width()}, i, true, ParamInit::ScaledNormal);
    li.mlp_norm = add(l, p + "post_attention_layernorm.weight", {C}, i, false, ParamInit::Ones);
    li.gate_up = add(l, p + "mlp.gate_up_proj.weight", {2 * s.ffn, C}, i, true, ParamInit::Normal);
    li.down_proj = add(l, p + "mlp.down_proj.weight", {C, s.ffn}, i, true, ParamInit::ScaledNormal);
    l.layers.push_back(li);
  }
  begin_unit();
  l.final_norm = add(l, "model.norm.weight", {C}, -1, false, ParamInit::Ones);
  l.lm_head = s.tied_embeddings ? l.embedding
                                : add(l, "lm_head.weight", {s.vocab_size, C}, -1, true, ParamInit::Normal);
  return l;
}

}  // namespace tessera
