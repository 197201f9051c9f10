// The streaming layers: TraceScanner (outer structure, chunk refills, errors with offsets),
// the event decoder, gzip input and exact timestamp parsing.
#include <zlib.h>

#include <gtest/gtest.h>

#include "tessera/analysis/json_stream.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/analysis/trace_reader.h"
#include "tessera/core/error.h"
#include "trace_builder.h"

namespace tessera::analysis {
namespace {

using testing::json;
using testing::test_dir;
using testing::TraceBuilder;
using testing::write_file;

struct Scanned {
  std::vector<std::pair<std::string, std::string>> members;
  std::vector<std::string> events;
};

Scanned scan(const std::string& path, size_t chunk) {
  Scanned s;
  TraceScanner scanner(path, open_byte_source(path), chunk);
  TraceScanner::Handler h;
  h.on_member = [&](std::string_view k, std::string_view v) {
    s.members.emplace_back(std::string(k), std::string(v));
  };
  h.on_event = [&](const PaddedText& t, uint64_t) { s.events.emplace_back(t.view()); };
  scanner.scan(h);
  return s;
}

std::string gzip(const std::string& text) {
  uLongf size = compressBound(text.size()) + 64;
  std::string out(size, '\0');
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// Braces, brackets, commas and escaped quotes inside strings must not confuse the scanner.
const char* kTricky = R"({"schemaVersion": 1, "deviceProperties": [{"name": "NVIDIA H100"}],
  "traceEvents": [
    {"ph": "X", "cat": "kernel", "name": "k{[\"1\"]}, \\", "pid": 0, "tid": 7, "ts": 1.5, "dur": 2},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 9,
     "args": {"Input Dims": [[4, 8], [8, 16]], "nested": {"a": [1, {"b": "}"}]}}}
  ],
  "traceName": "t", "baseTimeNanoseconds": 1700000000000000000})";

TEST(TraceScanner, SplitsEventsAndMembersAtEveryChunkSize) {
  const std::string path = write_file(test_dir() / "t.json", kTricky);
  const Scanned reference = scan(path, 1 << 20);
  ASSERT_EQ(reference.events.size(), 2u);
  ASSERT_EQ(reference.members.size(), 4u);
  EXPECT_EQ(reference.members[3].first, "baseTimeNanoseconds");
  EXPECT_EQ(reference.members[3].second, "1700000000000000000");
  EXPECT_EQ(reference.members[2].second, "\"t\"");
  EXPECT_TRUE(json::parse(reference.events[0])["name"] == "k{[\"1\"]}, \\");
  // Tiny chunks force every token to straddle a refill.
  for (size_t chunk : {1, 2, 3, 7, 64}) {
    const Scanned s = scan(path, chunk);
    EXPECT_EQ(s.events, reference.events) << "chunk " << chunk;
    EXPECT_EQ(s.members, reference.members) << "chunk " << chunk;
  }
}

TEST(TraceScanner, ReadsTheBareArrayForm) {
  const std::string path =
      write_file(test_dir() / "a.json", R"([{"ph":"X","name":"a","ts":1,"dur":1}, {"ph":"i"}])");
  EXPECT_EQ(scan(path, 5).events.size(), 2u);
}

TEST(TraceScanner, ReadsGzipAsThePlainFile) {
  const auto dir = test_dir();
  const std::string plain = write_file(dir / "t.json", kTricky);
  const std::string gz = write_file(dir / "t.json.gz", gzip(kTricky));
  EXPECT_EQ(scan(gz, 3).events, scan(plain, 3).events);
}

