#include "tessera/data/bpe_model.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/data/bpe_unicode.h"

namespace tessera {
namespace {

constexpr uint64_t kNoPair = ~uint64_t{0};
// Words worth caching: nearly all are short, and long ones would crowd out the common ones.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kCacheShards = 64;                    // locks, so that threads rarely wait
constexpr size_t kMaxWordsPerShard = size_t{1} << 11;  // a full shard starts over
constexpr size_t kMaxUnusedIds = size_t{1} << 20;      // 32 MB of empty names at most

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 for
// U+0100 onwards, in byte order.
struct ByteAlphabet {
  int16_t byte_of[0x144];  // -1: no byte
  ByteAlphabet() {
    std::fill(std::begin(byte_of), std::end(byte_of), int16_t{-1});
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_of[printable ? b : next++] = static_cast<int16_t>(b);
    }
  }
};

// The raw bytes of a token spelled in the byte-level alphabet; nullopt if it is not.
std::optional<std::string> unmap_bytes(std::string_view token) {
  static const ByteAlphabet alphabet;
  std::string bytes;
  const char* p = token.data();
  const char* end = p + token.size();
  while (p < end) {
    char32_t cp;
    const int n = unicode::decode_utf8(p, end, &cp);
    if (n == 0 || cp >= std::size(alphabet.byte_of) || alphabet.byte_of[cp] < 0)
      return std::nullopt;
    bytes.push_back(static_cast<char>(alphabet.byte_of[cp]));
    p += n;
  }
  return bytes;
}

size_t hash_word(std::string_view word) {
  return std::hash<std::string_view>{}(word);
}

uint32_t word_tag(std::string_view word, size_t hash) {
  return (static_cast<uint32_t>(hash >> 32) & ~0xFFu) |
         static_cast<uint32_t>(std::min<size_t>(word.size(), 255));
}

uint64_t word_head(std::string_view word) {
  uint64_t head = 0;
  std::memcpy(&head, word.data(), std::min<size_t>(word.size(), sizeof(head)));
  return head;
}

size_t hash_pair(uint64_t pair) {
  const uint64_t h = pair * 0x9E3779B97F4A7C15ull;
  return static_cast<size_t>(h ^ h >> 32);
}

// At most half full.
size_t table_size(size_t entries) {
  return std::bit_ceil(std::max<size_t>(16, 2 * entries));
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// The ids of words already encoded: real text repeats the same words constantly. Shared by
// all threads (not per thread: callers start threads per batch, which would start cold).
struct BpeModel::WordCache {
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
  };
  Shard shards[kCacheShards];
  Shard& shard(std::string_view word) { return shards[StringHash{}(word) % kCacheShards]; }
};

BpeModel::~BpeModel() = default;

BpeModel::BpeModel(const BpeModelOptions& options,
                   const std::vector<std::pair<std::string_view, int32_t>>& vocab,
                   const std::vector<std::pair<std::string_view, std::string_view>>& merges,
                   const std::string& source)
    : options_(options), cache_(std::make_unique<WordCache>()) {
  int32_t id_end = 0;
  for (const auto& [token, id] : vocab) {
    if (id < 0)
      throw DataError(fmt::format("{}: token '{}' has a negative id {}", source, token, id));
    // The id table is sized by the largest id. A vocabulary may leave ids unused, as Hugging
    // Face's does, but an id far past its size is a number the file merely claims (2^31 of
    // them would be 64 GB of empty names), so the unused ids are bounded.
    if (static_cast<size_t>(id) >= vocab.size() + kMaxUnusedIds)
      throw DataError(fmt::format(
          "{}: token '{}' has id {}, but model.vocab has {} tokens; expected ids below {} "
          "(a vocabulary may leave ids unused, not more than {} of them)",
          source, token, id, vocab.size(), vocab.size() + kMaxUnusedIds, kMaxUnusedIds));
    id_end = std::max(id_end, id + 1);
  }
  words_.resize(static_cast<size_t>(id_end));
  word_slots_.assign(table_size(vocab.size()), WordSlot{0, 0, -1});
  const size_t mask = word_slots_.size() - 1;
  for (const auto& [token, id] : vocab) {
    std::optional<std::string> word = options_.byte_level ? unmap_bytes(token) : std::string(token);
    if (!word)
      throw DataError(
          fmt::format("{}: token '{}' (id {}) is not spelled in the byte-level "
                      "alphabet that its ByteLevel pre-tokenizer implies",
                      source, token, id));
    const size_t h = hash_word(*word);
    size_t i = h & mask;
    while (word_slots_[i].id >= 0) i = (i + 1) & mask;
    word_slots_[i] = {word_head(*word), word_tag(*word, h), id};
    words_[static_cast<size_t>(id)] = std::move(*word);
  }

  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(fallback_ids_), std::end(fallback_ids_), -1);
  if (options_.byte_level) {
    for (int b = 0; b < 256; ++b) {
      const auto id = find_word(std::string(1, static_cast<char>(b)));
      if (!id)
        throw DataError(
            fmt::format("{}: the byte-level vocabulary has no token for byte 0x{:02X}", source, b));
      byte_ids_[b] = *id;
    }
  } else {
    bool all_bytes = options_.byte_fallback;
    for (int b = 0; b < 256 && all_bytes; ++b) {
      const auto id = find_word(fmt::format("<0x{:02X}>", b));
      all_bytes = id.has_value();
      fallback_ids_[b] = id.value_or(-1);
    }
    if (!all_bytes) std::fill(std::begin(fallback_ids_), std::end(fallback_ids_), -1);
    if (!options_.unk_token.empty()) {
      const auto unk = find_word(options_.unk_token);
      if (!unk)
        throw DataError(
            fmt::format("{}: unk_token '{}' is not in the vocabulary", source, options_.unk_token));
      unk_id_ = *unk;
    }
    if (!all_bytes && unk_id_ < 0)
      throw DataError(
          fmt::format("{}: characters outside the vocabulary cannot be encoded: "
                      "expected byte_fallback with tokens <0x00>..<0xFF>, or an "
                      "unk_token",
                      source));
  }

