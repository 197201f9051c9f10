// Chat templates against Python's jinja2 as transformers configures it
// (scripts/tokenizer/render_chat_reference.py): the language's corners, and the shipped
// tokenizers' templates on conversations, whose ids are then checked against
// @huggingface/tokenizers. Also: which tokens are whose, and refusals of bad chat data.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/config/tokenizer_model.h"
#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/data/jinja.h"
#include "tokenizer/tokenizer_test_util.h"

namespace tessera::testing {
namespace {

using nlohmann::ordered_json;

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The reference's {"text"} or {"error"} for each case.
ordered_json reference(const ordered_json& cases, const ScratchDir& dir) {
  const fs::path in = dir / "cases.json", out = dir / "rendered.json";
  write_file(in, cases.dump());
  const fs::path script = fs::path(TESSERA_SOURCE_DIR) / "scripts" / "tokenizer" / "render_chat_reference.py";
  const std::string cmd = std::string(TESSERA_PYTHON) + " " + quote(script.string()) + " " +
                          quote(in.string()) + " " + quote(out.string());
  EXPECT_EQ(std::system(cmd.c_str()), 0)
      << cmd << " failed: Python's jinja2 is the reference (scripts/setup.sh --test installs python3-jinja2)";
  return ordered_json::parse(read_file(out));
}

std::string render(const std::string& source, const ordered_json& context) {
  std::map<std::string, jinja::Value> vars;
  for (const auto& [k, v] : context.items()) vars[k] = jinja::from_json(v);
  return jinja::Template(source, "case").render(vars).text;
}

TEST(ChatTemplate, LanguageMatchesJinja2) {
  const ordered_json ctx = {
      {"messages", {{{"role", "system"}, {"content", "  Be brief.\n"}},
                    {{"role", "user"}, {"content", "Hi <b>"}},
                    {{"role", "assistant"}, {"content", "<think>\nhmm\n</think>\n\nHello!"}}}},
      {"n", 7},
      {"x", 2.5},
      {"s", "Hello, World"},
      {"d", {{"b", 1}, {"a", {1, 2, "three", nullptr, true}}}},
      {"empty", ordered_json::array()},
      {"none", nullptr}};
  const std::vector<std::string> templates = {
      // Whitespace: trim_blocks, lstrip_blocks, '-' and '+'.
      "a\n  {% if true %}\n  b\n  {% endif %}\nc",
      "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}",
      "x  {%- if true -%}  y  {%- endif -%}  z",
      "  {%+ if true %}kept{% endif %}\n",
      "{# comment #}\nafter\n  {# indented comment #}\nend",
      "{{ 'a' }}\n{{ 'b' }}\n",
      // Expressions and precedence.
      "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }}",
      "{{ 7 / 2 }} {{ 1.0 }} {{ x * 2 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }} {{ 3.0e2 }}",
      "{{ 'a' ~ 1 ~ none }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ 'x' + 'y' | upper }}",
      "{{ 1 < 2 < 3 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ none == none }} {{ 'a' in 'cat' }} {{ 2 not in [1] }}",
      "{{ not 1 and 0 or 'z' }} {{ '' or 'e' }} {{ 0 and 1 }} {{ 'y' if n > 3 else 'n' }} {{ 'y' if n > 9 }}|",
      "{{ messages[0]['content'] | trim }}|{{ messages[-1].role }}|{{ messages[5] is defined }}",
      "{{ s[1:4] }} {{ s[::-1] }} {{ s[-5:] }} {{ messages[::-1][0].role }} {{ s[::2] }}",
      "{{ none }} {{ true }} {{ [1, 'a', none, 2.0] }} {{ d }} {{ undefined_name }}|",
      // Strings.
      "{{ s.upper() }} {{ s.lower() }} {{ s.split(', ') }} {{ '  a b  '.split() }} {{ s.startswith('He') }}",
      "{{ s.endswith(('x', 'ld')) }} {{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }} {{ '-x-'.strip('-') }}",
      "{{ messages[2].content.split('</think>')[-1].lstrip('\\n') }}|{{ messages[2].content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}",
      "{{ 'tab\\tnew\\nline \\u00e9 \\x41' }} {{ \"dq'\" }} {{ 'a' 'b' }} {{ s.find('W') }} {{ s.count('l') }}",
      "{{ 'héllo wörld'.title() }} {{ 'hello'.capitalize() }} {{ 'é'|length }} {{ 'añb'[1] }}",
      // Filters.
      "{{ messages | length }} {{ s | length }} {{ d | tojson }} {{ messages[0] | tojson }} {{ 'é\"\\n' | tojson }}",
      "{{ d | tojson(indent=2) }}",
      "{{ [3, 1, 3] | unique | list }} {{ [1, 2] | first }} {{ [1, 2] | last }} {{ 'abc' | reverse }} {{ [1, 2] | reverse | list }}",
      "{{ ['a', 'b'] | join(', ') }} {{ messages | map(attribute='role') | join('/') }} {{ missing | default('dflt') }} {{ '' | default('x', true) }}",
      "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ messages | rejectattr('role', 'eq', 'user') | map(attribute='role') | list }}",
      "{{ '42' | int }} {{ 'x' | int }} {{ 3.9 | int }} {{ '2.5' | float }} {{ -3 | abs }} {{ d | items | list }}",
      "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ s | string }} {{ 1 | string }}",
      "{{ [1, 2, 3, 4] | select('even') | list }} {{ [1, 2, 3] | reject('odd') | list }} {{ ['a', 'B'] | map('upper') | list }}",
      // Tests.
      "{{ n is number }} {{ n is integer }} {{ x is float }} {{ s is string }} {{ d is mapping }} {{ empty is iterable }} {{ none is none }}",
      "{{ n is odd }} {{ n is even }} {{ n is divisibleby 7 }} {{ n is not defined }} {{ zz is undefined }} {{ true is true }} {{ 'ab' is lower }}",
      "{{ n is eq 7 }} {{ n is gt 3 }} {{ 'u' is in 'user' }} {{ n is ge(8) }}",
      // Statements.
      "{% set count = 0 %}{% for i in range(3) %}{% set count = count + 1 %}{{ count }}{% endfor %}{{ count }}",
      "{% set ns = namespace(k=0, found=false) %}{% for m in messages %}{% set ns.k = ns.k + 1 %}{% if m.role == 'user' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.k }} {{ ns.found }}",
      "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }} {% endfor %}",
      "{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role }}{% else %}none{% endfor %}|{% for e in empty %}x{% else %}empty{% endfor %}",
      "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
      "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
      "{% for i in range(1, 10, 3) %}{{ i }}{{ loop.cycle('a', 'b') }}{{ loop.previtem }}{% endfor %}",
      "{% if n > 10 %}big{% elif n > 5 %}mid{% else %}small{% endif %}",
      "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', punct='?') }}",
      "{% set block %}inner {{ n }}{% endset %}[{{ block }}]",
      "{% generation %}gen {{ n }}{% endgeneration %}",
      "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t }}",
      "{{ d.get('b') }} {{ d.get('zz', 'dflt') }} {{ d.keys() | list }} {{ d.values() | list | length }} {{ d.a[2] }}",
      "{{ {'k': 'v', 'n': [1, {'x': none}]} | tojson }} {{ dict(a=1) }}",
      // Refusals: both must refuse.
      "{{ raise_exception('no system messages') }}",
      "{{ undefined_name.attr }}",
      "{{ 1 + 'a' }}",
      "{{ 1 / 0 }}",
      "{% for x in none %}{% endfor %}",
      "{% if %}",
      "{{ messages[0].role.nope() }}",
  };
  ordered_json cases = ordered_json::array();
  for (const auto& t : templates) cases.push_back({{"template", t}, {"context", ctx}});
  ScratchDir dir;
  const ordered_json expected = reference(cases, dir);
  ASSERT_EQ(expected.size(), templates.size());
  for (size_t k = 0; k < templates.size(); ++k) {
    std::string got, error;
    try {
      got = render(templates[k], ctx);
    } catch (const DataError& e) {
      error = e.what();
    }
    if (expected[k].contains("error")) {
      EXPECT_FALSE(error.empty()) << templates[k] << "\njinja2 refuses (" << expected[k]["error"]
                                  << ") but Tessera rendered: " << got;
    } else {
      EXPECT_EQ(got, expected[k]["text"].get<std::string>()) << templates[k] << "\nTessera's error: " << error;
    }
  }
}

// Templates in the style of other families' (Mistral's role alternation, Gemma's renamed roles,
// Llama 3.1's with tools, dates and tool calls), each on conversations they accept and refuse.
TEST(ChatTemplate, OtherFamiliesTemplatesMatchJinja2) {
  const std::vector<std::string> templates = {
      // Mistral-style: [INST] turns, alternation enforced.
      "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
      "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
      "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
      "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
      // Gemma-style: no system role, 'model' for the assistant, trimmed content.
      "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
      "{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
      "{% else %}{% set role = message['role'] %}{% endif %}"
      "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}",
      // Llama 3.1-style: system header with dates, tools as JSON, tool calls and results.
      R"({{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
)"};
  const ordered_json tools = ordered_json::parse(R"([{"type": "function", "function": {"name": "weather",
      "description": "Today's weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  const std::vector<ordered_json> conversations = {
      ordered_json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello! "}])"),
      ordered_json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])"),
      ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])"),
      ordered_json::parse(R"([{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "21 degrees."}])")};
  ordered_json cases = ordered_json::array();
  std::vector<std::pair<size_t, ordered_json>> contexts;
  for (size_t t = 0; t < templates.size(); ++t)
    for (const auto& messages : conversations)
      for (const bool with_tools : {false, true}) {
        ordered_json context = {{"messages", messages}, {"add_generation_prompt", true},
                                {"bos_token", "<s>"}, {"eos_token", "</s>"}};
        if (with_tools) context["tools"] = tools;
        cases.push_back({{"template", templates[t]}, {"context", context}});
        contexts.emplace_back(t, context);
      }
  ScratchDir dir;
  const ordered_json expected = reference(cases, dir);
  ASSERT_EQ(expected.size(), cases.size());
  int rendered = 0, refused = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    std::string got, error;
    try {
      got = render(templates[contexts[k].first], contexts[k].second);
    } catch (const DataError& e) {
      error = e.what();
    }
    if (expected[k].contains("error")) {
      ++refused;
      EXPECT_FALSE(error.empty()) << "template " << contexts[k].first << ", case " << k << ": jinja2 refuses ("
                                  << expected[k]["error"] << ") but Tessera rendered: " << got;
    } else {
      ++rendered;
      EXPECT_EQ(got, expected[k]["text"].get<std::string>())
          << "template " << contexts[k].first << ", case " << k << "\nTessera's error: " << error;
    }
  }
  EXPECT_GT(rendered, 8);
  EXPECT_GT(refused, 3);  // alternation, system role
}

