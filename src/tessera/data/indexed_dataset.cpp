#include "tessera/data/indexed_dataset.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

// The index's arrays start at byte 34, so their elements are unaligned: read them bytewise.
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void put(std::vector<uint8_t>* out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), p, p + sizeof v);
}

void write_whole_file(const std::string& path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  bool ok = f && std::fwrite(data, 1, bytes, f) == bytes;
  if (f && std::fclose(f) != 0) ok = false;
  if (!ok) throw DataError(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
}

void rename_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  if (ec) throw DataError(fmt::format("{}: cannot rename to {}: {}", from, to, ec.message()));
}

void remove_file(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (ec) throw DataError(fmt::format("{}: cannot remove: {}", path, ec.message()));
}

template <class T>
void widen(const uint8_t* src, uint64_t count, int32_t* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(load<T>(src + i * sizeof(T)));
}

}  // namespace

const char* token_dtype_name(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::UInt8:
      return "uint8";
    case TokenDType::Int8:
      return "int8";
    case TokenDType::Int16:
      return "int16";
    case TokenDType::Int32:
      return "int32";
    case TokenDType::Int64:
      return "int64";
    case TokenDType::Float64:
      return "float64";
    case TokenDType::Float32:
      return "float32";
    case TokenDType::UInt16:
      return "uint16";
  }
  return "?";
}

size_t token_dtype_size(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::UInt8:
    case TokenDType::Int8:
      return 1;
    case TokenDType::Int16:
    case TokenDType::UInt16:
      return 2;
    case TokenDType::Int32:
    case TokenDType::Float32:
      return 4;
    case TokenDType::Int64:
    case TokenDType::Float64:
      return 8;
  }
  return 0;
}

TokenDType token_dtype_for_vocab(int64_t vocab) {
  return vocab < 65500 ? TokenDType::UInt16 : TokenDType::Int32;
}

IndexedDataset::IndexedDataset(const std::string& prefix, int64_t vocab,
                               const std::string& tokenizer_name)
    : prefix_(prefix), vocab_(vocab), tokenizer_name_(tokenizer_name) {
  for (const char* ext : {".idx", ".bin"})
    if (!std::filesystem::exists(prefix + ext))
      throw DataError(fmt::format(
          "{}{}: no such file (data prefix '{}' should name a Megatron indexed dataset, "
          "PREFIX.bin + PREFIX.idx, e.g. written by `tessera preprocess`)",
          prefix, ext, prefix));
  idx_ = MappedFile(prefix + ".idx", "Megatron index");
  bin_ = MappedFile(prefix + ".bin", "Megatron token file");
  check_index(bin_.size());
  if (vocab_ <= 0) return;
  const TokenDType needed = token_dtype_for_vocab(vocab_);
  if (token_dtype_size(dtype_) > token_dtype_size(needed))
    throw DataError(fmt::format(
        "{}: tokens are {}, wider than the {} that tokenizer {} (vocabulary {}) needs: the data "
        "was preprocessed with a different tokenizer; set tokenizer_type / tokenizer_model to "
        "the one it was made with, or preprocess it again",
        idx_.path(), token_dtype_name(dtype_), token_dtype_name(needed), tokenizer_name_, vocab_));
}

