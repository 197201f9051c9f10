#include "tessera/core/output_path.h"

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

namespace fs = std::filesystem;

namespace {

// The kernel refuses a name longer than NAME_MAX bytes and a path longer than PATH_MAX with
// ENAMETOOLONG; say which part is too long rather than "File name too long".
std::optional<std::string> name_length_problem(const fs::path& path) {
  for (const fs::path& part : path)
    if (part.native().size() > NAME_MAX)
      return fmt::format("{}...: a path component of {} bytes; names are at most {} bytes",
                         part.native().substr(0, 40), part.native().size(), NAME_MAX);
  if (path.native().size() >= PATH_MAX)
    return fmt::format("a path of {} bytes; paths are at most {} bytes", path.native().size(),
                       PATH_MAX - 1);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> output_directory_problem(const fs::path& dir) {
  if (dir.empty()) return "the path is empty";
  if (auto problem = name_length_problem(dir)) return problem;
  // Walk up to the nearest existing ancestor: that is where create_directories starts, so it
  // must be a directory we may create entries in.
  fs::path p = dir;
  for (;;) {
    std::error_code ec;
    const fs::file_status s = fs::status(p, ec);
    if (s.type() == fs::file_type::not_found) {
      if (fs::is_symlink(fs::symlink_status(p, ec)))
        return fmt::format("{} is a symbolic link to nothing", p.string());
      const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
      if (parent == p) return fmt::format("{} does not exist", p.string());
      p = parent;
      continue;
    }
    if (ec) return fmt::format("cannot access {}: {}", p.string(), ec.message());
    if (s.type() != fs::file_type::directory) {
      return fmt::format("{} is {}, not a directory", p.string(),
                         s.type() == fs::file_type::regular ? "a regular file" : "a special file");
    }
    // AT_EACCESS: the effective user is the one that will write (and root may write anywhere
    // unless the file system is read-only, which W_OK reports as EROFS).
    if (::faccessat(AT_FDCWD, p.c_str(), W_OK | X_OK, AT_EACCESS) != 0)
      return fmt::format("{} is not writable: {}", p.string(), std::strerror(errno));
    return std::nullopt;
  }
}

std::optional<std::string> output_file_problem(const fs::path& file) {
  if (file.empty()) return "the path is empty";
  if (!file.has_filename()) return fmt::format("{} ends in '/': no file name", file.string());
  if (auto problem = name_length_problem(file)) return problem;
  std::error_code ec;
  if (fs::is_directory(file, ec)) return fmt::format("{} is a directory", file.string());
  return output_directory_problem(file.parent_path().empty() ? fs::path(".") : file.parent_path());
}

void require_output_directory(const fs::path& dir, const std::string& source,
                              const std::string& key) {
  if (const auto problem = output_directory_problem(dir))
    throw ConfigError(source, key, dir.string(),
                      "a directory that can be created and written (" + *problem + ")");
}

void require_output_file(const fs::path& file, const std::string& source, const std::string& key) {
  if (const auto problem = output_file_problem(file))
    throw ConfigError(source, key, file.string(), "a file that can be written (" + *problem + ")");
}

}  // namespace tessera
