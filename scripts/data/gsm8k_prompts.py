#!/usr/bin/env python3
"""GSM8K's JSON lines ("question", "answer": worked steps ending "#### 72") as GRPO chat prompts
(objective grpo, docs/finetuning.md#grpo): a system message asking for step-by-step reasoning
and the final answer in \\boxed{} (the instruction Qwen's math models are tuned on), the
question as the user's message, and the number after the last #### as the answer the reward
checks (grpo_answer_format boxed). Reads a file, writes one; a line without a question or a
#### answer stops with the file and line named, and nothing written.

    gsm8k_prompts.py INPUT.jsonl OUTPUT.jsonl [--system TEXT]
"""
import argparse
import json
import os
import sys
import tempfile

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def convert(line, number, path, system):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e.msg})")
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{path}:{number}: no \"question\" string")
    if not isinstance(answer, str) or "####" not in answer:
        raise ValueError(f"{path}:{number}: no \"answer\" ending with '#### <number>'")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"{path}:{number}: nothing after the last '####' of \"answer\"")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return json.dumps({"prompt": messages, "answer": final}, ensure_ascii=False)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--system", default=SYSTEM, help="the system message ('' for none)")
    a = p.parse_args()
    try:
        with open(a.input, encoding="utf-8") as f:
            out = [convert(line, i, a.input, a.system) for i, line in enumerate(f, 1) if line.strip()]
    except (OSError, ValueError) as e:
        sys.exit(f"gsm8k_prompts.py: {e}")
    if not out:
        sys.exit(f"gsm8k_prompts.py: {a.input}: no prompts")
    # Written whole under a temporary name, then renamed: a failure leaves no partial file.
    directory = os.path.dirname(os.path.abspath(a.output))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gsm8k_prompts.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, a.output)
    print(f"wrote {a.output}: {len(out)} prompts")


if __name__ == "__main__":
    main()
