#include "tessera/ckpt/atomic_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

namespace fs = std::filesystem;

void write_file_atomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw DataError(fmt::format("{}: cannot open for writing: {}", tmp, std::strerror(errno)));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t w = ::write(fd, content.data() + done, content.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      fs::remove(tmp);
      throw DataError(fmt::format("{}: write failed: {} (disk full?)", tmp, why));
    }
    done += static_cast<size_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
  fs::rename(tmp, path);
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: durability, not correctness, depends on it
  ::fsync(fd);
  ::close(fd);
}

void publish_directory(const std::string& tmp, const std::string& final_dir) {
  fsync_directory(tmp);
  const std::string old = final_dir + ".old";
  const bool replacing = fs::exists(final_dir);
  if (replacing) {
    fs::remove_all(old);
    fs::rename(final_dir, old);
  }
  fs::rename(tmp, final_dir);
  const fs::path parent = fs::path(final_dir).parent_path();
  fsync_directory(parent.empty() ? "." : parent.string());
  if (replacing) fs::remove_all(old);
}

}  // namespace tessera