// Conversations the shipped templates are checked on.
std::vector<ordered_json> conversations() {
  return {
      {{{"role", "user"}, {"content", "What is 2+2?"}}, {{"role", "assistant"}, {"content", "4"}}},
      {{{"role", "system"}, {"content", "You are terse.\n"}},
       {{"role", "user"}, {"content", "  Name a colour.  "}},
       {{"role", "assistant"}, {"content", "Blue."}},
       {{"role", "user"}, {"content", "Another, in French: é, ü, 日本?"}},
       {{"role", "assistant"}, {"content", "Rouge.\n"}}},
      {{{"role", "user"}, {"content", "Think first."}},
       {{"role", "assistant"}, {"content", "<think>\nEasy.\n</think>\n\nDone."}},
       {{"role", "user"}, {"content", "Again?"}},
       {{"role", "assistant"}, {"content", "<think>\nStill easy.\n</think>\n\nDone again."}}},
      {{{"role", "user"}, {"content", "Weather?"}},
       {{"role", "assistant"}, {"content", "Let me check."}},
       {{"role", "tool"}, {"content", "{\"temp\": 21}"}},
       {{"role", "assistant"}, {"content", "21 degrees."}}},
  };
}

std::string tokenizer_dir(const std::string& name) {
  return fs::path(tokenizer_json_path(name)).parent_path().string();
}

