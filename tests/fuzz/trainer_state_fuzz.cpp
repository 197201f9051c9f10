// A checkpoint's trainer_state.json and the save directory's tracker, as `train --load`,
// `convert --from` and `generate --from` read them. The input's first line is the tracker
// (latest_checkpointed_iteration.txt), the rest trainer_state.json of iter_0000000, beside a
// real model.safetensors of a tiny model (written once per process).
#include "fuzz/fuzz_support.h"
#include "tessera/ckpt/checkpoint.h"

using namespace tessera;
using namespace tessera::fuzz;

namespace {

ModelSpec tiny_spec() {
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
  return s;
}

const fs::path& save_dir() {
  static const fs::path dir = [] {
    const fs::path d = scratch_dir() / "save";
    save_weights_checkpoint(d.string(), tiny_spec(), [](const ParamInfo& p) {
      return std::vector<float>(static_cast<size_t>(p.numel()), 0.5f);
    });
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path save = save_dir();
  const auto parts = split(as_text(data, size), "\n", 2);
  write_file(save / kTrackerFileName, parts[0]);
  write_file(save / "iter_0000000" / "trainer_state.json", parts.size() > 1 ? parts[1] : "");
  refusal_or_success([&] { find_latest_checkpoint(save.string()); });
  refusal_or_success(
      [&] { check_checkpoint_to_resume((save / "iter_0000000").string(), tiny_spec()); });
  saved_checkpoints(save.string());
  return 0;
}
