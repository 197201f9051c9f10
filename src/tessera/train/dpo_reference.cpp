#include "tessera/train/dpo_reference.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/json_fields.h"
#include "tessera/core/content_digest.h"
#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/data/index_cache.h"

namespace tessera {
namespace {

constexpr const char* kFormat = "tessera dpo reference log-probabilities 1";
static_assert(std::endian::native == std::endian::little, "the file's values are little-endian");

}  // namespace

std::string preference_dataset_digest(const std::string& prefix) {
  ContentDigest d;
  for (const std::string& p : {prefix, chat_roles_prefix(prefix)})
    for (const char* ext : {".idx", ".bin"}) d.add_file(p + ext);
  return d.hex();
}

std::string default_reference_logps_path(const DpoReferenceKey& key) {
  return key.dataset + "_reference_" +
         description_hash(fmt::format("{} {}", key.reference_digest, key.seq_length)).substr(0, 12) + ".logps";
}

DpoReferenceLogps::DpoReferenceLogps(std::string path, DpoReferenceKey key)
    : path_(std::move(path)), key_(std::move(key)),
      values_(2 * key_.pairs, std::numeric_limits<double>::quiet_NaN()) {
  std::ifstream in(path_, std::ios::binary);
  if (!in) {
    if (std::filesystem::exists(path_)) throw DataError(fmt::format("{}: cannot open for reading", path_));
    return;
  }
  std::string line;
  if (!std::getline(in, line) || line.size() > (1 << 16))
    throw DataError(fmt::format("{}: no header line; expected DPO reference log-probabilities "
                                "(written by a DPO run)", path_));
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded())
    throw DataError(fmt::format("{}: the header line is not JSON; expected DPO reference "
                                "log-probabilities (written by a DPO run)", path_));
  const JsonFields f(j, path_);
  if (f.string("format") != kFormat)
    f.fail("format", j["format"], fmt::format("\"{}\"", kFormat));
  // What changed, in the words of the keys and files a user would look at.
  auto refuse = [&](const std::string& what) {
    throw DataError(fmt::format("{}: reference log-probabilities computed {}. Remove the file to "
                                "compute them again, or name another with dpo_reference_logps",
                                path_, what));
  };
  const JsonFields dataset = f.object("dataset"), reference = f.object("reference");
  if (dataset.string("digest") != key_.dataset_digest)
    refuse(fmt::format("for the dataset {} as it was (digest {}); {} is now digest {}",
                       dataset.string("prefix"), dataset.string("digest"), key_.dataset,
                       key_.dataset_digest));
  if (reference.string("digest") != key_.reference_digest)
    refuse(fmt::format("with the reference {} (digest {}); this run's reference is {} (digest {})",
                       reference.string("weights"), reference.string("digest"), key_.reference,
                       key_.reference_digest));
  const int64_t seq = f.integer("seq_length", 1, kMaxJsonCounter);
  if (seq != key_.seq_length)
    refuse(fmt::format("with answers cut to seq_length {}; this run has seq_length {}", seq,
                       key_.seq_length));
  const int64_t pairs = f.integer("pairs", 0, kMaxJsonCounter);
  if (static_cast<uint64_t>(pairs) != key_.pairs)
    f.fail("pairs", j["pairs"], fmt::format("{}, the dataset's pair count", key_.pairs));
  const uint64_t expected = line.size() + 1 + values_.size() * sizeof(double);
  const uint64_t size = std::filesystem::file_size(path_);
  if (size != expected)
    throw DataError(fmt::format("{}: {} bytes; expected {} (the header line, then 2 x {} pairs of "
                                "float64): the file is damaged or was cut short",
                                path_, size, expected, pairs));
  in.read(reinterpret_cast<char*>(values_.data()),
          static_cast<std::streamsize>(values_.size() * sizeof(double)));
  if (!in) throw DataError(fmt::format("{}: read failed", path_));
  for (size_t i = 0; i < values_.size(); ++i)
    if (std::isinf(values_[i]) || values_[i] > 0)
      throw DataError(fmt::format("{}: pair {}'s {} log-probability is {}; expected a finite "
                                  "value <= 0 (or NaN: not computed)",
                                  path_, i / 2, i % 2 == 0 ? "chosen" : "rejected", values_[i]));
}

bool DpoReferenceLogps::has(uint64_t pair) const {
  return pair < key_.pairs && !std::isnan(values_[2 * pair]) && !std::isnan(values_[2 * pair + 1]);
}

std::array<double, 2> DpoReferenceLogps::at(uint64_t pair) const {
  if (!has(pair))
    throw Error(fmt::format("{}: pair {} has no reference log-probabilities", path_, pair));
  return {values_[2 * pair], values_[2 * pair + 1]};
}

void DpoReferenceLogps::set(uint64_t pair, const std::array<double, 2>& logps) {
  if (pair >= key_.pairs) throw Error(fmt::format("pair {} of {}", pair, key_.pairs));
  values_[2 * pair] = logps[0];
  values_[2 * pair + 1] = logps[1];
}

uint64_t DpoReferenceLogps::stored() const {
  uint64_t n = 0;
  for (uint64_t p = 0; p < key_.pairs; ++p) n += has(p) ? 1 : 0;
  return n;
}

void DpoReferenceLogps::save() const {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["dataset"] = {{"prefix", key_.dataset}, {"digest", key_.dataset_digest}};
  j["reference"] = {{"weights", key_.reference}, {"digest", key_.reference_digest}};
  j["seq_length"] = key_.seq_length;
  j["pairs"] = key_.pairs;
  std::string content = j.dump() + "\n";
  const size_t header = content.size();
  content.resize(header + values_.size() * sizeof(double));
  std::memcpy(content.data() + header, values_.data(), values_.size() * sizeof(double));
  write_file_atomically(path_, content);
}

}  // namespace tessera
