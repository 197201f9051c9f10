#!/usr/bin/env python3
"""GRPO's command reward for grpo_tasks.py --task countdown (grpo_reward_command): reads one
JSON object per line ({"prompt", "completion", "answer"}, the answer holding the four numbers
and the target) and writes 1 when the expression after the completion's last "####" uses each
number once, only + - * and parentheses, and equals the target; else 0."""
import ast
import json
import sys


def value(node, used):
    if isinstance(node, ast.Expression):
        return value(node.body, used)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = value(node.left, used), value(node.right, used)
        return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
    raise ValueError("not + - * of numbers")


def reward(completion, answer):
    *numbers, target = json.loads(answer)
    if "####" not in completion:
        return 0
    expression = completion.rsplit("####", 1)[1].strip().splitlines()[0] if completion.rsplit("####", 1)[1].strip() else ""
    try:
        used = []
        result = value(ast.parse(expression, mode="eval"), used)
    except (SyntaxError, ValueError, RecursionError):
        return 0
    return 1 if result == target and sorted(used) == sorted(numbers) else 0


for line in sys.stdin:
    q = json.loads(line)
    print(reward(q["completion"], q["answer"]))
