#pragma once
// TensorBoard event files, written natively: TensorBoard reads a file of TFRecords, each an
// Event protocol buffer. Both layers are encoded here by hand (no TensorFlow, no protobuf
// library), and TrainingTensorBoard writes a training run's scalars under Megatron's tags, so
// a Tessera run and a Megatron run plot side by side in one TensorBoard.
//
// File:    events.out.tfevents.<unix seconds>.<host>.<pid>.<n>
// Record:  uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
//          (little-endian)
// Event:   wall_time = 1 (double), step = 2 (int64), file_version = 3 (string, the first
//          record: "brain.Event:2"), summary = 5 (Summary)
// Summary: value = 1 (repeated Value); Value: tag = 1 (string), simple_value = 2 (float)
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecords.
uint32_t crc32c(std::string_view data);
// What a TFRecord stores: the CRC rotated right by 15 bits plus 0xa282ead8 (a CRC of data that
// holds CRCs is otherwise weak).
uint32_t masked_crc32c(std::string_view data);

// One event file. Every scalar is a record of its own, as PyTorch's SummaryWriter writes them;
// flush() makes them visible to a TensorBoard reading the file while the run goes on.
class EventFileWriter {
 public:
  // Creates `dir` if needed and a new file in it, whose first record is the file version.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  void add_scalar(std::string_view tag, double value, int64_t step);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  FILE* file_ = nullptr;
  std::string path_;
};

// What Megatron's training_log writes every tensorboard_log_interval iterations: the values
// of that one iteration (not the log interval's mean).
struct IterationScalars {
  int64_t iteration = 0;
  uint64_t consumed_samples = 0;  // after the iteration
  int64_t batch_size = 0;         // global batch, in samples
  double lm_loss = 0;
  double learning_rate = 0;
  double grad_norm = 0;
  double mem_allocated_bytes = 0;
  double mem_max_allocated_bytes = 0;  // peak since training started
  int64_t loss_tokens = -1;  // with loss masks: the positions the loss counted; -1: all
  // Further statistics under their own tags (DPO's rewards/* and logps/*, TRL's names).
  std::vector<std::pair<std::string, double>> named;
};

// What it writes every log_interval iterations, over the interval.
struct IntervalScalars {
  int64_t iteration = 0;   // the interval's last
  int64_t iterations = 0;  // in the interval
  double seconds_per_iteration = 0;
  double tflops_per_gpu = 0;
  double tokens_per_s_per_gpu = 0;
  int64_t gpus = 1;
  double packing_efficiency = -1;  // with packing's padding: real tokens over slots; -1: none
};

// A run's scalars under Megatron's tags, the step being the iteration (and, for the
// "... vs samples" twins Megatron writes, the consumed samples). The log_*_to_tensorboard keys
// of `config` choose the optional ones (docs/configuration.md lists every tag).
class TrainingTensorBoard {
 public:
  TrainingTensorBoard(const LoggingConfig& config, const std::string& dir);

  void iteration(const IterationScalars& s);
  void interval(const IntervalScalars& s);
  void validation(int64_t iteration, uint64_t consumed_samples, double lm_loss);
  // A validation figure of another objective under `tag` (GRPO's held-out accuracy).
  void validation_scalar(const std::string& tag, int64_t iteration, double value);
  // A step's further figures under their own tags (a model's step hooks': the MoE balance
  // under Megatron's track_moe_metrics tags).
  void scalars(int64_t iteration, const std::vector<std::pair<std::string, double>>& tagged);
  const std::string& path() const { return file_.path(); }

 private:
  LoggingConfig config_;
  EventFileWriter file_;
  bool first_interval_ = true;
};

}  // namespace tessera