  merge_slots_.assign(table_size(merges.size()), MergeSlot{kNoPair, 0, 0});
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    joined.assign(left).append(right);
    const auto l = find_token(left), r = find_token(right), m = find_token(joined);
    if (!l || !r || !m)
      throw DataError(
          fmt::format("{}: merge {} ('{}' + '{}') involves a token that is not in the "
                      "vocabulary",
                      source, rank, left, right));
    add_merge(*l, *r, static_cast<int32_t>(rank), *m);
  }
}

std::optional<int32_t> BpeModel::find_word(std::string_view word) const {
  const size_t h = hash_word(word);
  const uint32_t tag = word_tag(word, h);
  const uint64_t head = word_head(word);
  const size_t mask = word_slots_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    const WordSlot& s = word_slots_[i];
    if (s.id < 0) return std::nullopt;
    if (s.tag == tag && s.head == head &&
        (word.size() <= sizeof(head) || words_[static_cast<size_t>(s.id)] == word))
      return s.id;
  }
}

std::optional<int32_t> BpeModel::find_token(std::string_view token) const {
  if (!options_.byte_level) return find_word(token);
  const auto bytes = unmap_bytes(token);
  return bytes ? find_word(*bytes) : std::nullopt;
}

int BpeModel::fallback_byte(int32_t id) const {
  const std::string& w = word(id);
  if (fallback_ids_[0] < 0 || w.size() != 6 || !w.starts_with("<0x") || w[5] != '>') return -1;
  const int b = std::stoi(w.substr(3, 2), nullptr, 16);
  return fallback_ids_[b] == id ? b : -1;
}

void BpeModel::add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  const uint64_t pair = uint64_t{static_cast<uint32_t>(left)} << 32 | static_cast<uint32_t>(right);
  const size_t mask = merge_slots_.size() - 1;
  size_t i = hash_pair(pair) & mask;
  // A pair listed twice keeps its last rank, as both reference implementations do.
  while (merge_slots_[i].pair != kNoPair && merge_slots_[i].pair != pair) i = (i + 1) & mask;
  merge_slots_[i] = {pair, rank, merged};
}

