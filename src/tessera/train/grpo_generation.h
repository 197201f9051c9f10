#pragma once
// GRPO's split placement (grpo_generation_gpus): the last ranks of the job only generate, the
// others train (NeMo-RL's non-colocated generation; the workflow's generation GPU beside the
// training GPUs). Before each generation batch and each evaluation the first training rank
// broadcasts the weights (compute dtype, flat layout) and the blocks' persistent state to the
// generation ranks; then every training rank sends its prompts with their random streams to its
// generation rank (its rank mod the number of generation ranks), which decodes everything it
// was sent together (continuous batching over all of it) and sends each its continuations.
// Both sides build the same ContinuationRequest from the experiment, so the completions are
// the ones the colocated run samples from the same weights.
//
// Messages are int32 words through device memory over the job's communicator (point to point);
// a double or a 64-bit integer takes two words.
#include <cstdint>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/distributed/communicator.h"
#include "tessera/model/continuations.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class ChatFormat;
class Logger;
class StopStrings;
class Tokenizer;

struct GrpoGenerationLink {
  dist::Communicator* job = nullptr;      // every rank: training 0 .. T-1, generation T .. T+K-1
  dist::Communicator* weights = nullptr;  // training rank 0 (its rank 0) and the generation ranks; null elsewhere
  int training_ranks = 1, generation_ranks = 1;
  // The job rank that decodes training rank r's prompts.
  int generation_rank_of(int training_rank) const {
    return training_ranks + training_rank % generation_ranks;
  }
};

// A job's communicators under split placement: the training ranks' own (null on a generation
// rank), and the link. Collective over `job`; none (nullopt) when every rank trains.
struct GrpoSplitJob {
  std::unique_ptr<dist::Communicator> training, weights;
  GrpoGenerationLink link;
  bool generates(int job_rank) const { return job_rank >= link.training_ranks; }
};
std::optional<GrpoSplitJob> split_grpo_job(dist::Communicator& job, const TrainingConfig& t);

// The tokenizer's chat template (its special tokens end a completion), or null when it has none.
std::unique_ptr<ChatFormat> grpo_chat_format(const DataConfig& d, const Tokenizer& tokenizer);

// What both sides continue prompts with: objective grpo's length limit, end tokens (the
// tokenizer's end of document and the chat template's special tokens) and stop strings, ids
// below `vocab`; sampling set per request.
ContinuationRequest grpo_continuation_request(const TrainingConfig& t, const Tokenizer& tokenizer,
                                              const ChatFormat* chat, const StopStrings& stop, int64_t vocab);

// A training rank's end of the link.
class GrpoGenerationClient {
 public:
  // `completions`: the most this rank asks for at once (its share of a generation batch or of
  // an evaluation).
  GrpoGenerationClient(const GrpoGenerationLink& link, Backend& backend, int rank, int64_t completions,
                       int64_t seq_length);
  // The first training rank tells the generation ranks to stop (not while an exception unwinds:
  // then the job ends them).
  ~GrpoGenerationClient();
  // The first training rank: the weights (laid out as the model's flat parameters) and the
  // blocks' state to the generation ranks, waited for, for the next request; the seconds it
  // took. Others: 0. A request without it is decoded with the weights they hold.
  double send_weights(const Tensor& params, std::vector<std::pair<std::string, Tensor>> state);
  // This rank's prompts continued on its generation rank, [prompt][stream], as continue_prompts
  // returns them, and the seconds the generation rank decoded them in (with the other ranks'
  // prompts). Every training rank calls it, after send_weights.
  struct Reply {
    std::vector<std::vector<Continuation>> continuations;
    double decode_s = 0;
  };
  Reply complete(const std::vector<PromptContinuations>& prompts, const SamplingOptions& sampling);
  // complete() in two halves, so that the generation rank decodes while this one trains: the
  // request sent (its ticket), then its continuations received (waited for). Any exchange in
  // between (send_weights, another request) first receives them and keeps them for receive().
  int request(const std::vector<PromptContinuations>& prompts, const SamplingOptions& sampling);
  Reply receive(int ticket);

 private:
  // The first training rank's word to the generation ranks before a round (grpo_generation.cpp).
  void broadcast_command(int32_t what, int64_t weights);
  // A message to or from this rank's generation rank.
  void with_generation_rank(dist::P2POp::Kind kind, const Tensor& words);
  // The continuations of the request in flight, waited for and kept.
  void take_reply();

  GrpoGenerationLink link_;
  Backend& backend_;
  int rank_ = 0;
  DeviceBuffer buffer_;
  bool commanded_ = false;  // the first training rank: the next round's command is sent (with weights)
  int tickets_ = 0;
  int in_flight_ = -1;  // the ticket of the request whose continuations are on their way (-1: none)
  size_t asked_ = 0;    // its prompts
  std::map<int, Reply> received_;  // not yet taken, by ticket
};

// A generation rank: serves the training ranks until the first says stop. Its weights and
// generator are laid out as the training ranks' model (the experiment on link.training_ranks
// ranks).
void serve_grpo_generation(const Experiment& e, Backend& backend, Logger& log, const GrpoGenerationLink& link,
                           const Tokenizer& tokenizer);

}  // namespace tessera
