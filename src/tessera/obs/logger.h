#pragma once
// Per-rank logs in the Primus layout: {exp}/logs/pre_trainer/rank-{r}/{debug,info,warning,
// error}.log, where each file holds the messages of its level and above. Rank 0 also
// echoes info and above to the console; warnings and errors reach stderr from every rank.
// A progress line (terminal only, never in files) can sit under the console output.
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tessera {

enum class LogLevel { Debug = 0, Info = 1, Warning = 2, Error = 3 };

class Logger {
 public:
  // rank_dir: ".../logs/pre_trainer/rank-{r}" (created if missing). An empty rank_dir logs to
  // the console only.
  Logger(const std::string& rank_dir, int rank, bool console, bool progress);
  ~Logger();
  Logger(const Logger&) = delete;
  Logger& operator=(const Logger&) = delete;

  void log(LogLevel level, std::string_view message);
  template <class... A>
  void debug(fmt::format_string<A...> f, A&&... a) { log(LogLevel::Debug, fmt::format(f, std::forward<A>(a)...)); }
  template <class... A>
  void info(fmt::format_string<A...> f, A&&... a) { log(LogLevel::Info, fmt::format(f, std::forward<A>(a)...)); }
  template <class... A>
  void warning(fmt::format_string<A...> f, A&&... a) { log(LogLevel::Warning, fmt::format(f, std::forward<A>(a)...)); }
  template <class... A>
  void error(fmt::format_string<A...> f, A&&... a) { log(LogLevel::Error, fmt::format(f, std::forward<A>(a)...)); }

  // Writes to the log files only (for messages the caller also reports elsewhere).
  void record(LogLevel level, std::string_view message);

  // Replaces the progress line on a terminal; a no-op elsewhere.
  void progress(std::string_view line);
  void clear_progress();
  void flush();

 private:
  std::string write_files(LogLevel level, std::string_view message);  // returns the line

  std::mutex mu_;
  FILE* files_[4] = {nullptr, nullptr, nullptr, nullptr};
  int rank_;
  bool console_;
  bool progress_enabled_;
  bool progress_shown_ = false;
};

}  // namespace tessera
