#pragma once
// Shared by the indexed-data tests: scratch directories, small datasets and running commands.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"

#include "tessera/data/indexed_dataset.h"

namespace tessera::testing {

namespace fs = std::filesystem;

inline void write_dataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& docs,
                          TokenDType dtype = TokenDType::UInt16) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d.data(), d.size());
  w.finish();
}

// Documents whose tokens are all distinct, so a token names its document and position:
// document d holds lengths[d] consecutive ids starting after the previous document's.
inline std::vector<std::vector<int32_t>> distinct_documents(const std::vector<int>& lengths) {
  std::vector<std::vector<int32_t>> docs;
  int32_t next = 0;
  for (int n : lengths) {
    docs.emplace_back();
    for (int i = 0; i < n; ++i) docs.back().push_back(next++);
  }
  return docs;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tessera::testing
