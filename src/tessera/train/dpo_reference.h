#pragma once
// The reference's log-probabilities of a preference dataset's pairs (TRL's
// precompute_ref_log_probs), kept in a file beside the dataset: a later run from the same
// reference, and a resumed run (whose starting weights are gone), read them instead of
// computing them again. The file is keyed by everything the values depend on: the dataset's
// content, the reference weights' content and the sequence length the answers are cut to.
//
// Format (docs/formats.md): one line of JSON (the key and the pair count), then two
// little-endian float64 per pair of the dataset, chosen then rejected; NaN where a pair has
// not been computed.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct DpoReferenceKey {
  std::string dataset;           // the data_path prefix, for messages
  std::string dataset_digest;    // of its tokens' and roles' files
  uint64_t pairs = 0;            // in the dataset
  std::string reference;         // where the reference weights came from, for messages
  std::string reference_digest;  // of those weights and the model they are loaded into
  int64_t seq_length = 0;
};

// The digest of a preference dataset: its tokens' and roles' .bin and .idx files.
std::string preference_dataset_digest(const std::string& prefix);

// Where a run keeps the values for `key` unless dpo_reference_logps names a file: beside the
// dataset, named after the reference and the sequence length, so that runs from other
// references or lengths keep their own file.
std::string default_reference_logps_path(const DpoReferenceKey& key);

class DpoReferenceLogps {
 public:
  // The values stored at `path` for `key`, or none yet when there is no file. A file for
  // another key (the dataset or reference changed, another seq_length) or a damaged one is a
  // DataError naming the file and what differs.
  DpoReferenceLogps(std::string path, DpoReferenceKey key);

  bool has(uint64_t pair) const;
  std::array<double, 2> at(uint64_t pair) const;  // chosen, rejected; has(pair) required
  void set(uint64_t pair, const std::array<double, 2>& logps);
  uint64_t stored() const;  // pairs with values
  // Writes every value: to a temporary name, renamed over path() when complete.
  void save() const;
  const std::string& path() const { return path_; }
  const DpoReferenceKey& key() const { return key_; }

 private:
  std::string path_;
  DpoReferenceKey key_;
  std::vector<double> values_;  // 2 x pairs
};

}  // namespace tessera
