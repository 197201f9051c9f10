#pragma once
// `tessera bench tokenizer`: tokenizer throughput in MB/s on one thread and on many, next to
// the reference implementation (@huggingface/tokenizers under node) on the same documents,
// whose ids it also checks.
#include <string>
#include <vector>

namespace tessera::bench {

int tokenizer_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
