#include "tessera/analysis/trace_merge.h"

#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>
#include <simdjson.h>
#include <nlohmann/json.hpp>

#include "tessera/analysis/json_stream.h"
#include "tessera/analysis/progress.h"
#include "tessera/analysis/ranks.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

namespace fs = std::filesystem;
namespace od = simdjson::ondemand;

// Plain or gzip output with one interface.
class OutputFile {
 public:
  explicit OutputFile(const std::string& path) : path_(path) {
    if (path.ends_with(".gz")) {
      gz_ = gzopen(path.c_str(), "wb6");
      if (gz_) gzbuffer(gz_, 1u << 20);
    } else {
      f_ = std::fopen(path.c_str(), "wb");
    }
    if (!gz_ && !f_) throw DataError(fmt::format("{}: cannot create output file", path));
  }
  ~OutputFile() {
    if (gz_) gzclose(gz_);
    if (f_) std::fclose(f_);
  }
  void write(std::string_view s) {
    if (s.empty()) return;
    bool ok =
        gz_ ? gzwrite(gz_, s.data(), static_cast<unsigned>(s.size())) == static_cast<int>(s.size())
            : std::fwrite(s.data(), 1, s.size(), f_) == s.size();
    if (!ok) throw DataError(fmt::format("{}: write failed (disk full?)", path_));
  }
  void close() {
    int rc = gz_ ? gzclose(gz_) : std::fclose(f_);
    gz_ = nullptr;
    f_ = nullptr;
    if (rc != 0) throw DataError(fmt::format("{}: closing the output failed", path_));
  }

 private:
  std::string path_;
  gzFile gz_ = nullptr;
  FILE* f_ = nullptr;
};

struct StopScan {};

// distributedInfo.rank, read from the members before traceEvents (where Kineto writes it).
std::optional<int> peek_rank(const std::string& path) {
  std::optional<int> rank;
  TraceScanner scanner(path, open_byte_source(path));
  TraceScanner::Handler h;
  h.on_member = [&](std::string_view key, std::string_view value) {
    if (key != "distributedInfo") return;
    auto j = nlohmann::json::parse(value, nullptr, false);
    if (j.is_object() && j.contains("rank") && j["rank"].is_number_integer()) {
      rank = j["rank"].get<int>();
    }
  };
  h.on_event = [](const PaddedText&, uint64_t) { throw StopScan{}; };
  try {
    scanner.scan(h);
  } catch (const StopScan&) {
  }
  return rank;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\n' || s.back() == '\r' || s.back() == '\t')) {
    s.remove_suffix(1);
  }
  return s;
}

// Rewrites events of one rank: new pids, rank-unique flow ids, replaced process metadata.
class RankRewriter {
 public:
  RankRewriter(int rank, int num_ranks, std::map<std::pair<int, std::string>, int>& pids,
               std::map<int, std::string>& names)
      : rank_(rank), num_ranks_(num_ranks), pids_(pids), names_(names) {}

  // Returns false when the event is dropped (the inputs' process_name / sort_index).
  bool rewrite(od::parser& parser, const PaddedText& text, std::string& out) {
    od::document doc =
        parser.iterate(simdjson::padded_string_view(text.data, text.size, text.capacity));
    std::string_view ph, name, args_raw;
    struct Edit {
      size_t begin, end;
      std::string with;
    };
    std::vector<Edit> edits;
    std::string_view pid_token;
    for (auto field : doc.get_object()) {
      std::string_view key = field.unescaped_key();
      od::value v = field.value();
      if (key == "ph") {
        ph = v.get_string();
      } else if (key == "name") {
        name = v.get_string();
      } else if (key == "pid" || key == "id" || key == "bind_id") {
        std::string_view tok = trim(v.raw_json_token());
        size_t begin = static_cast<size_t>(tok.data() - text.data);
        if (key == "pid") {
          pid_token = tok;
          edits.push_back({begin, begin + tok.size(), ""});  // filled below
        } else {
          edits.push_back({begin, begin + tok.size(), rank_id(tok)});
        }
      } else if (key == "args") {
        od::object o;
        if (!v.get_object().get(o)) args_raw = o.raw_json();
      }
    }
    const int pid = pid_token.empty() ? -1 : new_pid(pid_token);
    if (ph == "M" && (name == "process_name" || name == "process_sort_index")) {
      if (name == "process_name" && pid >= 0) {
        auto j = nlohmann::json::parse(args_raw, nullptr, false);
        if (j.is_object() && j.contains("name") && j["name"].is_string()) {
          names_[pid] = j["name"].get<std::string>();
        }
      }
      return false;
    }
    for (Edit& e : edits) {
      if (e.with.empty()) e.with = std::to_string(pid);
    }
    std::sort(edits.begin(), edits.end(),
              [](const Edit& a, const Edit& b) { return a.begin < b.begin; });
    size_t at = 0;
    for (const Edit& e : edits) {
      out.append(text.data + at, e.begin - at);
      out += e.with;
      at = e.end;
    }
    out.append(text.data + at, text.size - at);
    return true;
  }

