#include "tessera/ckpt/json_fields.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

// A value as the file spells it, shortened: a damaged file may hold megabytes in one field.
std::string shown(const nlohmann::json& v) {
  std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

std::string range_text(int64_t min, int64_t max) {
  auto bound = [](int64_t v) {
    if (v == std::numeric_limits<int64_t>::max()) return std::string("2^63-1");
    if (v == kMaxJsonCounter) return std::string("2^53");
    return std::to_string(v);
  };
  return fmt::format("an integer in [{}, {}]", bound(min), bound(max));
}

}  // namespace

JsonFields::JsonFields(const nlohmann::json& object, std::string file, std::string prefix)
    : j_(object), file_(std::move(file)), prefix_(std::move(prefix)) {
  if (!j_.is_object()) {
    const std::string what =
        prefix_.empty() ? "the document" : prefix_.substr(0, prefix_.size() - 1);
    throw DataError(fmt::format("{}: {} is {}; expected a JSON object", file_, what, shown(j_)));
  }
}

void JsonFields::fail(const std::string& field, const nlohmann::json& value,
                      const std::string& expected) const {
  throw DataError(
      fmt::format("{}: field '{}' is {}; expected {}", file_, field, shown(value), expected));
}

bool JsonFields::has(const char* key) const {
  const auto it = j_.find(key);
  return it != j_.end() && !it->is_null();
}

const nlohmann::json& JsonFields::at(const char* key) const {
  const auto it = j_.find(key);
  if (it == j_.end()) throw DataError(fmt::format("{}: field '{}' is missing", file_, field(key)));
  return *it;
}

int64_t JsonFields::integer_value(const nlohmann::json& v, const std::string& where, int64_t min,
                                  int64_t max) const {
  // Unsigned values above 2^63 - 1 must not wrap into range.
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(max) &&
                                                     static_cast<int64_t>(v.get<uint64_t>()) >= min
                        : v.is_number_integer() ? v.get<int64_t>() >= min && v.get<int64_t>() <= max
                                                : false;
  if (!in_range) fail(where, v, range_text(min, max));
  return v.get<int64_t>();
}

int64_t JsonFields::integer(const char* key, int64_t min, int64_t max) const {
  return integer_value(at(key), field(key), min, max);
}

int64_t JsonFields::integer_or(const char* key, int64_t fallback, int64_t min, int64_t max) const {
  return has(key) ? integer(key, min, max) : fallback;
}

double JsonFields::number(const char* key, double min, double max) const {
  const nlohmann::json& v = at(key);
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < min ||
      v.get<double>() > max)
    fail(field(key), v,
         min == -std::numeric_limits<double>::max() && max == std::numeric_limits<double>::max()
             ? std::string("a finite number")
             : fmt::format("a number in [{}, {}]", min, max));
  return v.get<double>();
}

double JsonFields::number_or(const char* key, double fallback, double min, double max) const {
  return has(key) ? number(key, min, max) : fallback;
}

bool JsonFields::boolean(const char* key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_boolean()) fail(field(key), v, "true or false");
  return v.get<bool>();
}

bool JsonFields::boolean_or(const char* key, bool fallback) const {
  return has(key) ? boolean(key) : fallback;
}

std::string JsonFields::string(const char* key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_string()) fail(field(key), v, "a string");
  return v.get<std::string>();
}

std::string JsonFields::string_or(const char* key, const std::string& fallback) const {
  return has(key) ? string(key) : fallback;
}

const nlohmann::json& JsonFields::array(const char* key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_array()) fail(field(key), v, "a JSON array");
  return v;
}

JsonFields JsonFields::object(const char* key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_object()) fail(field(key), v, "a JSON object");
  return JsonFields(v, file_, field(key) + ".");
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace tessera
