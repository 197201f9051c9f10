#include "tessera/analysis/trace_reader.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <simdjson.h>

#include "tessera/analysis/progress.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

namespace od = simdjson::ondemand;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\r' ||
                        s.back() == '\t' || s.back() == ',')) {
    s.remove_suffix(1);
  }
  return s;
}

// Numbers may be written as integers, decimals, or (by some tools) quoted strings.
std::optional<int64_t> parse_int(std::string_view s) {
  s = trim(s);
  if (s.size() >= 2 && s.front() == '"') s = s.substr(1, s.size() - 2);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc() && p == s.data() + s.size()) return v;
  double d = 0;
  auto [p2, ec2] = std::from_chars(s.data(), s.data() + s.size(), d);
  // A number no int64 holds (1e300, nan) is as good as missing: converting it is undefined.
  if (ec2 == std::errc() && p2 == s.data() + s.size() && std::abs(d) < 9.2e18)
    return static_cast<int64_t>(d);
  return std::nullopt;
}

int64_t int_or_missing(od::value v) {
  return parse_int(v.raw_json_token()).value_or(-1);
}

std::string_view string_or_empty(od::value v) {
  std::string_view s;
  if (v.get_string().get(s)) return {};
  return s;
}

std::string_view raw_array(od::value v) {
  od::array a;
  std::string_view raw;
  if (v.get_array().get(a) || a.raw_json().get(raw)) return {};
  return raw;
}

int bool_or_missing(od::value v) {
  bool b = false;
  if (!v.get_bool().get(b)) return b ? 1 : 0;
  auto n = int_or_missing(v);
  return n < 0 ? -1 : (n != 0);
}

// The raw JSON text of a value: the whole array or object, or the scalar token.
std::string_view raw_value(od::value v) {
  od::json_type type;
  if (v.type().get(type)) return {};
  if (type == od::json_type::array) return raw_array(v);
  if (type == od::json_type::object) {
    od::object o;
    std::string_view raw;
    if (v.get_object().get(o) || o.raw_json().get(raw)) return {};
    return raw;
  }
  return trim(v.raw_json_token());
}

void decode_args(od::object args, EventArgs& a, bool op_event) {
  for (auto field : args) {
    std::string_view key;
    if (field.unescaped_key().get(key)) continue;
    od::value v = field.value();
    // Before the fields below read it: raw_value consumes arrays and objects, which none of
    // them are for a key without a space.
    if (op_event && key.find(' ') == std::string_view::npos &&
        a.op_arg_count < EventArgs::kMaxOpArgs) {
      a.op_args[a.op_arg_count++] = {key, raw_value(v)};
    }
    // Keys of one or two letters are Tessera's shape args (docs/report.md).
    if (key.size() <= 2) {
      if (key == "M")
        a.m = int_or_missing(v);
      else if (key == "N")
        a.n = int_or_missing(v);
      else if (key == "K")
        a.k = int_or_missing(v);
      else if (key == "B")
        a.b = int_or_missing(v);
      else if (key == "H")
        a.h = int_or_missing(v);
      else if (key == "KV")
        a.kv = int_or_missing(v);
      else if (key == "T")
        a.t = int_or_missing(v);
      else if (key == "S")
        a.s = int_or_missing(v);
      else if (key == "D")
        a.d = int_or_missing(v);
      else if (key == "Dv")
        a.dv = int_or_missing(v);
      continue;
    }
    if (key == "correlation")
      a.correlation = int_or_missing(v);
    else if (key == "External id")
      a.external_id = int_or_missing(v);
    else if (key == "Input Dims")
      a.input_dims = raw_array(v);
    else if (key == "Input type")
      a.input_types = raw_array(v);
    else if (key == "Input Strides")
      a.input_strides = raw_array(v);
    else if (key == "Concrete Inputs")
      a.concrete_inputs = raw_array(v);
    else if (key == "Collective name" || key == "collective")
      a.collective = string_or_empty(v);
    else if (key == "In msg nelems")
      a.in_nelems = int_or_missing(v);
    else if (key == "Out msg nelems")
      a.out_nelems = int_or_missing(v);
    else if (key == "Group size" || key == "group_size")
      a.group_size = int_or_missing(v);
    else if (key == "dtype")
      a.dtype = string_or_empty(v);
    else if (key == "Process Group Name" || key == "process_group")
      a.process_group = string_or_empty(v);
    else if (key == "bytes")
      a.bytes = int_or_missing(v);
    else if (key == "seq" || key == "Seq")
      a.seq = int_or_missing(v);
    else if (key == "batch")
      a.batch = int_or_missing(v);
    else if (key == "causal")
      a.causal = bool_or_missing(v);
    else if (key == "window")
      a.window = int_or_missing(v);
    else if (key == "name")
      a.meta_name = string_or_empty(v);
  }
}

// Decodes one event. Throws simdjson_error on malformed JSON.
void decode_event(od::parser& parser, const PaddedText& text, TraceEvent& e) {
  od::document doc =
      parser.iterate(simdjson::padded_string_view(text.data, text.size, text.capacity));
  od::object obj = doc.get_object();
  for (auto field : obj) {
    std::string_view key = field.unescaped_key();
    od::value v = field.value();
    if (key == "ph") {
      std::string_view ph = v.get_string();
      e.ph = ph.empty() ? 0 : ph[0];
    } else if (key == "name") {
      e.name = string_or_empty(v);
    } else if (key == "cat") {
      e.cat = string_or_empty(v);
    } else if (key == "ts" || key == "dur") {
      std::string_view tok = v.raw_json_token();
      auto ns = parse_us_to_ns(tok);
      if (key == "ts") {
        e.has_ts = ns.has_value();
        e.ts_ns = ns.value_or(0);
      } else {
        e.has_dur = ns.has_value();
        e.dur_ns = ns.value_or(0);
      }
    } else if (key == "pid") {
      if (v.type() == od::json_type::string) {
        e.pid_is_string = true;
        e.pid_string = v.get_string();
      } else {
        e.pid = int_or_missing(v);
      }
    } else if (key == "tid") {
      if (v.type() != od::json_type::string) e.tid = int_or_missing(v);
    } else if (key == "args") {
      od::object args;
      // Kineto and Tessera write "cat" before "args"; an event that names its category
      // later is taken for an op here, and add_event ignores op args on other events.
      if (!v.get_object().get(args)) decode_args(args, e.args, e.cat.empty() || e.cat == "cpu_op");
    }
  }
}

}  // namespace

std::optional<int64_t> parse_us_to_ns(std::string_view text) {
  text = trim(text);
  if (text.size() >= 2 && text.front() == '"') text = text.substr(1, text.size() - 2);
  if (text.empty()) return std::nullopt;
  // Beyond this many µs a time is no clock's; it saturates (add_event refuses it) instead of
  // overflowing.
  constexpr int64_t kMaxWholeUs = std::numeric_limits<int64_t>::max() / 1000 - 1;
  // Exact decimal parse: Kineto writes µs with 3 decimals on clocks of ~1e12 µs, where a
  // double would lose the last nanosecond.
  bool neg = text.front() == '-';
  size_t i = neg ? 1 : 0;
  int64_t whole = 0;
  size_t digits = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits) {
    whole = whole > kMaxWholeUs / 10 ? kMaxWholeUs : whole * 10 + (text[i] - '0');
  }
  int64_t frac = 0;
  int frac_digits = 0;
  if (i < text.size() && text[i] == '.') {
    for (++i; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits) {
      if (frac_digits < 3) {
        frac = frac * 10 + (text[i] - '0');
        ++frac_digits;
      } else if (frac_digits == 3 && text[i] >= '5') {
        ++frac;  // round to the nearest nanosecond
        frac_digits = 4;
      }
    }
  }
  if (i != text.size()) {  // exponent or garbage: fall back to floating point
    double d = 0;
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
    if (ec != std::errc() || p != text.data() + text.size() || !std::isfinite(d))
      return std::nullopt;
    const double ns = std::clamp(d * 1000.0, -9.0e18, 9.0e18);
    return static_cast<int64_t>(ns + (ns >= 0 ? 0.5 : -0.5));
  }
  if (digits == 0) return std::nullopt;
  for (int f = std::min(frac_digits, 3); f < 3; ++f) frac *= 10;
  int64_t ns = std::min(whole, kMaxWholeUs) * 1000 + frac;
  return neg ? -ns : ns;
}

ReadStats read_trace(const std::string& path,
                     const std::function<void(std::string_view, std::string_view)>& on_member,
                     const std::function<void(const TraceEvent&)>& on_event, bool progress,
                     size_t chunk_bytes) {
  TraceScanner scanner(path, open_byte_source(path), chunk_bytes);
  Progress bar("reading " + path, scanner.source().file_size(), progress);
  od::parser parser;
  ReadStats stats;
  TraceEvent event;
  uint64_t with_phase = 0;
  TraceScanner::Handler handler;
  handler.on_member = on_member;
  handler.on_event = [&](const PaddedText& text, uint64_t offset) {
    event = TraceEvent{};
    event.offset = offset;
    try {
      decode_event(parser, text, event);
    } catch (const simdjson::simdjson_error& err) {
      throw DataError(fmt::format("{}: invalid trace JSON in the event at byte {}: {} ({:.80})",
                                  path, offset, err.what(), text.view()));
    }
    ++stats.events;
    with_phase += event.ph != 0;
    on_event(event);
  };
  handler.on_progress = [&](uint64_t bytes) { bar.update(bytes, stats.events); };
  scanner.scan(handler);
  // Every trace event has a phase: a list of other JSON objects is some other file.
  if (stats.events > 0 && with_phase == 0) {
    throw_not_a_trace(path, fmt::format("{} objects where the events belong, none with the "
                                        "\"ph\" (phase) member every trace event has",
                                        stats.events));
  }
  stats.seconds = bar.finish();
  stats.file_bytes = scanner.source().file_size();
  stats.json_bytes = scanner.bytes_scanned();
  return stats;
}

}  // namespace tessera::analysis
