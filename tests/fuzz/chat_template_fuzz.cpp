// A chat template, as a tokenizer_config.json's chat_template reaches `preprocess --chat`: the
// input is the template's source, rendered on a conversation with the variables transformers
// gives it. Parsing and rendering must refuse (DataError) or finish within their bounds.
#include <nlohmann/json.hpp>

#include "fuzz/fuzz_support.h"
#include "tessera/data/jinja.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <b>\u00e9"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!",
     "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1, 2.5, null, true]}}}]},
    {"role": "tool", "content": "{\"ok\": 1}"}])");
  refusal_or_success([&] {
    const jinja::Template t(std::string(as_text(data, size)), "fuzz");
    t.render({{"messages", jinja::from_json(messages, 3)},
              {"add_generation_prompt", jinja::Value::boolean(true)},
              {"tools", jinja::Value::none()},
              {"bos_token", jinja::Value::string("<s>")},
              {"eos_token", jinja::Value::string("</s>")}});
  });
  return 0;
}
