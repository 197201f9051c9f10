// Megatron's MMIDIDX v1 format: Tessera's files against an independent reader of the
// documented layout, a hand-made file against Tessera's reader, and every kind of bad file.
#include <cstring>
#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data_fixtures.h"
#include "tessera/core/error.h"
#include "tessera/data/indexed_dataset.h"

namespace tessera {
namespace {

using testing::ScratchDir;

// Expects `fn` to throw DataError whose message contains every one of `parts`.
void expect_data_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

nlohmann::json read_with_python(const std::string& prefix) {
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TEST_DATA_DIR +
                                      "/read_mmidx.py " + prefix);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return nlohmann::json::parse(r.output);
}

TEST(IndexedDataset, TesseraFilesReadByAnIndependentReader) {
  ScratchDir dir;
  const std::vector<std::vector<int32_t>> small = {{1, 2, 3}, {256}, {}, {65535, 0, 7, 9}};
  const std::vector<std::vector<int32_t>> large = {{128000, 5}, {70000, 1, 2}};
  const std::string p16 = (dir / "small").string(), p32 = (dir / "large").string();
  testing::write_dataset(p16, small, TokenDType::UInt16);
  testing::write_dataset(p32, large, TokenDType::Int32);

  const nlohmann::json a = read_with_python(p16);
  EXPECT_EQ(a["dtype_code"], 8);  // uint16
  EXPECT_EQ(a["sequence_count"], 4);
  EXPECT_EQ(a["document_count"], 5);  // documents + 1, as Megatron writes it
  EXPECT_EQ(a["document_index"], nlohmann::json({0, 1, 2, 3, 4}));
  EXPECT_EQ(a["sequence_lengths"], nlohmann::json({3, 1, 0, 4}));
  EXPECT_EQ(a["sequences"], nlohmann::json(small));

  const nlohmann::json b = read_with_python(p32);
  EXPECT_EQ(b["dtype_code"], 4);  // int32
  EXPECT_EQ(b["sequences"], nlohmann::json(large));

  // And Tessera reads its own files back.
  IndexedDataset d(p32);
  EXPECT_EQ(d.dtype(), TokenDType::Int32);
  EXPECT_EQ(d.documents(), 2u);
  EXPECT_EQ(d.tokens(), 5u);
  std::vector<int32_t> out(3);
  d.read(1, 0, 3, out.data());
  EXPECT_EQ(out, large[1]);
}

// An index built byte by byte from the documented layout, with a document of two sequences
// (the sentence-split form Megatron can write) to pin the document-index semantics.
TEST(IndexedDataset, HandMadeFileReadByTessera) {
  ScratchDir dir;
  std::string idx("MMIDIDX\0\0", 9);
  auto u64 = [&](uint64_t v) { idx.append(reinterpret_cast<const char*>(&v), 8); };
  auto i32 = [&](int32_t v) { idx.append(reinterpret_cast<const char*>(&v), 4); };
  u64(1);                 // version
  idx.push_back('\x08');  // uint16 tokens
  u64(3);                 // sequences
  u64(3);                 // document index entries: 2 documents + 1
  for (int32_t n : {3, 2, 4}) i32(n);
  for (uint64_t p : {0, 6, 10}) u64(p);  // byte offsets: lengths x 2 bytes
  for (uint64_t d : {0, 2, 3}) u64(d);   // document 0 = sequences 0-1, document 1 = sequence 2
  ASSERT_EQ(idx.size(), 34u + 3 * 4 + 3 * 8 + 3 * 8);
  std::string bin;
  for (uint16_t t : {10, 11, 12, 20, 21, 30, 31, 32, 33})
    bin.append(reinterpret_cast<const char*>(&t), 2);
  std::ofstream(dir / "hand.idx", std::ios::binary) << idx;
  std::ofstream(dir / "hand.bin", std::ios::binary) << bin;

  IndexedDataset d((dir / "hand").string(), 257, "ByteLevel");
  EXPECT_EQ(d.dtype(), TokenDType::UInt16);
  EXPECT_EQ(d.sequences(), 3u);
  EXPECT_EQ(d.documents(), 2u);
  EXPECT_EQ(d.document_start(1), 2);
  EXPECT_EQ(d.sequence_length(2), 4);
  EXPECT_EQ(d.tokens(), 9u);
  std::vector<int32_t> out(2);
  d.read(2, 1, 2, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{31, 32}));
  d.read(1, 0, 2, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{20, 21}));
}