TEST(ChatTemplate, ShippedTemplatesRenderAndTokenizeAsTransformers) {
  ASSERT_EQ(std::system("node --version > /dev/null 2>&1"), 0) << "node runs the reference tokenizer";
  ordered_json cases = ordered_json::array();
  std::vector<std::pair<std::string, ordered_json>> runs;
  for (const std::string name : {"llama3", "llama3.1", "qwen3"})
    for (const auto& messages : conversations())
      for (const bool generation_prompt : {false, true}) {
        cases.push_back({{"tokenizer_dir", tokenizer_dir(name)},
                         {"messages", messages},
                         {"add_generation_prompt", generation_prompt}});
        runs.emplace_back(name, messages);
      }
  ScratchDir dir;
  const ordered_json expected = reference(cases, dir);
  ASSERT_EQ(expected.size(), cases.size());
  // The reference tokenizer's ids of each reference text: one node run per tokenizer.
  const fs::path script = fs::path(TESSERA_SOURCE_DIR) / "scripts" / "tokenizer" / "encode_reference.mjs";
  std::map<std::string, std::vector<size_t>> cases_of;
  for (size_t k = 0; k < cases.size(); ++k) {
    ASSERT_TRUE(expected[k].contains("text")) << expected[k];
    write_file(dir / fmt::format("text{}.txt", k), expected[k]["text"].get<std::string>());
    cases_of[runs[k].first].push_back(k);
  }
  std::vector<std::vector<int32_t>> reference_ids(cases.size());
  for (const auto& [name, ks] : cases_of) {
    const fs::path ids_file = dir / (name + ".json");
    std::string cmd = "node " + quote(script.string()) + " " + quote(tokenizer_json_path(name)) + " --out " +
                      quote(ids_file.string());
    for (const size_t k : ks) cmd += " " + quote((dir / fmt::format("text{}.txt", k)).string());
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const ordered_json ids = ordered_json::parse(read_file(ids_file))["ids"];
    for (size_t i = 0; i < ks.size(); ++i) reference_ids[ks[i]] = ids[i].get<std::vector<int32_t>>();
  }
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string& name = runs[k].first;
    const std::string text = expected[k]["text"];
    const Tokenizer& tokenizer = shipped(name);
    const ChatFormat chat(tokenizer_json_path(name), tokenizer);
    const bool generation_prompt = cases[k]["add_generation_prompt"];
    const std::vector<int32_t> ids =
        generation_prompt ? chat.encode_prompt(runs[k].second, "case")
                          : chat.encode({{"messages", runs[k].second}}, "case").ids;
    EXPECT_EQ(tokenizer.decode(ids), text) << name << " case " << k;
    EXPECT_EQ(ids, reference_ids[k]) << name << " case " << k << ": " << text;
  }
}

