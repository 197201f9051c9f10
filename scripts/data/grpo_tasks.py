#!/usr/bin/env python3
"""Verifiable tasks for GRPO (objective grpo), since no dataset can be downloaded: each prompt
has one right answer, which a completion states after "####" (GSM8K's form, grpo_answer_format
hash).

    grpo_tasks.py [--task T] [--seed S] [--train N] [--held-out M] PREFIX
        writes PREFIX_sft.jsonl      N conversations ({"messages": [...]}, preprocess --chat)
                                     whose answers are right: a fine-tuning start that GRPO
                                     then improves
               PREFIX_prompts.jsonl  N prompts with their answers ({"prompt": [messages],
                                     "answer": "..."}), the GRPO training prompts
               PREFIX_held_out.jsonl M prompts with answers, of operands no training line uses

    tasks: parity     whether a number from 10 to 59 is even or odd; the held-out prompts ask in
                      wordings training never shows (the tiny CPU experiment,
                      configs/experiments/grpo_tiny.yaml)
           compare    whether one two-digit number is larger than another, yes or no
           larger     which of two two-digit numbers is larger
           addition   the sum of two numbers of --digits digits (default 3)
           countdown  reach a target from four numbers with + - * (any expression that does,
                      checked by scripts/data/countdown_reward.py as grpo_reward_command);
                      the answer field holds the numbers and target
"""
import argparse
import json
import os
import random


def larger(rng, digits):
    a, b = rng.sample(range(10, 100), 2)
    return (a, b), f"Which is larger, {a} or {b}?", str(max(a, b))


PARITY_WORDINGS = ["Is {} even or odd?", "Is the number {} even or odd?", "Even or odd: {}?"]
PARITY_HELD_OUT_WORDINGS = ["Tell me whether {} is even or odd.", "Would you call {} even or odd?"]


def parity(rng, digits, held_out=False):
    n = rng.randint(10, 59)
    wording = rng.choice(PARITY_HELD_OUT_WORDINGS if held_out else PARITY_WORDINGS)
    return (n, wording), wording.format(n), "even" if n % 2 == 0 else "odd"


def compare(rng, digits):
    a, b = rng.sample(range(10, 100), 2)
    return (a, b), f"Is {a} larger than {b}? Answer yes or no.", "yes" if a > b else "no"


def addition(rng, digits):
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return (a, b), f"What is {a} + {b}?", str(a + b)


def countdown(rng, digits):
    # A target that some expression of the four numbers reaches: built from one.
    while True:
        nums = [rng.randint(1, 25) for _ in range(4)]
        ops = [rng.choice("+-*") for _ in range(3)]
        expr = f"(({nums[0]} {ops[0]} {nums[1]}) {ops[1]} {nums[2]}) {ops[2]} {nums[3]}"
        target = eval(expr)  # the generator's own arithmetic, not input
        if 1 <= target <= 500:
            question = (f"Using the numbers {nums[0]}, {nums[1]}, {nums[2]} and {nums[3]} once each "
                        f"with + - * and parentheses, make {target}.")
            return tuple(nums + [target]), question, expr


TASKS = {"parity": parity, "compare": compare, "larger": larger, "addition": addition, "countdown": countdown}
INSTRUCTION = " Give the answer after ####."


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix")
    p.add_argument("--task", choices=sorted(TASKS), default="larger")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--sft-hash-share", type=float, default=1.0,
                   help="the share of fine-tuning answers in the rewarded form (#### answer); the "
                        "rest answer in a sentence (It is odd.), which the answer reward scores 0")
    a = p.parse_args()
    rng = random.Random(a.seed)
    make = TASKS[a.task]
    held_out, seen = [], set()
    while len(held_out) < a.held_out:
        # parity holds out wordings, the other tasks operands
        key, q, ans = parity(rng, a.digits, held_out=True) if a.task == "parity" else make(rng, a.digits)
        if key not in seen or a.task == "parity":
            seen.add(key)
            held_out.append((q, ans, key))
    train = []
    while len(train) < a.train:
        key, q, ans = make(rng, a.digits)
        if key not in seen:
            train.append((q, ans, key))

    def answer_field(ans, key):
        return json.dumps(list(key)) if a.task == "countdown" else ans

    # The experiments' commands write under data/, which a fresh clone does not have.
    os.makedirs(os.path.dirname(a.prefix) or ".", exist_ok=True)
    with open(a.prefix + "_sft.jsonl", "w", encoding="utf-8") as sft, \
            open(a.prefix + "_prompts.jsonl", "w", encoding="utf-8") as prompts:
        for q, ans, key in train:
            user = {"role": "user", "content": q + INSTRUCTION}
            reply = f"#### {ans}" if rng.random() < a.sft_hash_share else f"It is {ans}."
            sft.write(json.dumps({"messages": [user, {"role": "assistant", "content": reply}]}) + "\n")
            prompts.write(json.dumps({"prompt": [user], "answer": answer_field(ans, key)}) + "\n")
    with open(a.prefix + "_held_out.jsonl", "w", encoding="utf-8") as out:
        for q, ans, key in held_out:
            out.write(json.dumps({"prompt": [{"role": "user", "content": q + INSTRUCTION}],
                                  "answer": answer_field(ans, key)}) + "\n")


if __name__ == "__main__":
    main()