class BadIndexedData : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = (dir_ / "ok").string();
    testing::write_dataset(prefix_, {{1, 2, 3}, {4, 5}, {6}});
    idx_ = testing::read_file(prefix_ + ".idx");
    bin_ = testing::read_file(prefix_ + ".bin");
  }
  // Rewrites the files with `idx` and `bin` and expects opening to fail naming `parts`.
  void expect_rejected(const std::string& idx, const std::string& bin,
                       const std::vector<std::string>& parts) {
    std::ofstream(prefix_ + ".idx", std::ios::binary | std::ios::trunc) << idx;
    std::ofstream(prefix_ + ".bin", std::ios::binary | std::ios::trunc) << bin;
    expect_data_error([&] { IndexedDataset d(prefix_); }, parts);
  }
  std::string patched(size_t at, const void* bytes, size_t n) const {
    std::string s = idx_;
    std::memcpy(s.data() + at, bytes, n);
    return s;
  }

  ScratchDir dir_;
  std::string prefix_, idx_, bin_;
};

TEST_F(BadIndexedData, MissingFilesAreNamed) {
  std::filesystem::remove(prefix_ + ".bin");
  expect_data_error([&] { IndexedDataset d(prefix_); }, {prefix_ + ".bin", "no such file"});
  expect_data_error([&] { IndexedDataset d((dir_ / "nothing").string()); },
                    {"nothing.idx", "no such file", "tessera preprocess"});
}

TEST_F(BadIndexedData, TruncatedIndex) {
  expect_rejected(idx_.substr(0, 20), bin_, {".idx", "truncated", "header"});
  expect_rejected(idx_.substr(0, idx_.size() - 8), bin_, {".idx", "truncated", "3 sequences"});
  expect_rejected(idx_ + "x", bin_, {".idx", "trailing"});
}

TEST_F(BadIndexedData, WrongMagicVersionOrDtype) {
  expect_rejected(patched(0, "NOTMMIDX", 8), bin_, {".idx", "magic"});
  const uint64_t version = 2;
  expect_rejected(patched(9, &version, 8), bin_, {".idx", "version 2"});
  const uint8_t float32 = 7, unknown = 9;
  expect_rejected(patched(17, &float32, 1), bin_, {".idx", "float32", "integers"});
  expect_rejected(patched(17, &unknown, 1), bin_, {".idx", "dtype code 9"});
}

TEST_F(BadIndexedData, BinInconsistentWithTheIndex) {
  expect_rejected(idx_, bin_.substr(0, bin_.size() - 2), {".bin", "truncated"});
  expect_rejected(idx_, bin_ + "xx", {".bin", "another .bin"});
  const int64_t pointer = 4;  // sequence 1 should start at byte 6
  expect_rejected(patched(34 + 3 * 4 + 8, &pointer, 8), bin_,
                  {".idx", "sequence 1 starts at byte 4"});
  const int32_t negative = -1;
  expect_rejected(patched(34, &negative, 4), bin_, {".idx", "negative length"});
  const int64_t end = 2;  // the document index must end at the sequence count, 3
  expect_rejected(patched(idx_.size() - 8, &end, 8), bin_, {".idx", "document index"});
}

TEST(IndexedDatasetVocabulary, DtypeWiderThanTheTokenizerNeeds) {
  ScratchDir dir;
  const std::string p = (dir / "wide").string();
  testing::write_dataset(p, {{1, 2, 3}}, TokenDType::Int32);
  EXPECT_NO_THROW(IndexedDataset(p, 128256, "llama3"));
  expect_data_error([&] { IndexedDataset d(p, 257, "ByteLevel"); },
                    {"wide.idx", "int32", "uint16", "ByteLevel", "different tokenizer"});
}

TEST(IndexedDatasetVocabulary, IdsOutsideTheVocabulary) {
  ScratchDir dir;
  const std::string p = (dir / "ids").string();
  testing::write_dataset(p, {{1, 2, 3}, {4, 300, 6}});
  IndexedDataset d(p, 257, "ByteLevel");
  std::vector<int32_t> out(3);
  EXPECT_NO_THROW(d.read(0, 0, 3, out.data()));
  expect_data_error([&] { d.read(1, 0, 3, out.data()); },
                    {"ids.bin", "token id 300", "sequence 1", "[0, 257)", "ByteLevel"});
}

TEST(IndexedDatasetWriter, NothingIsLeftBehindWithoutFinish) {
  ScratchDir dir;
  {
    IndexedDatasetWriter w((dir / "partial").string(), TokenDType::UInt16);
    const int32_t ids[] = {1, 2};
    w.add_document(ids, 2);
    const int32_t too_big[] = {70000};
    EXPECT_THROW(w.add_document(too_big, 1), DataError);
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace tessera
