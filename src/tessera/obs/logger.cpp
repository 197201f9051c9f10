#include "tessera/obs/logger.h"

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr const char* kLevelNames[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
constexpr const char* kFileNames[] = {"debug.log", "info.log", "warning.log", "error.log"};

std::string timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format("{}.{:03d}", buf, ms);
}

}  // namespace

Logger::Logger(const std::string& rank_dir, int rank, bool console, bool progress)
    : rank_(rank), console_(console), progress_enabled_(progress && console && isatty(STDOUT_FILENO)) {
  if (rank_dir.empty()) return;
  std::filesystem::create_directories(rank_dir);
  for (int i = 0; i < 4; ++i) {
    const std::string path = rank_dir + "/" + kFileNames[i];
    files_[i] = std::fopen(path.c_str(), "a");
    if (!files_[i]) throw Error(fmt::format("{}: cannot open log file for writing", path));
  }
}

Logger::~Logger() {
  clear_progress();
  for (FILE* f : files_)
    if (f) std::fclose(f);
}

std::string Logger::write_files(LogLevel level, std::string_view message) {
  const int lv = static_cast<int>(level);
  std::string line =
      fmt::format("[{}][rank-{}][{}] {}\n", timestamp(), rank_, kLevelNames[lv], message);
  for (int i = 0; i <= lv; ++i)
    if (files_[i]) std::fputs(line.c_str(), files_[i]);
  // Warnings and errors should survive a crash right after them.
  if (level >= LogLevel::Warning)
    for (FILE* f : files_)
      if (f) std::fflush(f);
  return line;
}

void Logger::record(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> lock(mu_);
  write_files(level, message);
}

void Logger::log(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string line = write_files(level, message);
  const bool to_console = (console_ && level >= LogLevel::Info) || level >= LogLevel::Warning;
  if (!to_console) return;
  if (progress_shown_) {
    std::fputs("\r\033[K", stdout);
    progress_shown_ = false;
  }
  FILE* out = level >= LogLevel::Warning ? stderr : stdout;
  std::fputs(line.c_str(), out);
  std::fflush(out);
}

void Logger::progress(std::string_view line) {
  if (!progress_enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  fmt::print(stdout, "\r\033[K{}", line);
  std::fflush(stdout);
  progress_shown_ = true;
}

void Logger::clear_progress() {
  if (!progress_shown_) return;
  std::fputs("\r\033[K", stdout);
  std::fflush(stdout);
  progress_shown_ = false;
}

void Logger::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  for (FILE* f : files_)
    if (f) std::fflush(f);
  std::fflush(stdout);
}

}  // namespace tessera