 private:
  int new_pid(std::string_view token) {
    auto key = std::make_pair(rank_, std::string(token));
    auto it = pids_.find(key);
    if (it != pids_.end()) return it->second;
    int id = static_cast<int>(pids_.size()) + 1;
    pids_.emplace(key, id);
    return id;
  }

  std::string rank_id(std::string_view tok) const {
    if (!tok.empty() && tok.front() == '"') {
      return fmt::format("\"r{}:{}", rank_, tok.substr(1));
    }
    // Ids must stay exact in a double (what JSON readers use), else fall back to a string.
    double v = 0;
    auto [p, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    const double limit = 9007199254740992.0 / num_ranks_;
    if (ec == std::errc() && std::fabs(v) < limit && v == std::floor(v)) {
      return fmt::format("{}", static_cast<int64_t>(v) * num_ranks_ + rank_);
    }
    return fmt::format("\"r{}:{}\"", rank_, tok);
  }

  int rank_;
  int num_ranks_;
  std::map<std::pair<int, std::string>, int>& pids_;
  std::map<int, std::string>& names_;
};

}  // namespace

std::vector<MergeInput> resolve_merge_inputs(const std::vector<std::string>& dirs_or_files) {
  std::vector<std::string> files;
  for (const std::string& p : dirs_or_files) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      for (const std::string& f : trace_files_in(p)) files.push_back(f);
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else {
      throw DataError(fmt::format("{}: no such trace file or directory", p));
    }
  }
  if (files.empty()) throw DataError("trace merge: no input traces");
  std::vector<MergeInput> inputs;
  std::set<int> seen;
  for (size_t i = 0; i < files.size(); ++i) {
    auto rank = rank_from_filename(fs::path(files[i]).filename().string());
    if (!rank) rank = peek_rank(files[i]);
    int r = rank.value_or(static_cast<int>(i));
    if (!seen.insert(r).second) {
      throw DataError(fmt::format("{}: rank {} appears twice among the inputs", files[i], r));
    }
    inputs.push_back({r, files[i]});
  }
  std::sort(inputs.begin(), inputs.end(),
            [](const MergeInput& a, const MergeInput& b) { return a.rank < b.rank; });
  return inputs;
}

MergeStats merge_traces(const std::vector<MergeInput>& inputs, const std::string& output,
                        bool progress) {
  MergeStats stats;
  OutputFile out(output);
  out.write("{\"traceEvents\":[\n");
  std::map<std::pair<int, std::string>, int> pids;  // (rank, pid token) -> new pid
  std::map<int, std::string> names;                 // new pid -> original process name
  int num_ranks = 0;
  for (const MergeInput& in : inputs) num_ranks = std::max(num_ranks, in.rank + 1);
  od::parser parser;
  std::string event;
  bool first = true;
  uint64_t total_bytes = 0, done_bytes = 0;
  for (const MergeInput& in : inputs) total_bytes += fs::file_size(in.path);
  Progress bar("merging", total_bytes, progress);
  for (const MergeInput& in : inputs) {
    RankRewriter rewriter(in.rank, num_ranks, pids, names);
    TraceScanner scanner(in.path, open_byte_source(in.path));
    stats.file_bytes += scanner.source().file_size();
    TraceScanner::Handler h;
    h.on_event = [&](const PaddedText& text, uint64_t offset) {
      event.clear();
      if (!first) event = ",\n";
      try {
        if (!rewriter.rewrite(parser, text, event)) return;
      } catch (const simdjson::simdjson_error& e) {
        throw DataError(fmt::format("{}: invalid trace JSON in the event at byte {}: {}", in.path,
                                    offset, e.what()));
      }
      out.write(event);
      first = false;
      ++stats.events;
    };
    h.on_progress = [&](uint64_t bytes) { bar.update(done_bytes + bytes, stats.events); };
    scanner.scan(h);
    done_bytes += scanner.source().file_size();
    stats.json_bytes += scanner.bytes_scanned();
  }
  // Our own process metadata, one pair per (rank, process): Perfetto groups by these.
  for (const auto& [key, pid] : pids) {
    auto it = names.find(pid);
    std::string label = fmt::format("rank {}", key.first);
    if (it != names.end() && !it->second.empty()) label += " " + it->second;
    out.write(
        fmt::format("{}{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"tid\":0,"
                    "\"args\":{{\"name\":{}}}}},\n{{\"name\":\"process_sort_index\","
                    "\"ph\":\"M\",\"pid\":{},\"tid\":0,\"args\":{{\"sort_index\":{}}}}}",
                    first ? "" : ",\n", pid, nlohmann::json(label).dump(), pid, pid));
    first = false;
  }
  nlohmann::json sources = nlohmann::json::array();
  for (const MergeInput& in : inputs) sources.push_back({{"rank", in.rank}, {"file", in.path}});
  out.write(
      fmt::format("\n],\"displayTimeUnit\":\"ms\",\"otherData\":{{\"merged_by\":"
                  "\"tessera trace merge\",\"sources\":{}}}}}\n",
                  sources.dump()));
  out.close();
  stats.seconds = bar.finish();
  return stats;
}

}  // namespace tessera::analysis
