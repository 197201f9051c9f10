#pragma once
// `tessera bench generate`: batched generation's tokens/s on the engine GRPO and `tessera
// generate` sample with (model/continuations.h), measured as transformers' generate is by the
// post-training peer (torch_posttrain.py --task gen): B prompts of P random ids, N new tokens
// each, sampled at temperature 1 with no end token, the prompts' prefill included; random
// weights of a preset. Each batch size is checked before it is timed: greedy decoding with
// captured steps (CUDA graphs) gives the ids that the same decoding op by op gives.
#include <string>
#include <vector>

namespace tessera::bench {

int generate_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
