// A Hugging Face model directory's config.json, as `convert --from-hf`, `generate --from` and
// hf_init_path read it: the input is config.json, beside the model.safetensors of a tiny
// Llama (written once per process). An accepted config has its weights read too.
#include "fuzz/fuzz_support.h"
#include "tessera/ckpt/hf_model.h"

using namespace tessera;
using namespace tessera::fuzz;

namespace {

const fs::path& model_dir() {
  static const fs::path dir = [] {
    ModelSpec s;
    s.family = "llama";
    s.vocab_size = s.tokenizer_vocab = 64;
    s.num_layers = 2;
    s.hidden = 16;
    s.ffn = 32;
    s.heads = 2;
    s.kv_heads = 1;
    s.head_dim = 8;
    s.max_position_embeddings = 64;
    const fs::path d = scratch_dir() / "hf";
    write_hf_model(
        d.string(), s,
        [](const ParamInfo& p) {
          return std::vector<float>(static_cast<size_t>(p.numel()), 0.25f);
        },
        HfExportOptions{});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = model_dir();
  write_file(dir / "config.json", as_text(data, size));
  refusal_or_success([&] {
    const HfModelReader reader(dir.string());
    for (const ParamInfo& p : reader.layout().params) reader.weights(p);
  });
  return 0;
}
