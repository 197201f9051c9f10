#include "tessera/ckpt/model_source.h"

#include <filesystem>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "tessera/core/error.h"
#include "tessera/model/decoder_layer.h"

namespace tessera {

namespace fs = std::filesystem;

ModelSource::ModelSource(ModelSource&&) noexcept = default;
ModelSource::~ModelSource() = default;

ModelSource ModelSource::open(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::path(path) / "config.json", ec) ? open_hf(path) : open_checkpoint(path);
}

ModelSource ModelSource::open_hf(const std::string& dir) {
  ModelSource s;
  s.name_ = dir;
  s.hf_ = std::make_unique<HfModelReader>(dir);
  return s;
}

ModelSource ModelSource::open_checkpoint(const std::string& path) {
  ModelSource s;
  s.name_ = find_latest_checkpoint(path);
  if (s.name_.empty())
    throw DataError(fmt::format("{}: no checkpoint here; expected a checkpoint directory (holding "
                                "trainer_state.json) or a save directory with {}",
                                path, kTrackerFileName));
  s.checkpoint_ = std::make_unique<Checkpoint>(s.name_);
  const std::optional<LoraOptions>& lora = s.checkpoint_->state().lora;
  if (!lora) return s;
  // The base the run adapted, as its configuration recorded it.
  const std::string state_file = (fs::path(s.name_) / "trainer_state.json").string();
  std::string pretrained, hf;
  try {
    const YAML::Node config = YAML::Load(s.checkpoint_->state().config_yaml);
    pretrained = config["pretrained_checkpoint"].as<std::string>("");
    hf = config["hf_init_path"].as<std::string>("");
  } catch (const YAML::Exception& e) {
    throw DataError(fmt::format("{}: config_yaml does not say the LoRA base ({})", state_file, e.what()));
  }
  if (pretrained == "null") pretrained.clear();
  if (hf == "null") hf.clear();
  if (pretrained.empty() && hf.empty())
    throw DataError(fmt::format("{}: LoRA adapters of a base that was a fresh initialisation (neither "
                                "pretrained_checkpoint nor hf_init_path): there are no base weights to "
                                "merge them into",
                                state_file));
  const std::string base = pretrained.empty() ? hf : pretrained;
  std::error_code ec;
  if (!fs::exists(base, ec))
    throw DataError(fmt::format("{}: the LoRA base {} ({}) is not here: read the checkpoint from the "
                                "directory its run trained in, or where that path resolves",
                                state_file, base, pretrained.empty() ? "hf_init_path" : "pretrained_checkpoint"));
  s.lora_base_ = std::make_unique<ModelSource>(pretrained.empty() ? open_hf(hf) : open_checkpoint(pretrained));
  if (s.lora_base_->checkpoint() && s.lora_base_->checkpoint()->state().lora)
    throw DataError(fmt::format("{}: its LoRA base {} holds LoRA adapters itself", state_file, base));
  s.base_layout_ = make_param_layout(s.checkpoint_->spec());
  s.lora_ = make_lora_layout(s.checkpoint_->spec(), s.base_layout_, *lora);
  return s;
}

const ModelSpec& ModelSource::spec() const {
  return checkpoint_ ? checkpoint_->spec() : hf_->spec();
}

std::vector<float> ModelSource::weights(const ParamInfo& p) const {
  if (hf_) return hf_->weights(p);
  if (!lora_base_) return checkpoint_->master(p);
  std::vector<float> w = lora_base_->weights(p);
  const LoraOptions& o = *checkpoint_->state().lora;
  const auto scale = static_cast<float>(o.scale());
  for (const LoraAdapted& a : lora_.adapted) {
    if (base_layout_.params[a.base_weight].name != p.name) continue;
    const std::vector<float> A = checkpoint_->master(lora_.adapters.params[a.a]);
    const std::vector<float> B = checkpoint_->master(lora_.adapters.params[a.b]);
    // Rows [row0, row0 + rows) += scale * B (rows, r) @ A (r, cols).
    for (int64_t i = 0; i < a.rows; ++i) {
      float* row = &w[(a.row0 + i) * a.cols];
      for (int64_t k = 0; k < o.rank; ++k) {
        const float b = scale * B[i * o.rank + k];
        const float* arow = &A[k * a.cols];
        for (int64_t j = 0; j < a.cols; ++j) row[j] += b * arow[j];
      }
    }
  }
  return w;
}

std::vector<float> ModelSource::state(const std::string& name) const {
  if (hf_) return hf_->state(name);
  if (lora_base_) return lora_base_->state(name);
  return checkpoint_->optimizer_tensor(name) ? checkpoint_->optimizer_values(name) : std::vector<float>();
}

std::vector<std::pair<std::string, std::vector<float>>> ModelSource::all_state() const {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const auto& layer : make_decoder_layers(spec()))
    for (const auto& [name, width] : layer->state_layout())
      if (std::vector<float> v = state(name); !v.empty()) out.emplace_back(name, std::move(v));
  return out;
}

}  // namespace tessera
