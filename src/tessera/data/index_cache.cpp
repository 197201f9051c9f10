#include "tessera/data/index_cache.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace fs = std::filesystem;

std::string description_hash(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return fmt::format("{:016x}", h);
}

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes every file under a temporary name first; the renames make the entry appear whole.
void save_entry(const fs::path& base, const std::string& description,
                const std::vector<std::string>& names, const std::vector<NpyArray>& arrays) {
  const std::string tmp = fmt::format(".tmp-{}", ::getpid());
  std::vector<fs::path> written;
  try {
    for (size_t i = 0; i < names.size(); ++i) {
      written.push_back(base.string() + names[i] + ".npy" + tmp);
      arrays[i].save(written.back().string());
    }
    written.push_back(base.string() + "description.txt" + tmp);
    std::ofstream out(written.back(), std::ios::binary);
    out << description;
    if (!out.flush()) throw DataError(fmt::format("{}: write failed", written.back().string()));
    out.close();
    for (const fs::path& p : written) {
      const std::string final_name = p.string().substr(0, p.string().size() - tmp.size());
      fs::rename(p, final_name);
    }
  } catch (...) {
    std::error_code ignored;
    for (const fs::path& p : written) fs::remove(p, ignored);
    throw;
  }
}

}  // namespace

CachedIndices load_or_build_indices(
    const std::string& dir, const std::string& kind, const std::string& description,
    const std::vector<std::string>& names, const std::function<std::vector<NpyArray>()>& build,
    const std::function<bool(const std::vector<NpyArray>&)>& valid) {
  const fs::path base = fs::path(dir) / fmt::format("{}-{}-", description_hash(description), kind);
  const fs::path description_file = base.string() + "description.txt";
  CachedIndices result;
  if (fs::exists(description_file) && read_text(description_file) == description) {
    try {
      for (const std::string& name : names)
        result.arrays.push_back(NpyArray::load(base.string() + name + ".npy"));
      if (valid(result.arrays)) {
        result.status = fmt::format("loaded from {}*", base.string());
        return result;
      }
    } catch (const DataError&) {
      // A damaged or partly deleted entry: rebuild it below.
    }
    result.arrays.clear();
  }
  result.arrays = build();
  try {
    fs::create_directories(dir);
    save_entry(base, description, names, result.arrays);
    result.status = fmt::format("built, saved in {}*", base.string());
  } catch (const std::exception& e) {
    // A read-only data directory must not stop training: the indices live in memory instead.
    result.status = fmt::format(
        "built, not cached ({}); set data_cache_path to a writable "
        "directory to cache them",
        e.what());
  }
  return result;
}

}  // namespace tessera
