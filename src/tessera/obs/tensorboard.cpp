#include "tessera/obs/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

// Protocol buffer wire format: each field is a varint key (field number << 3 | wire type)
// followed by its value.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7f) | 0x80);
  out += static_cast<char>(v);
}

template <class T>
void put_little_endian(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

void put_key(std::string& out, uint32_t field, WireType type) {
  put_varint(out, field << 3 | type);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// An Event with its wall time (seconds since the epoch) and step; the caller appends the
// payload field.
std::string event_header(int64_t step) {
  const double wall_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string e;
  put_key(e, 1, kFixed64);
  put_little_endian(e, std::bit_cast<uint64_t>(wall_time));
  put_key(e, 2, kVarint);
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

std::string scalar_event(std::string_view tag, double value, int64_t step) {
  std::string v;  // Summary.Value
  put_bytes(v, 1, tag);
  put_key(v, 2, kFixed32);
  put_little_endian(v, std::bit_cast<uint32_t>(static_cast<float>(value)));
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(step);
  put_bytes(e, 5, summary);
  return e;
}

// TensorFlow's file name; <n> tells apart files one process opens within a second.
std::string event_file_name() {
  static std::atomic<int> counter{0};
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "localhost");
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  return fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", seconds, host, ::getpid(), counter++);
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  uint32_t c = 0xffffffffu;
  for (const char byte : data) c = kCrc32cTable[(c ^ static_cast<uint8_t>(byte)) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  path_ = (std::filesystem::path(dir) / event_file_name()).string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw Error(fmt::format("{}: cannot create TensorBoard event file", path_));
  std::string e = event_header(0);
  put_bytes(e, 3, "brain.Event:2");
  write_event(e);
  flush();
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::add_scalar(std::string_view tag, double value, int64_t step) {
  write_event(scalar_event(tag, value, step));
}

void EventFileWriter::write_event(const std::string& event) {
  std::string record;
  put_little_endian(record, static_cast<uint64_t>(event.size()));
  put_little_endian(record, masked_crc32c(record));
  record += event;
  put_little_endian(record, masked_crc32c(event));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    throw Error(fmt::format("{}: write failed (disk full?)", path_));
}

void EventFileWriter::flush() {
  if (std::fflush(file_) != 0) throw Error(fmt::format("{}: write failed (disk full?)", path_));
}

TrainingTensorBoard::TrainingTensorBoard(const LoggingConfig& config, const std::string& dir)
    : config_(config), file_(dir) {}

void TrainingTensorBoard::iteration(const IterationScalars& s) {
  const auto both = [&](const char* tag, double value) {
    file_.add_scalar(tag, value, s.iteration);
    file_.add_scalar(std::string(tag) + " vs samples", value,
                     static_cast<int64_t>(s.consumed_samples));
  };
  if (config_.log_learning_rate_to_tensorboard) both("learning-rate", s.learning_rate);
  both("batch-size", static_cast<double>(s.batch_size));
  both("lm loss", s.lm_loss);
  both("grad-norm", s.grad_norm);
  if (s.loss_tokens >= 0) both("loss-tokens", static_cast<double>(s.loss_tokens));
  for (const auto& [tag, value] : s.named) both(tag.c_str(), value);
  if (config_.log_memory_to_tensorboard) {
    file_.add_scalar("mem-allocated-bytes", s.mem_allocated_bytes, s.iteration);
    file_.add_scalar("mem-max-allocated-bytes", s.mem_max_allocated_bytes, s.iteration);
  }
  file_.flush();
}

void TrainingTensorBoard::interval(const IntervalScalars& s) {
  if (config_.log_timers_to_tensorboard) {
    // Megatron leaves out a time of the process's first iteration alone: start-up cost, which
    // would set the plot's scale.
    if (!(first_interval_ && s.iterations == 1))
      file_.add_scalar("iteration-time", s.seconds_per_iteration, s.iteration);
    file_.add_scalar("throughput", s.tflops_per_gpu, s.iteration);
  }
  if (config_.log_throughput_to_tensorboard) {
    const double gpus = static_cast<double>(s.gpus);
    file_.add_scalar("throughput/tflops/device", s.tflops_per_gpu, s.iteration);
    file_.add_scalar("throughput/tflops", s.tflops_per_gpu * gpus, s.iteration);
    file_.add_scalar("throughput/tokens_per_sec/device", s.tokens_per_s_per_gpu, s.iteration);
    file_.add_scalar("throughput/tokens_per_sec", s.tokens_per_s_per_gpu * gpus, s.iteration);
    if (s.packing_efficiency >= 0) {
      file_.add_scalar("throughput/real_tokens_per_sec/device",
                       s.tokens_per_s_per_gpu * s.packing_efficiency, s.iteration);
      file_.add_scalar("packing-efficiency", s.packing_efficiency, s.iteration);
    }
  }
  first_interval_ = false;
  file_.flush();
}

void TrainingTensorBoard::scalars(int64_t iteration,
                                  const std::vector<std::pair<std::string, double>>& tagged) {
  if (tagged.empty()) return;
  for (const auto& [tag, value] : tagged) file_.add_scalar(tag, value, iteration);
  file_.flush();
}

void TrainingTensorBoard::validation(int64_t iteration, uint64_t consumed_samples, double lm_loss) {
  const auto samples = static_cast<int64_t>(consumed_samples);
  file_.add_scalar("lm loss validation", lm_loss, iteration);
  file_.add_scalar("lm loss validation vs samples", lm_loss, samples);
  if (config_.log_validation_ppl_to_tensorboard) {
    // Megatron caps the exponent at 20, so an early, huge loss does not overflow the plot.
    const double ppl = std::exp(std::min(20.0, lm_loss));
    file_.add_scalar("lm loss validation ppl", ppl, iteration);
    file_.add_scalar("lm loss validation ppl vs samples", ppl, samples);
  }
  file_.flush();
}

void TrainingTensorBoard::validation_scalar(const std::string& tag, int64_t iteration, double value) {
  file_.add_scalar(tag, value, iteration);
  file_.flush();
}

}  // namespace tessera