const BpeModel::MergeSlot* BpeModel::find_merge(int32_t left, int32_t right) const {
  const uint64_t pair = uint64_t{static_cast<uint32_t>(left)} << 32 | static_cast<uint32_t>(right);
  const size_t mask = merge_slots_.size() - 1;
  for (size_t i = hash_pair(pair) & mask;; i = (i + 1) & mask) {
    const MergeSlot& s = merge_slots_[i];
    if (s.pair == pair) return &s;
    if (s.pair == kNoPair) return nullptr;
  }
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>* symbols) const {
  if (options_.byte_level) {
    for (unsigned char b : word) symbols->push_back(byte_ids_[b]);
    return;
  }
  bool last_unknown = false;
  const char* p = word.data();
  const char* end = p + word.size();
  while (p < end) {
    char32_t cp;
    const int n = std::max(1, unicode::decode_utf8(p, end, &cp));  // an invalid byte stands alone
    const std::string_view ch(p, static_cast<size_t>(n));
    p += n;
    if (const auto id = find_word(ch)) {
      symbols->push_back(*id);
      last_unknown = false;
    } else if (fallback_ids_[0] >= 0) {
      for (unsigned char b : ch) symbols->push_back(fallback_ids_[b]);
      last_unknown = false;
    } else {
      if (!(options_.fuse_unk && last_unknown)) symbols->push_back(unk_id_);
      last_unknown = true;
    }
  }
}

// Applies merges lowest rank first, the leftmost pair first among equal ranks (both reference
// implementations' order), with a heap of candidate pairs over a linked list of symbols:
// O(n log n), which matters for long words (SentencePiece models see whole sentences).
void BpeModel::merge(std::vector<int32_t>* symbols) const {
  std::vector<int32_t>& ids = *symbols;
  const auto n = static_cast<int32_t>(ids.size());
  if (n < 2) return;
  struct Candidate {
    int32_t rank, pos, left, right, merged;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  thread_local std::vector<Candidate> heap;
  thread_local std::vector<int32_t> prev, next;
  heap.clear();
  prev.resize(static_cast<size_t>(n));
  next.resize(static_cast<size_t>(n));
  const auto candidate = [&](int32_t pos, int32_t right_pos) {
    if (const MergeSlot* m = find_merge(ids[pos], ids[right_pos])) {
      heap.push_back({m->rank, pos, ids[pos], ids[right_pos], m->merged});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1;
    if (i + 1 < n) candidate(i, i + 1);
  }
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    // Symbols only ever grow, so a candidate whose two ids are still in place is current.
    const int32_t right = next[c.pos];
    if (ids[c.pos] != c.left || right >= n || ids[right] != c.right) continue;
    ids[c.pos] = c.merged;
    ids[right] = -1;
    next[c.pos] = next[right];
    if (next[c.pos] < n) prev[next[c.pos]] = c.pos;
    if (prev[c.pos] >= 0) candidate(prev[c.pos], c.pos);
    if (next[c.pos] < n) candidate(c.pos, next[c.pos]);
  }
  int32_t kept = 0;
  for (int32_t i = 0; i < n; i = next[i]) ids[kept++] = ids[i];
  ids.resize(static_cast<size_t>(kept));
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (options_.byte_level && word.size() == 1) {
    out->push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (options_.ignore_merges) {
    if (const auto id = find_word(word)) {
      out->push_back(*id);
      return;
    }
  }
  WordCache::Shard& shard = cache_->shard(word);
  {
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (const auto it = shard.words.find(word); it != shard.words.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  initial_symbols(word, &ids);
  merge(&ids);
  out->insert(out->end(), ids.begin(), ids.end());
  if (word.size() > kMaxCachedWordBytes) return;
  std::lock_guard<std::mutex> lock(shard.mutex);
  if (shard.words.size() >= kMaxWordsPerShard) shard.words.clear();
  shard.words.emplace(word, std::move(ids));
}

}  // namespace tessera