void IndexedDataset::check_index(uint64_t bin_bytes) {
  const std::string& path = idx_.path();
  const uint8_t* p = idx_.data();
  if (idx_.size() < kHeaderBytes)
    throw DataError(fmt::format("{}: truncated: {} bytes, but the MMIDIDX header alone is {}", path,
                                idx_.size(), kHeaderBytes));
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0)
    throw DataError(fmt::format(
        "{}: not a Megatron indexed-dataset index: it starts with {:02x} instead of the magic "
        "\"MMIDIDX\\0\\0\"",
        path, fmt::join(p, p + sizeof kMagic, " ")));
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != kVersion)
    throw DataError(
        fmt::format("{}: MMIDIDX version {}; only version 1 is supported", path, version));
  const uint8_t code = p[17];
  if (code < 1 || code > 8)
    throw DataError(
        fmt::format("{}: unknown token dtype code {} (Megatron's codes are 1-8)", path, code));
  dtype_ = static_cast<TokenDType>(code);
  if (dtype_ == TokenDType::Float32 || dtype_ == TokenDType::Float64)
    throw DataError(fmt::format("{}: token dtype is {}; token ids must be integers", path,
                                token_dtype_name(dtype_)));
  sequences_ = load<uint64_t>(p + 18);
  document_index_length_ = load<uint64_t>(p + 26);
  // Counts beyond 2^56 cannot describe a real file; rejecting them keeps the size sum exact.
  if (sequences_ >> 56 || document_index_length_ >> 56 || document_index_length_ == 0)
    throw DataError(fmt::format("{}: corrupt header: {} sequences, {} document-index entries", path,
                                sequences_, document_index_length_));
  lengths_at_ = kHeaderBytes;
  pointers_at_ = lengths_at_ + 4 * sequences_;
  documents_at_ = pointers_at_ + 8 * sequences_;
  const uint64_t expected = documents_at_ + 8 * document_index_length_;
  if (idx_.size() != expected)
    throw DataError(fmt::format(
        "{}: {}: {} bytes, but its header announces {} sequences and {} document-index entries, "
        "which take {} bytes",
        path, idx_.size() < expected ? "truncated" : "unexpected trailing bytes", idx_.size(),
        sequences_, document_index_length_, expected));

  const size_t item = token_dtype_size(dtype_);
  uint64_t offset = 0;
  for (uint64_t i = 0; i < sequences_; ++i) {
    const int32_t length = sequence_length(i);
    if (length < 0)
      throw DataError(fmt::format("{}: sequence {} has negative length {}", path, i, length));
    if (sequence_pointer(i) != static_cast<int64_t>(offset))
      throw DataError(fmt::format(
          "{}: sequence {} starts at byte {} of the .bin, but the lengths before it put it at {}",
          path, i, sequence_pointer(i), offset));
    offset += static_cast<uint64_t>(length) * item;
  }
  tokens_ = offset / item;
  if (offset != bin_bytes)
    throw DataError(
        fmt::format("{}: {} bytes, but {} describes {} {} tokens = {} bytes{}", bin_.path(),
                    bin_bytes, path, tokens_, token_dtype_name(dtype_), offset,
                    bin_bytes < offset ? " (truncated)" : " (is this the index of another .bin?)"));
  int64_t previous = 0;
  for (uint64_t d = 0; d < document_index_length_; ++d) {
    const int64_t start = document_start(d);
    const bool ok = d == 0 ? start == 0 : start >= previous;
    if (!ok || start > static_cast<int64_t>(sequences_))
      throw DataError(fmt::format(
          "{}: document index entry {} is {}: expected a non-decreasing list from 0 to the "
          "sequence count {}",
          path, d, start, sequences_));
    previous = start;
  }
  if (previous != static_cast<int64_t>(sequences_))
    throw DataError(
        fmt::format("{}: the document index ends at {} instead of the sequence count {}", path,
                    previous, sequences_));
}

int32_t IndexedDataset::sequence_length(uint64_t i) const {
  return load<int32_t>(idx_.data() + lengths_at_ + 4 * i);
}

int64_t IndexedDataset::sequence_pointer(uint64_t i) const {
  return load<int64_t>(idx_.data() + pointers_at_ + 8 * i);
}

int64_t IndexedDataset::document_start(uint64_t d) const {
  return load<int64_t>(idx_.data() + documents_at_ + 8 * d);
}

void IndexedDataset::read(uint64_t seq, uint64_t offset, uint64_t count, int32_t* out) const {
  TS_CHECK(seq < sequences_ && offset + count <= static_cast<uint64_t>(sequence_length(seq)),
           "read of sequence {} tokens [{}, {}) is out of range", seq, offset, offset + count);
  const size_t item = token_dtype_size(dtype_);
  const uint8_t* src = bin_.data() + sequence_pointer(seq) + offset * item;
  switch (dtype_) {
    case TokenDType::UInt8:
      widen<uint8_t>(src, count, out);
      break;
    case TokenDType::Int8:
      widen<int8_t>(src, count, out);
      break;
    case TokenDType::Int16:
      widen<int16_t>(src, count, out);
      break;
    case TokenDType::UInt16:
      widen<uint16_t>(src, count, out);
      break;
    case TokenDType::Int32:
      widen<int32_t>(src, count, out);
      break;
    case TokenDType::Int64:
      for (uint64_t i = 0; i < count; ++i) {
        const int64_t v = load<int64_t>(src + 8 * i);
        // Out-of-range values become -1 so the vocabulary check below reports them.
        out[i] = v >= 0 && v <= INT32_MAX ? static_cast<int32_t>(v) : -1;
      }
      break;
    case TokenDType::Float32:
    case TokenDType::Float64:
      TS_CHECK(false, "{} tokens passed the header check", token_dtype_name(dtype_));
  }
  if (vocab_ <= 0) return;
  for (uint64_t i = 0; i < count; ++i)
    if (out[i] < 0 || out[i] >= vocab_)
      throw DataError(fmt::format(
          "{}.bin: token id {} (sequence {}, token {}) is outside the vocabulary [0, {}) of "
          "tokenizer {}: the data was preprocessed with a different tokenizer",
          prefix_, out[i], seq, offset + i, vocab_, tokenizer_name_));
}

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDType dtype,
                                           std::string meta_json)
    : prefix_(std::move(prefix)), meta_json_(std::move(meta_json)), dtype_(dtype) {
  TS_CHECK(dtype == TokenDType::UInt8 || dtype == TokenDType::UInt16 || dtype == TokenDType::Int32,
           "the writer supports uint8, uint16 and int32 values, not {}", token_dtype_name(dtype));
  const std::string tmp = fmt::format(".tmp-{}", ::getpid());
  bin_tmp_ = prefix_ + ".bin" + tmp;
  idx_tmp_ = prefix_ + ".idx" + tmp;
  meta_tmp_ = dataset_meta_path(prefix_) + tmp;
  const std::filesystem::path dir = std::filesystem::path(prefix_).parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  if (ec)
    throw DataError(
        fmt::format("{}: cannot create the output directory: {}", dir.string(), ec.message()));
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) throw DataError(fmt::format("{}: cannot create: {}", bin_tmp_, std::strerror(errno)));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    std::error_code ignored;
    for (const std::string& tmp : {bin_tmp_, idx_tmp_, meta_tmp_})
      std::filesystem::remove(tmp, ignored);
  }
}

