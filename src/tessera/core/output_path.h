#pragma once
// Checks that an output location can be written, run before a command starts its work, so that a
// mistyped -o fails at once with exit code 2 instead of after minutes of work (or with a
// filesystem exception). They only look: nothing is created or written.
//
// A check passes or fails on the state of the disk when it runs; a disk that fills up later is
// still a runtime failure of the writer.
#include <filesystem>
#include <optional>
#include <string>

namespace tessera {

// Why nothing can be written into directory `dir`, or nullopt when it can: `dir` is a writable
// directory, or it does not exist and its nearest existing ancestor is a writable directory (so
// create_directories(dir) can make it). The reason names the path at fault, e.g.
// "/runs/notes.txt is a regular file, not a directory".
std::optional<std::string> output_directory_problem(const std::filesystem::path& dir);

// Why `file` cannot be written (as `file` or as a temporary beside it that is renamed to it), or
// nullopt when it can: `file` is not a directory and its parent passes
// output_directory_problem.
std::optional<std::string> output_file_problem(const std::filesystem::path& file);

// Throw ConfigError(source, key, path, "<what is expected> (<the problem>)") when the check above
// finds a problem; `source` is "command line" or the config file that named the path.
void require_output_directory(const std::filesystem::path& dir, const std::string& source,
                              const std::string& key);
void require_output_file(const std::filesystem::path& file, const std::string& source,
                         const std::string& key);

}  // namespace tessera
