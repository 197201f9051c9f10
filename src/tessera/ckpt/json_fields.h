#pragma once
// Fields of JSON files that come from outside (a checkpoint's trainer_state.json, a Hugging
// Face config.json), read with their types and ranges checked: a wrong type or a value out of
// range is a DataError naming the file, the field, its value and what was expected, never the
// JSON library's bare type error or a number silently wrapped into range.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera {

// 2^53: the largest integer every JSON reader holds exactly; no counter of a run comes near.
inline constexpr int64_t kMaxJsonCounter = int64_t{1} << 53;

class JsonFields {
 public:
  // `object` must outlive this. `file` names the file in messages; `prefix` is the path of
  // `object` in it ("model." for a nested object, "" at the top). Throws DataError when
  // `object` is not a JSON object.
  JsonFields(const nlohmann::json& object, std::string file, std::string prefix = "");

  // Present and not null.
  bool has(const char* key) const;
  // Required fields; each throws DataError when absent or not as expected.
  int64_t integer(const char* key, int64_t min, int64_t max) const;
  double number(const char* key, double min, double max) const;  // finite, in [min, max]
  bool boolean(const char* key) const;
  std::string string(const char* key) const;
  const nlohmann::json& array(const char* key) const;
  JsonFields object(const char* key) const;
  // Optional fields: `fallback` when absent or null.
  int64_t integer_or(const char* key, int64_t fallback, int64_t min, int64_t max) const;
  double number_or(const char* key, double fallback, double min, double max) const;
  bool boolean_or(const char* key, bool fallback) const;
  std::string string_or(const char* key, const std::string& fallback) const;

  // An integer element of an array field, e.g. ranges[3][1]: `where` names it.
  int64_t integer_value(const nlohmann::json& v, const std::string& where, int64_t min,
                        int64_t max) const;
  [[noreturn]] void fail(const std::string& field, const nlohmann::json& value,
                         const std::string& expected) const;

  const nlohmann::json& json() const { return j_; }
  const std::string& file() const { return file_; }
  std::string field(const char* key) const { return prefix_ + key; }

 private:
  const nlohmann::json& at(const char* key) const;  // present, or fail "missing"

  const nlohmann::json& j_;
  std::string file_, prefix_;
};

// "a file name" check for names trainer_state.json or an index lists: a plain name in the
// directory itself, never a path that leaves it.
bool is_plain_file_name(const std::string& name);

}  // namespace tessera
