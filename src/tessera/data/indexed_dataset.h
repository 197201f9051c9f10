#pragma once
// Megatron's indexed dataset ("MMIDIDX" v1), byte for byte: PREFIX.bin holds the tokens of
// every sequence back to back; PREFIX.idx describes them (all little-endian):
//
//   9 bytes   magic "MMIDIDX\0\0"
//   uint64    version, 1
//   uint8     token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//             7 float32, 8 uint16
//   uint64    S, the sequence count
//   uint64    D, the document-index length: documents + 1 (it starts with a 0)
//   int32[S]  sequence lengths, in tokens
//   int64[S]  sequence byte offsets into PREFIX.bin
//   int64[D]  document index: document d holds sequences [index[d], index[d+1])
//
// Tessera (like Megatron's preprocess_data.py without sentence splitting) writes one sequence
// per document, so sequences and documents coincide.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/data/mapped_file.h"

namespace tessera {

enum class TokenDType : uint8_t {
  UInt8 = 1,
  Int8 = 2,
  Int16 = 3,
  Int32 = 4,
  Int64 = 5,
  Float64 = 6,
  Float32 = 7,
  UInt16 = 8,
};

const char* token_dtype_name(TokenDType dtype);
size_t token_dtype_size(TokenDType dtype);
// What preprocessing writes for a vocabulary, as Megatron does: uint16 below 65,500 ids,
// else int32.
TokenDType token_dtype_for_vocab(int64_t vocab);

class IndexedDataset {
 public:
  // Maps PREFIX.idx and PREFIX.bin and checks them against each other (header, lengths,
  // offsets, .bin size). With a vocabulary (> 0), also checks the token dtype is not wider
  // than that tokenizer needs (wider means the data came from another tokenizer), and every
  // read() checks its ids are below it. Throws DataError naming the file and what was
  // expected.
  explicit IndexedDataset(const std::string& prefix, int64_t vocab = 0,
                          const std::string& tokenizer_name = "");

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  uint64_t sequences() const { return sequences_; }
  uint64_t documents() const { return document_index_length_ - 1; }
  uint64_t tokens() const { return tokens_; }
  int32_t sequence_length(uint64_t i) const;
  int64_t document_start(uint64_t d) const;  // first sequence of document d (d <= documents())

  // Tokens [offset, offset + count) of sequence `seq`, widened to int32.
  void read(uint64_t seq, uint64_t offset, uint64_t count, int32_t* out) const;

 private:
  void check_index(uint64_t bin_bytes);
  int64_t sequence_pointer(uint64_t i) const;

  std::string prefix_;
  MappedFile idx_, bin_;
  TokenDType dtype_ = TokenDType::Int32;
  uint64_t sequences_ = 0, document_index_length_ = 0, tokens_ = 0;
  size_t lengths_at_ = 0, pointers_at_ = 0, documents_at_ = 0;  // byte offsets in .idx
  int64_t vocab_ = 0;
  std::string tokenizer_name_;
};

// Writes PREFIX.bin and PREFIX.idx under temporary names and renames them only in finish(),
// so a crash or error never leaves a half-written dataset under the real name. With
// `meta_json`, finish() also writes it as the dataset's record (dataset_meta_path), after the
// data: a crash in between leaves a dataset without a record, never one with a wrong record.
// A stale record of an earlier dataset under the same prefix is removed first. Throws
// DataError naming the file when a file cannot be created, written or renamed.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, TokenDType dtype, std::string meta_json = "");
  ~IndexedDatasetWriter();  // removes the temporary files unless finish() succeeded
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One document as one sequence. Throws DataError for an id the dtype cannot hold.
  void add_document(const int32_t* ids, size_t count);
  void finish();

  uint64_t documents() const { return lengths_.size(); }
  uint64_t tokens() const { return tokens_; }

 private:
  std::string prefix_, bin_tmp_, idx_tmp_, meta_tmp_, meta_json_;
  TokenDType dtype_;
  FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<uint8_t> scratch_;
  uint64_t tokens_ = 0;
  bool finished_ = false;
};

}  // namespace tessera
