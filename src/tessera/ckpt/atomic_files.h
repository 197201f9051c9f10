#pragma once
// Writing outputs so that a crash or a kill at any moment leaves either the old complete
// state or the new complete state under the final name, never a half-written one.
#include <string>

namespace tessera {

// Writes `content` to path + ".tmp", flushes it to disk and renames it over `path`.
void write_file_atomically(const std::string& path, const std::string& content);

// Makes renames and new entries in `dir` durable (the rename itself lives in the directory).
void fsync_directory(const std::string& dir);

// Moves the completed directory `tmp` to `final_dir`, replacing an existing one (renamed
// aside first, then deleted, because rename() cannot replace a non-empty directory).
void publish_directory(const std::string& tmp, const std::string& final_dir);

}  // namespace tessera
