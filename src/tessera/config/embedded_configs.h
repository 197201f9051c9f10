#pragma once
// The YAML files of configs/, compiled into the binary (see cmake/embed_configs.cmake), so
// presets and the default experiment resolve without the source tree.
#include <span>
#include <string_view>

namespace tessera {

struct EmbeddedConfig {
  std::string_view path;     // relative to configs/, e.g. "models/llama3.1_8B.yaml"
  std::string_view content;
};

std::span<const EmbeddedConfig> embedded_configs();

}  // namespace tessera