// transformers' own apply_chat_template ids, recorded on the GPU machine (which has
// transformers) by scripts/tokenizer/chat_template_transformers_check.py: the CPU encoding of
// the same conversations must stay equal to them.
TEST(ChatTemplate, IdsEqualTransformersRecordedIds) {
  const ordered_json recorded = ordered_json::parse(
      read_file(fs::path(TESSERA_SOURCE_DIR) / "tests" / "data" / "tokenizer" / "chat_template_transformers_ids.json"));
  ASSERT_EQ(recorded["ids"].size(), 3u);
  for (const auto& [name, per_conversation] : recorded["ids"].items()) {
    const ChatFormat chat(tokenizer_json_path(name), shipped(name));
    ASSERT_EQ(per_conversation.size(), recorded["conversations"].size());
    for (size_t k = 0; k < per_conversation.size(); ++k)
      EXPECT_EQ(chat.encode({{"messages", recorded["conversations"][k]}}, "recorded").ids,
                per_conversation[k].get<std::vector<int32_t>>())
          << name << " conversation " << k;
  }
}

// The text of the tokens with `role`, each run of them on its own line.
std::string text_of(const Tokenizer& t, const ChatSample& s, TokenRole role) {
  std::string out;
  for (size_t k = 0; k < s.ids.size(); ++k) {
    if (token_role(s.roles[k]) != role) continue;
    if (k > 0 && token_role(s.roles[k - 1]) != role && !out.empty()) out += "|";
    out += t.decode({s.ids[k]});
  }
  return out;
}