void IndexedDatasetWriter::add_document(const int32_t* ids, size_t count) {
  if (count > INT32_MAX)
    throw DataError(fmt::format("{}.bin: a document of {} tokens exceeds the format's int32 length",
                                prefix_, count));
  const size_t item = token_dtype_size(dtype_);
  scratch_.resize(count * item);
  for (size_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || (dtype_ == TokenDType::UInt16 && ids[i] > UINT16_MAX) ||
        (dtype_ == TokenDType::UInt8 && ids[i] > UINT8_MAX))
      throw DataError(fmt::format("{}.bin: token id {} does not fit {} tokens", prefix_, ids[i],
                                  token_dtype_name(dtype_)));
    if (dtype_ == TokenDType::UInt8) {
      scratch_[i] = static_cast<uint8_t>(ids[i]);
    } else if (dtype_ == TokenDType::UInt16) {
      const auto v = static_cast<uint16_t>(ids[i]);
      std::memcpy(scratch_.data() + 2 * i, &v, 2);
    } else {
      std::memcpy(scratch_.data() + 4 * i, &ids[i], 4);
    }
  }
  if (std::fwrite(scratch_.data(), 1, scratch_.size(), bin_) != scratch_.size())
    throw DataError(fmt::format("{}: write failed: {}", bin_tmp_, std::strerror(errno)));
  lengths_.push_back(static_cast<int32_t>(count));
  tokens_ += count;
}

void IndexedDatasetWriter::finish() {
  const bool bin_ok = std::fclose(bin_) == 0;
  bin_ = nullptr;
  if (!bin_ok) throw DataError(fmt::format("{}: write failed: {}", bin_tmp_, std::strerror(errno)));
  const uint64_t n = lengths_.size();
  std::vector<uint8_t> idx;
  idx.reserve(kHeaderBytes + 20 * n + 8);
  idx.insert(idx.end(), kMagic, kMagic + sizeof kMagic);
  put<uint64_t>(&idx, kVersion);
  put<uint8_t>(&idx, static_cast<uint8_t>(dtype_));
  put<uint64_t>(&idx, n);
  put<uint64_t>(&idx, n + 1);
  for (int32_t length : lengths_) put<int32_t>(&idx, length);
  int64_t pointer = 0;
  for (int32_t length : lengths_) {
    put<int64_t>(&idx, pointer);
    pointer += static_cast<int64_t>(length) * static_cast<int64_t>(token_dtype_size(dtype_));
  }
  for (uint64_t d = 0; d <= n; ++d) put<int64_t>(&idx, static_cast<int64_t>(d));
  write_whole_file(idx_tmp_, idx.data(), idx.size());
  if (!meta_json_.empty()) write_whole_file(meta_tmp_, meta_json_.data(), meta_json_.size());
  // An earlier dataset's record must not describe this one, even if a crash stops the renames.
  remove_file(dataset_meta_path(prefix_));
  // The .bin first: a reader that finds the new .idx also finds its .bin.
  rename_file(bin_tmp_, prefix_ + ".bin");
  rename_file(idx_tmp_, prefix_ + ".idx");
  if (!meta_json_.empty()) rename_file(meta_tmp_, dataset_meta_path(prefix_));
  finished_ = true;
}

}  // namespace tessera
