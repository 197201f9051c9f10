#pragma once
// What several model tests share: a decoder small enough for exact CPU checks, and the
// relative L2 difference they compare with.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/model/model_spec.h"

namespace tessera {

// vocab 64, hidden 32, 4 heads of 8 in 2 query groups, SwiGLU of 40, init std 0.1.
inline ModelSpec tiny_decoder_spec(int64_t layers = 2) {
  ModelSpec s;
  s.vocab_size = s.tokenizer_vocab = 64;
  s.num_layers = layers;
  s.hidden = 32;
  s.ffn = 40;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.max_position_embeddings = 64;
  s.init_std = 0.1f;
  return s;
}

// ||a - b|| / ||b||.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += std::pow(static_cast<double>(a[i]) - b[i], 2);
    norm += std::pow(static_cast<double>(b[i]), 2);
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace tessera
