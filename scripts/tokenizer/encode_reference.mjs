// Reference encoder for Tessera's tokenizer tests and benchmark: encodes text files with
// @huggingface/tokenizers (the Hugging Face JS implementation) and writes the ids as JSON.
//
//   node scripts/tokenizer/encode_reference.mjs TOKENIZER_JSON [--out FILE] [--repeat N] TEXT...
//
// Output: {"seconds": S, "bytes": B, "ids": [[...], ...]} with one id list per text file,
// in argument order. Files are read as UTF-8 (invalid bytes become U+FFFD, as in any JS
// string). No special tokens are added (BOS and the like are the caller's choice). `seconds`
// times the encode loop only (file reading and JSON excluded): the fastest of N passes.
import { readFileSync, writeFileSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";

const args = process.argv.slice(2);
let out = null;
let repeat = 1;
const files = [];
for (let i = 1; i < args.length; ++i) {
  if (args[i] === "--out") out = args[++i];
  else if (args[i] === "--repeat") repeat = Number(args[++i]);
  else files.push(args[i]);
}
if (args.length < 1 || !(repeat >= 1)) {
  console.error("usage: encode_reference.mjs TOKENIZER_JSON [--out FILE] [--repeat N] TEXT...");
  process.exit(2);
}

const tokenizer_json = JSON.parse(readFileSync(args[0], "utf8"));
const config_path = join(dirname(args[0]), "tokenizer_config.json");
const config = existsSync(config_path) ? JSON.parse(readFileSync(config_path, "utf8")) : {};
const tokenizer = new Tokenizer(tokenizer_json, config);

const decoder = new TextDecoder("utf-8");
const texts = files.map((f) => decoder.decode(readFileSync(f)));
const bytes = files.reduce((n, f) => n + readFileSync(f).length, 0);

let ids = [];
let seconds = Infinity;
for (let pass = 0; pass < repeat; ++pass) {
  const start = process.hrtime.bigint();
  ids = texts.map((t) => tokenizer.encode(t, { add_special_tokens: false }).ids);
  seconds = Math.min(seconds, Number(process.hrtime.bigint() - start) / 1e9);
}

const result = JSON.stringify({ seconds, bytes, ids });
if (out) writeFileSync(out, result);
else process.stdout.write(result + "\n");
