#pragma once
// Pipeline parallelism's plan (Megatron-Core's schedules.py, without its overlap options): which
// layers each pipeline rank holds, in which order it runs the forward and backward passes of a
// step's micro-batches (1F1B, or interleaved 1F1B over model chunks), and when the stages
// exchange activations and their gradients.
//
// Rank s of P holds, with V model chunks per rank, chunk c = virtual stage c x P + s: a run of
// consecutive layers (virtual stage 0 also the embedding, the last one the final norm and
// output head). Activations flow virtual stage by virtual stage (rank s to s + 1, and from the
// last rank to rank 0 between chunks), their gradients back.
//
// The passes run in lockstep steps: in step t every rank runs at most one pass, and then posts
// one batch of sends and receives (Communicator::send_recv) with the transfers assigned to the
// step: an activation in the step before the pass that reads it, a gradient in the step that
// produced it. A transfer's send and receive are in the same step's batches on both ranks, so
// no batch waits for a later one and the schedule cannot deadlock, on NCCL as on the thread
// ranks. Each step's passes are placed as early as their inputs and the rank's order allow.
// A rank keeps a micro-batch's activations from its first input or pass to its last pass or
// send; the slots it needs at once (the stage's in-flight micro-batches) are counted here, so
// the model can plan them before the step starts.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/model/model.h"

namespace tessera::dist {

// Megatron's assignment of layers to the virtual stages of rank `rank`, in chunk order:
// evenly (num_layers / (P x V) per chunk), or with V = 1 and uneven first and last stages
// (first_stage_layers / last_stage_layers; 0: an even share of the rest).
std::vector<LayerRange> pipeline_layers(int64_t num_layers, int pipeline_size, int chunks,
                                        int64_t first_stage_layers, int64_t last_stage_layers,
                                        int rank);

struct PipelinePass {
  enum class Kind { Forward, Backward };
  Kind kind = Kind::Forward;
  int chunk = 0;
  int64_t micro_batch = 0;
  std::string str() const;  // "F1.3": forward of chunk 1, micro-batch 3
};

// One send or receive after a step: an activation (into the receiver's chunk input) or its
// gradient (into the receiver's chunk output gradient).
struct PipelineTransfer {
  bool send = false;
  int peer = 0;  // pipeline rank
  bool gradient = false;
  int chunk = 0;  // this rank's chunk it reads from (send) or writes into (receive)
  int64_t micro_batch = 0;
};

struct PipelineStep {
  std::optional<PipelinePass> pass;
  std::vector<PipelineTransfer> transfers;  // after the pass
};

class PipelineSchedule {
 public:
  // with_backward: a training step (1F1B, interleaved when chunks > 1, which needs
  // micro_batches a multiple of pipeline_size); else forward passes only (evaluation), every
  // micro-batch through every stage in order.
  PipelineSchedule(int pipeline_size, int chunks, int64_t micro_batches, bool with_backward);

  int pipeline_size() const { return pp_; }
  int chunks() const { return chunks_; }
  int64_t micro_batches() const { return micro_batches_; }
  // Rank `rank`'s passes in the order it runs them (Megatron's order).
  const std::vector<PipelinePass>& order(int rank) const { return order_[rank]; }
  // Its steps, the same count on every rank.
  const std::vector<PipelineStep>& steps(int rank) const { return steps_[rank]; }
  // The activation slot micro-batch m uses on `rank`, and how many the rank needs.
  int slot(int rank, int64_t m) const { return slot_[rank][m]; }
  int slots(int rank) const { return slots_[rank]; }

 private:
  int pp_, chunks_;
  int64_t micro_batches_;
  std::vector<std::vector<PipelinePass>> order_;
  std::vector<std::vector<PipelineStep>> steps_;
  std::vector<std::vector<int>> slot_;
  std::vector<int> slots_;
};

}  // namespace tessera::dist