// A line's tools (function schemas) reach the template as apply_chat_template's tools=: Qwen 3
// lists them in its system turn and renders the assistant's tool calls.
TEST(ChatTemplate, ToolsReachTheTemplate) {
  const ordered_json line = ordered_json::parse(R"({"tools": [{"type": "function", "function": {"name": "weather",
      "description": "Today's weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
      "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "21 degrees."}]})");
  ScratchDir dir;
  const ordered_json expected = reference(
      ordered_json::array({{{"tokenizer_dir", tokenizer_dir("qwen3")}, {"messages", line["messages"]},
                            {"tools", line["tools"]}, {"add_generation_prompt", false}}}),
      dir);
  ASSERT_TRUE(expected[0].contains("text")) << expected[0];
  const ChatFormat chat(tokenizer_json_path("qwen3"), shipped("qwen3"));
  const ChatSample s = chat.encode(line, "case");
  const std::string text = shipped("qwen3").decode(s.ids);
  EXPECT_EQ(text, expected[0]["text"].get<std::string>());
  EXPECT_NE(text.find("\"name\": \"weather\""), std::string::npos) << text;
  // The assistant's tool call is its own text: the tool's name is trained on.
  EXPECT_NE(text_of(shipped("qwen3"), s, TokenRole::Assistant).find("weather"), std::string::npos);
  EXPECT_THROW(chat.encode(ordered_json::parse(R"({"tools": 5, "messages": []})"), "case"), DataError);
}

TEST(ChatTemplate, TokensBelongToTheirMessagesAndTheAssistantOwnsItsClosingToken) {
  const auto messages = conversations()[1];
  const ChatSample llama = ChatFormat(tokenizer_json_path("llama3.1"), shipped("llama3.1"))
                               .encode({{"messages", messages}}, "case");
  EXPECT_EQ(text_of(shipped("llama3.1"), llama, TokenRole::Assistant), "Blue.<|eot_id|>|Rouge.<|eot_id|>");
  EXPECT_EQ(text_of(shipped("llama3.1"), llama, TokenRole::User), "Name a colour.|Another, in French: é, ü, 日本?");
  EXPECT_EQ(text_of(shipped("llama3.1"), llama, TokenRole::System), "You are terse.");

  // Qwen 3 moves the reasoning of the last turn into <think> and drops the earlier one's:
  // the roles follow the text wherever the template puts it.
  const ChatSample qwen = ChatFormat(tokenizer_json_path("qwen3"), shipped("qwen3"))
                              .encode({{"messages", conversations()[2]}}, "case");
  EXPECT_EQ(text_of(shipped("qwen3"), qwen, TokenRole::Assistant),
            "Done.<|im_end|>|Still easy.\n</think>\n\nDone again.<|im_end|>");
  // Plain prompt/completion: BOS, the prompt as the user's, the completion and EOS as the assistant's.
  const ChatSample plain = ChatFormat(tokenizer_json_path("llama3.1"), shipped("llama3.1"))
                               .encode({{"prompt", "2+2="}, {"completion", "4"}}, "case");
  EXPECT_EQ(shipped("llama3.1").decode(plain.ids), "<|begin_of_text|>2+2=4<|eot_id|>");
  EXPECT_EQ(text_of(shipped("llama3.1"), plain, TokenRole::Assistant), "4<|eot_id|>");
  EXPECT_EQ(text_of(shipped("llama3.1"), plain, TokenRole::User), "2+2=");
}

