#include "tessera/train/grpo_generation.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <exception>

#include <fmt/format.h>

#include "tessera/config/tokenizer_model.h"
#include "tessera/config/validate.h"
#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/data/stop_strings.h"
#include "tessera/data/tokenizer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/generator.h"
#include "tessera/obs/logger.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/run/run_setup.h"

namespace tessera {
namespace {

using Words = std::vector<int32_t>;

// What the first training rank tells the generation ranks before each round of requests: stop,
// take new weights first, or decode with the weights they hold.
constexpr int32_t kStop = 0, kNewWeights = 1, kSameWeights = 2;

void put_u64(Words& w, uint64_t v) {
  w.push_back(static_cast<int32_t>(static_cast<uint32_t>(v)));
  w.push_back(static_cast<int32_t>(static_cast<uint32_t>(v >> 32)));
}
void put_f64(Words& w, double v) { put_u64(w, std::bit_cast<uint64_t>(v)); }

// Reads a message's words in order, each read checked against its end.
class WordReader {
 public:
  explicit WordReader(std::span<const int32_t> words) : w_(words) {}
  int32_t next() {
    TS_CHECK(at_ < w_.size(), "grpo generation link: a message of {} words ended early", w_.size());
    return w_[at_++];
  }
  uint64_t next_u64() {
    const auto lo = static_cast<uint32_t>(next());
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(static_cast<uint32_t>(next())) << 32);
  }
  double next_f64() { return std::bit_cast<double>(next_u64()); }
  std::span<const int32_t> take(int64_t n) {
    TS_CHECK(n >= 0 && at_ + static_cast<size_t>(n) <= w_.size(), "grpo generation link: {} words past a message of {}",
             n, w_.size());
    const auto out = w_.subspan(at_, static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return out;
  }
  bool done() const { return at_ == w_.size(); }

 private:
  std::span<const int32_t> w_;
  size_t at_ = 0;
};

// A request: the sampling options, then each prompt's ids and its streams.
Words encode_request(const std::vector<PromptContinuations>& prompts, const SamplingOptions& s) {
  Words w;
  put_f64(w, s.temperature);
  put_u64(w, static_cast<uint64_t>(s.top_k));
  put_f64(w, s.top_p);
  put_f64(w, s.min_p);
  put_u64(w, s.seed);
  w.push_back(static_cast<int32_t>(prompts.size()));
  for (const PromptContinuations& p : prompts) {
    w.push_back(static_cast<int32_t>(p.prompt.size()));
    w.insert(w.end(), p.prompt.begin(), p.prompt.end());
    w.push_back(static_cast<int32_t>(p.streams.size()));
    w.insert(w.end(), p.streams.begin(), p.streams.end());
  }
  return w;
}

struct Request {
  SamplingOptions sampling;
  std::vector<std::vector<int32_t>> prompts, streams;
};

Request decode_request(std::span<const int32_t> words) {
  WordReader r(words);
  Request q;
  q.sampling.temperature = r.next_f64();
  q.sampling.top_k = static_cast<int64_t>(r.next_u64());
  q.sampling.top_p = r.next_f64();
  q.sampling.min_p = r.next_f64();
  q.sampling.seed = r.next_u64();
  const int32_t n = r.next();
  for (int32_t i = 0; i < n; ++i) {
    const auto ids = r.take(r.next());
    q.prompts.emplace_back(ids.begin(), ids.end());
    const auto streams = r.take(r.next());
    q.streams.emplace_back(streams.begin(), streams.end());
  }
  TS_CHECK(r.done(), "grpo generation link: a request with words after its last prompt");
  return q;
}

// A response: the decoding's seconds, then each prompt's continuations (ids, end, entropy, each
// id's log-probability).
Words encode_continuations(std::span<const std::vector<Continuation>> groups, double decode_s) {
  Words w;
  put_f64(w, decode_s);
  for (const std::vector<Continuation>& group : groups) {
    w.push_back(static_cast<int32_t>(group.size()));
    for (const Continuation& c : group) {
      w.push_back(static_cast<int32_t>(c.ids.size()));
      w.push_back(static_cast<int32_t>(c.end));
      put_f64(w, c.entropy_sum);
      w.insert(w.end(), c.ids.begin(), c.ids.end());
      for (const float logp : c.logps) w.push_back(std::bit_cast<int32_t>(logp));
    }
  }
  return w;
}

GrpoGenerationClient::Reply decode_continuations(std::span<const int32_t> words, size_t prompts) {
  WordReader r(words);
  GrpoGenerationClient::Reply reply;
  reply.decode_s = r.next_f64();
  std::vector<std::vector<Continuation>>& out = reply.continuations;
  out.resize(prompts);
  for (std::vector<Continuation>& group : out) {
    group.resize(static_cast<size_t>(r.next()));
    for (Continuation& c : group) {
      const int32_t n = r.next();
      c.end = static_cast<Continuation::End>(r.next());
      c.entropy_sum = r.next_f64();
      const auto ids = r.take(n);
      c.ids.assign(ids.begin(), ids.end());
      for (const int32_t bits : r.take(n)) c.logps.push_back(std::bit_cast<float>(bits));
    }
  }
  TS_CHECK(r.done(), "grpo generation link: a response with words after its last continuation");
  return reply;
}

// Words of the link's device buffer as a tensor.
Tensor words_at(const DeviceBuffer& buffer, int64_t from, int64_t count) {
  return buffer.tensor(DType::I32, {static_cast<int64_t>(buffer.bytes() / 4)}).flat_range(from, count);
}

// The command the first training rank broadcasts: what follows, and the weights' elements.
Words command(int32_t what, int64_t weights) {
  Words w{what};
  put_u64(w, static_cast<uint64_t>(weights));
  return w;
}
constexpr int64_t kCommandWords = 3;

// The blocks' state in name order, as both sides hold it.
std::vector<std::pair<std::string, Tensor>> by_name(std::vector<std::pair<std::string, Tensor>> state) {
  std::sort(state.begin(), state.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return state;
}

}  // namespace

std::optional<GrpoSplitJob> split_grpo_job(dist::Communicator& job, const TrainingConfig& t) {
  const int rank = job.rank(), training_ranks = grpo_training_ranks(t, job.size());
  if (training_ranks == job.size()) return std::nullopt;
  GrpoSplitJob s;
  s.training = job.split(rank < training_ranks ? 0 : -1, rank, "grpo_training");
  s.weights = job.split(rank == 0 || rank >= training_ranks ? 0 : -1, rank, "grpo_weights");
  s.link = GrpoGenerationLink{&job, s.weights.get(), training_ranks, job.size() - training_ranks};
  return s;
}

std::unique_ptr<ChatFormat> grpo_chat_format(const DataConfig& d, const Tokenizer& tokenizer) {
  if (d.tokenizer_type != TokenizerType::HuggingFace) return nullptr;
  try {
    return std::make_unique<ChatFormat>(tokenizer_json_path(d.tokenizer_model), tokenizer);
  } catch (const DataError&) {
    return nullptr;
  }
}

ContinuationRequest grpo_continuation_request(const TrainingConfig& t, const Tokenizer& tokenizer,
                                              const ChatFormat* chat, const StopStrings& stop, int64_t vocab) {
  ContinuationRequest request;
  request.max_new_tokens = t.grpo_max_completion_length;
  request.vocab = std::min<int64_t>(tokenizer.vocab_size(), vocab);
  request.is_end_token = [&tokenizer, chat](int32_t token) {
    return token == tokenizer.eod_id() || (chat && chat->is_special(token));
  };
  if (!stop.empty()) request.stopped = [&stop](std::span<const int32_t> ids) { return stop.stopped(ids); };
  return request;
}

GrpoGenerationClient::GrpoGenerationClient(const GrpoGenerationLink& link, Backend& backend, int rank,
                                           int64_t completions, int64_t seq_length)
    : link_(link),
      backend_(backend),
      rank_(rank),
      buffer_(backend, plan::grpo_link_bytes(completions, seq_length), "grpo generation link") {}

GrpoGenerationClient::~GrpoGenerationClient() {
  if (std::uncaught_exceptions() > 0) return;  // the job ends the generation ranks
  try {
    if (in_flight_ >= 0) take_reply();  // a batch asked for ahead that the run ended before
    if (!link_.weights || rank_ != 0) return;
    broadcast_command(kStop, 0);
    backend_.synchronize();
  } catch (const std::exception&) {
    // The job ends the generation ranks when this one exits.
  }
}

double GrpoGenerationClient::send_weights(const Tensor& params, std::vector<std::pair<std::string, Tensor>> state) {
  if (in_flight_ >= 0) take_reply();  // the generation rank sends it before it takes a command
  if (!link_.weights || rank_ != 0) return 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  broadcast_command(kNewWeights, params.numel());
  commanded_ = true;
  link_.weights->broadcast(params, 0, dist::Lane::Compute);
  for (const auto& [name, tensor] : by_name(std::move(state))) link_.weights->broadcast(tensor, 0, dist::Lane::Compute);
  backend_.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int GrpoGenerationClient::request(const std::vector<PromptContinuations>& prompts, const SamplingOptions& sampling) {
  if (in_flight_ >= 0) take_reply();
  if (link_.weights && rank_ == 0 && !commanded_) broadcast_command(kSameWeights, 0);  // the weights they hold
  commanded_ = false;
  const Words words = encode_request(prompts, sampling);
  const auto capacity = static_cast<int64_t>(buffer_.bytes() / 4) - 1;
  TS_CHECK(static_cast<int64_t>(words.size()) <= capacity, "grpo generation link: a request of {} words, room for {}",
           words.size(), capacity);
  const int32_t size = static_cast<int32_t>(words.size());
  backend_.upload(words_at(buffer_, 0, 1), &size);
  with_generation_rank(dist::P2POp::Kind::Send, words_at(buffer_, 0, 1));
  backend_.upload(words_at(buffer_, 1, size), words.data());
  with_generation_rank(dist::P2POp::Kind::Send, words_at(buffer_, 1, size));
  asked_ = prompts.size();
  in_flight_ = tickets_++;
  return in_flight_;
}

void GrpoGenerationClient::broadcast_command(int32_t what, int64_t weights) {
  const Words words = command(what, weights);
  const Tensor t = words_at(buffer_, 0, kCommandWords);
  backend_.upload(t, words.data());
  link_.weights->broadcast(t, 0, dist::Lane::Compute);
}

void GrpoGenerationClient::with_generation_rank(dist::P2POp::Kind kind, const Tensor& words) {
  link_.job->send_recv(std::vector<dist::P2POp>{{kind, words, link_.generation_rank_of(rank_)}}, dist::Lane::Compute);
}

void GrpoGenerationClient::take_reply() {
  const auto capacity = static_cast<int64_t>(buffer_.bytes() / 4) - 1;
  int32_t reply = 0;
  with_generation_rank(dist::P2POp::Kind::Recv, words_at(buffer_, 0, 1));
  backend_.download(&reply, words_at(buffer_, 0, 1));
  TS_CHECK(reply >= 0 && reply <= capacity, "grpo generation link: a response of {} words, room for {}", reply, capacity);
  Words words(static_cast<size_t>(reply));
  with_generation_rank(dist::P2POp::Kind::Recv, words_at(buffer_, 1, reply));
  backend_.download(words.data(), words_at(buffer_, 1, reply));
  received_[in_flight_] = decode_continuations(words, asked_);
  in_flight_ = -1;
}

GrpoGenerationClient::Reply GrpoGenerationClient::receive(int ticket) {
  if (in_flight_ == ticket) take_reply();
  const auto it = received_.find(ticket);
  TS_CHECK(it != received_.end(), "grpo generation link: no continuations of request {}", ticket);
  Reply out = std::move(it->second);
  received_.erase(it);
  return out;
}

GrpoGenerationClient::Reply GrpoGenerationClient::complete(const std::vector<PromptContinuations>& prompts,
                                                           const SamplingOptions& sampling) {
  return receive(request(prompts, sampling));
}

namespace {

// A generation rank's messages with the training ranks it serves, through a device buffer that
// grows to the largest round.
class ServedRanks {
 public:
  ServedRanks(dist::Communicator& job, Backend& backend, std::vector<int> ranks, int64_t words)
      : job_(job), backend_(backend), ranks_(std::move(ranks)), buffer_(backend, static_cast<size_t>(words) * 4, "grpo generation link") {}
  const std::vector<int>& ranks() const { return ranks_; }

  // The first training rank's command (kCommandWords), broadcast over `weights`.
  Words command(dist::Communicator& weights) {
    Words cmd(kCommandWords);
    weights.broadcast(words_at(buffer_, 0, kCommandWords), 0, dist::Lane::Compute);
    backend_.download(cmd.data(), words_at(buffer_, 0, kCommandWords));
    return cmd;
  }

  // Every served rank's request, in rank order: the sizes, then the words.
  std::vector<Request> requests() {
    const auto sizes = exchange_sizes(dist::P2POp::Kind::Recv, {});
    int64_t total = 0;
    for (const int32_t size : sizes) total += size;
    ensure(n() + total);
    std::vector<dist::P2POp> ops;
    for (int64_t i = 0, at = n(); i < n(); at += sizes[index(i)], ++i)
      ops.push_back({dist::P2POp::Kind::Recv, words_at(buffer_, at, sizes[index(i)]), ranks_[index(i)]});
    job_.send_recv(ops, dist::Lane::Compute);
    Words all(static_cast<size_t>(total));
    backend_.download(all.data(), words_at(buffer_, n(), total));
    std::vector<Request> out;
    for (int64_t i = 0, at = 0; i < n(); at += sizes[index(i)], ++i)
      out.push_back(decode_request(std::span<const int32_t>(all).subspan(index(at), index(sizes[index(i)]))));
    return out;
  }

  // Each served rank's reply: the sizes, then the words.
  void reply(const std::vector<Words>& replies) {
    std::vector<int32_t> sizes;
    int64_t total = 0;
    for (const Words& w : replies) sizes.push_back(static_cast<int32_t>(w.size())), total += static_cast<int64_t>(w.size());
    ensure(n() + total);
    exchange_sizes(dist::P2POp::Kind::Send, sizes);
    std::vector<dist::P2POp> ops;
    for (int64_t i = 0, at = n(); i < n(); at += sizes[index(i)], ++i) {
      backend_.upload(words_at(buffer_, at, sizes[index(i)]), replies[index(i)].data());
      ops.push_back({dist::P2POp::Kind::Send, words_at(buffer_, at, sizes[index(i)]), ranks_[index(i)]});
    }
    job_.send_recv(ops, dist::Lane::Compute);
  }

 private:
  static size_t index(int64_t i) { return static_cast<size_t>(i); }
  int64_t n() const { return static_cast<int64_t>(ranks_.size()); }
  void ensure(int64_t words) {
    if (static_cast<int64_t>(buffer_.bytes() / 4) < words)
      buffer_ = DeviceBuffer(backend_, static_cast<size_t>(words) * 4, "grpo generation link");
  }
  // One word per served rank, received (sizes empty) or sent.
  std::vector<int32_t> exchange_sizes(dist::P2POp::Kind kind, std::vector<int32_t> sizes) {
    if (kind == dist::P2POp::Kind::Send) backend_.upload(words_at(buffer_, 0, n()), sizes.data());
    std::vector<dist::P2POp> ops;
    for (int64_t i = 0; i < n(); ++i) ops.push_back({kind, words_at(buffer_, i, 1), ranks_[index(i)]});
    job_.send_recv(ops, dist::Lane::Compute);
    if (kind == dist::P2POp::Kind::Recv) {
      sizes.resize(index(n()));
      backend_.download(sizes.data(), words_at(buffer_, 0, n()));
    }
    return sizes;
  }

  dist::Communicator& job_;
  Backend& backend_;
  std::vector<int> ranks_;
  DeviceBuffer buffer_;
};

}  // namespace

void serve_grpo_generation(const Experiment& e, Backend& backend, Logger& log, const GrpoGenerationLink& link,
                           const Tokenizer& tokenizer) {
  const TrainingConfig& t = e.training;
  dist::Communicator& job = *link.job;
  TS_CHECK(link.weights, "a generation rank without the weights' communicator");
  const RunSetup setup =
      make_run_setup(e, {link.training_ranks, backend.default_compute_dtype(), 0}, [&] { return tokenizer.vocab_size(); });
  const ParamLayout layout = DecoderModel::plan_layout(setup.spec, setup.runtime);
  const DType dtype = setup.runtime.compute_dtype;
  std::vector<int> served;
  for (int r = 0; r < link.training_ranks; ++r)
    if (link.generation_rank_of(r) == job.rank()) served.push_back(r);
  const GrpoGenerationShare share =
      grpo_generation_share(e, link.training_ranks, static_cast<int64_t>(served.size()));
  const int64_t slots = share.slots;
  DeviceBuffer weights(backend, static_cast<size_t>(layout.total) * dtype_size(dtype), "generation weights");
  const Tensor params = weights.tensor(dtype, {layout.total});
  Generator generator(backend, setup.spec, params, layout, t.seq_length, slots);
  const std::unique_ptr<ChatFormat> chat = grpo_chat_format(e.data, tokenizer);
  const StopStrings stop(tokenizer, parse_stop_strings(t.grpo_stop_strings));
  ContinuationRequest request = grpo_continuation_request(t, tokenizer, chat.get(), stop, setup.spec.vocab_size);
  log.info("grpo generation rank {}: decodes for training rank{} {}; weights {:.3f} GiB, {} sequences at once",
           job.rank(), served.size() == 1 ? "" : "s", fmt::join(served, ", "),
           static_cast<double>(weights.bytes()) / (1024.0 * 1024.0 * 1024.0), slots);

  ServedRanks ranks(job, backend, served,
                    static_cast<int64_t>(plan::grpo_link_bytes(share.link_completions, t.seq_length) / 4));
  for (int64_t rounds = 0;; ++rounds) {
    const Words order = ranks.command(*link.weights);
    WordReader c(order);
    const int32_t what = c.next();
    const auto elements = static_cast<int64_t>(c.next_u64());
    if (what == kStop) {
      log.info("grpo generation rank {}: stopped after {} rounds of requests", job.rank(), rounds);
      return;
    }
    TS_CHECK((what == kNewWeights && elements == layout.total) || what == kSameWeights,
             "grpo generation link: command {} with {} weights, expected {} (the training ranks' layout)", what,
             elements, layout.total);
    if (what == kNewWeights) {
      link.weights->broadcast(params, 0, dist::Lane::Compute);
      for (const auto& [name, tensor] : by_name(generator.state())) link.weights->broadcast(tensor, 0, dist::Lane::Compute);
    }
    // Every rank's prompts decoded together; each its own continuations back.
    const std::vector<Request> requests = ranks.requests();
    std::vector<PromptContinuations> prompts;
    for (const Request& q : requests) {
      const SamplingOptions& s = requests.front().sampling;
      TS_CHECK(q.sampling.temperature == s.temperature && q.sampling.top_k == s.top_k && q.sampling.top_p == s.top_p &&
                   q.sampling.min_p == s.min_p && q.sampling.seed == s.seed,
               "grpo generation link: training ranks asked with different sampling options");
      for (size_t p = 0; p < q.prompts.size(); ++p) prompts.push_back({q.prompts[p], q.streams[p]});
    }
    request.sampling = requests.front().sampling;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::vector<Continuation>> done = continue_prompts(generator, prompts, request);
    const double decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<Words> replies;
    size_t from = 0;
    for (const Request& q : requests) {
      replies.push_back(encode_continuations(std::span(done).subspan(from, q.prompts.size()), decode_s));
      from += q.prompts.size();
    }
    ranks.reply(replies);
  }
}

}  // namespace tessera