void expect_data_error(const std::string& path, const std::vector<std::string>& parts) {
  try {
    TraceData::load(path, false);
    FAIL() << "no error for " << path;
  } catch (const DataError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

TEST(TraceScanner, TruncatedTraceNamesFileOffsetAndExpectation) {
  const std::string text = kTricky;
  const auto dir = test_dir();
  // Cut inside the second event, between events, and before the closing brace.
  expect_data_error(write_file(dir / "a.json", text.substr(0, text.find("aten::mm"))),
                    {"byte", "truncated"});
  expect_data_error(write_file(dir / "b.json", text.substr(0, text.find("],"))),
                    {"byte", "truncated"});
  expect_data_error(write_file(dir / "c.json", text.substr(0, text.size() - 1)),
                    {"byte", "truncated"});
  // A truncated gzip stream is reported as such.
  const std::string gz = gzip(text);
  expect_data_error(write_file(dir / "d.json.gz", gz.substr(0, gz.size() / 2)), {"truncated gzip"});
}

TEST(TraceScanner, NonJsonAndBadEventsAreDataErrors) {
  const auto dir = test_dir();
  expect_data_error(write_file(dir / "notes.txt", "hello world"), {"byte 0", "'{' or '['"});
  expect_data_error(write_file(dir / "empty.json", ""), {"end of file"});
  expect_data_error(write_file(dir / "bad.json", R"({"traceEvents": [{"ph": X, "ts": 1}]})"),
                    {"event at byte 17"});
  expect_data_error(write_file(dir / "sep.json", R"({"traceEvents": [{"ph": "X"} {"ph": "X"}]})"),
                    {"',' or ']'"});
  expect_data_error((dir / "missing.json").string(), {"cannot open"});
}

TEST(TraceScanner, JsonThatIsNotATraceSaysWhatItIs) {
  const auto dir = test_dir();
  const std::string not_a_trace = "not a Chrome/PyTorch profiler trace";
  expect_data_error(write_file(dir / "a.json", R"({"a": 1})"),
                    {not_a_trace, R"(found a JSON object with members "a")"});
  expect_data_error(write_file(dir / "empty.json", "{}"), {not_a_trace, "an empty JSON object"});
  expect_data_error(write_file(dir / "many.json", R"({"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7})"),
                    {R"("a", "b", "c", "d", "e", ... (7 members))"});
  expect_data_error(write_file(dir / "metrics.jsonl",
                               "{\"iteration\": 1, \"lm_loss\": 9.5}\n"
                               "{\"iteration\": 2, \"lm_loss\": 9.1}\n"),
                    {not_a_trace, R"("iteration", "lm_loss")", "JSON Lines"});
  expect_data_error(write_file(dir / "object.json", R"({"traceEvents": {"ph": "X"}})"),
                    {not_a_trace, R"("traceEvents" starting with '{', not '[')"});
  expect_data_error(write_file(dir / "records.json", R"([{"name": "a"}, {"name": "b"}])"),
                    {not_a_trace, "2 objects where the events belong, none with the \"ph\""});
  // An empty trace is still a trace (the report warns that it has no GPU activity).
  EXPECT_EQ(TraceData::load(write_file(dir / "none.json", R"({"traceEvents": []})"), false)
                .info.read.events,
            0u);
}

TEST(TraceReader, DecodesFieldsAndArgs) {
  TraceBuilder b(test_dir());
  b.kernel("gemm", 1000.25, 3.5,
           {{"External id", 42},
            {"correlation", 7},
            {"M", 64},
            {"N", 32},
            {"K", 16},
            {"dtype", "bf16"}})
      .cpu_op("aten::mm", 990, 20,
              {{"External id", 42},
               {"Input Dims", {{64, 16}, {16, 32}}},
               {"Input type", {"c10::BFloat16", "c10::BFloat16"}}})
      .add({{"ph", "X"}, {"name", "no dur"}, {"ts", 5}, {"pid", "CPU functions"}, {"tid", 1}});
  std::vector<TraceEvent> events;
  std::vector<std::string> names, dims;
  read_trace(
      b.write("t.json"), [](auto, auto) {},
      [&](const TraceEvent& e) {
        events.push_back(e);
        names.emplace_back(e.name);
        dims.emplace_back(e.args.input_dims);
      },
      false);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(names[0], "gemm");
  EXPECT_EQ(events[0].ts_ns, 1000250);
  EXPECT_EQ(events[0].dur_ns, 3500);
  EXPECT_EQ(events[0].args.external_id, 42);
  EXPECT_EQ(events[0].args.correlation, 7);
  EXPECT_EQ(events[0].args.m, 64);
  EXPECT_EQ(events[0].args.k, 16);
  EXPECT_EQ(dims[1], "[[64,16],[16,32]]");
  EXPECT_TRUE(events[2].pid_is_string);
  EXPECT_FALSE(events[2].has_dur);
}

TEST(TraceReader, MissingFieldsAreCountedNotFatal) {
  TraceBuilder b(test_dir());
  b.kernel("k", 0, 1).add({{"ph", "X"}, {"cat", "kernel"}, {"name", "broken"}, {"ts", 3}});
  TraceData d = TraceData::load(b.write("t.json"), false);
  EXPECT_EQ(d.gpu.size(), 1u);
  EXPECT_EQ(d.info.missing_fields, 1u);
  EXPECT_NE(d.info.first_missing.find("broken"), std::string::npos);
}

TEST(TraceReader, MicrosecondsToNanosecondsIsExact) {
  EXPECT_EQ(parse_us_to_ns("4456987046204.646"), 4456987046204646);
  EXPECT_EQ(parse_us_to_ns("12"), 12000);
  EXPECT_EQ(parse_us_to_ns("0.0005"), 1);  // rounds to the nearest ns
  EXPECT_EQ(parse_us_to_ns("-1.5"), -1500);
  EXPECT_EQ(parse_us_to_ns("\"7.25\""), 7250);
  EXPECT_EQ(parse_us_to_ns("1e3"), 1000000);
  EXPECT_FALSE(parse_us_to_ns("abc").has_value());
}

}  // namespace
}  // namespace tessera::analysis