TEST(ChatTemplate, BadChatDataIsRefusedNamingTheField) {
  const ChatFormat chat(tokenizer_json_path("qwen3"), shipped("qwen3"));
  const auto error = [&](const std::string& line) -> std::string {
    try {
      chat.encode(ordered_json::parse(line), "data.jsonl:7");
    } catch (const DataError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  const std::string user = R"({"role": "user", "content": "hi"})", bot = R"({"role": "assistant", "content": "yo"})";
  EXPECT_EQ(error(R"({"messages": [{"content": "hi"}, )" + bot + "]}"), "data.jsonl:7: messages[0] has no 'role'");
  EXPECT_EQ(error(R"({"messages": [{"role": "bot", "content": "hi"}, )" + bot + "]}"),
            "data.jsonl:7: messages[0].role is \"bot\"; expected one of system, user, assistant, tool");
  EXPECT_EQ(error(R"({"messages": [)" + user + R"(, {"role": "assistant", "content": ""}]})"),
            "data.jsonl:7: messages[1].content is empty");
  EXPECT_EQ(error(R"({"messages": [)" + user + R"(, {"role": "assistant"}]})"),
            "data.jsonl:7: messages[1] has no 'content'");
  EXPECT_EQ(error(R"({"messages": [)" + user + R"(, {"role": "assistant", "content": 5}]})"),
            "data.jsonl:7: messages[1].content is a JSON number; expected a string");
  EXPECT_TRUE(error(R"({"messages": [)" + user + "," + bot + "," + user + "]}").starts_with(
      "data.jsonl:7: the conversation ends with a 'user' message; expected it to end with the assistant's answer"));
  EXPECT_EQ(error(R"({"messages": []})"), "data.jsonl:7: 'messages' is not a non-empty list of messages");
  EXPECT_TRUE(error(R"({"text": "hi"})").starts_with("data.jsonl:7: neither 'messages' nor 'prompt' and 'completion'"));
  EXPECT_EQ(error(R"({"prompt": "", "completion": "x"})"),
            "data.jsonl:7: 'prompt' is empty; expected a non-empty string (or a list of messages)");
  EXPECT_EQ(error(R"({"prompt": [)" + user + R"(], "completion": [)" + user + "]}"),
            "data.jsonl:7: completion holds a 'user' message; expected only the assistant's");
  // A tokenizer without a chat template cannot render conversations, and says so.
  try {
    ChatFormat(tokenizer_json_path("llama2"), shipped("llama2"));
    ADD_FAILURE() << "llama2 has no chat template";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("no chat template"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, HostileTemplatesAreRefusedWithinBounds) {
  const auto error = [](const std::string& source) -> std::string {
    try {
      jinja::Template(source, "t").render({});
    } catch (const DataError& e) {
      return e.what();
    }
    return "(rendered)";
  };
  EXPECT_NE(error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").find("steps"),
            std::string::npos);
  EXPECT_NE(error("{{ 'x' * 100000000 }}").find("bound"), std::string::npos);
  EXPECT_NE(error("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}")
                .find("nested deeper"),
            std::string::npos);
  EXPECT_NE(error("{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}").find("deeper"),
            std::string::npos);
  EXPECT_NE(error(std::string(300, '{') + "1" + std::string(300, '}')).find("t line 1"), std::string::npos);
  EXPECT_NE(error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").find("too deeply"), std::string::npos);
  EXPECT_EQ(error("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ ns.me | length }}"), "(rendered)");
  EXPECT_NE(error("{% raw %}x{% endraw %}").find("'raw' is not supported"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing
