#!/usr/bin/env python3
"""Reference renderer for Tessera's chat template tests: renders Jinja templates with Python's
jinja2 configured as transformers configures it for apply_chat_template (an immutable
sandbox with trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag, and
transformers' tojson, raise_exception and strftime_now).

    render_chat_reference.py CASES_JSON OUT_JSON

CASES_JSON is a list of cases, each either
    {"template": SOURCE, "context": {...}}                         a template and its variables
    {"tokenizer_dir": DIR, "messages": [...], "add_generation_prompt": bool, "tools": [...]}
                                                                    as apply_chat_template would
OUT_JSON gets one {"text": ...} or {"error": ...} per case, in order.
"""
import datetime
import json
import os
import sys

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(Extension):
    """transformers' AssistantTracker, without the tracking: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def tokenizer_case(case):
    """The template and variables transformers' apply_chat_template passes for a tokenizer."""
    directory = case["tokenizer_dir"]
    config = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    else:
        source = config["chat_template"]
        if isinstance(source, list):
            source = next(t["template"] for t in source if t["name"] == "default")
    context = {"messages": case["messages"], "tools": case.get("tools"), "documents": None,
               "add_generation_prompt": case.get("add_generation_prompt", False)}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        text = token_text(config.get(name))
        if text:
            context[name] = text
    if config.get("additional_special_tokens"):
        context["additional_special_tokens"] = [token_text(t) for t in config["additional_special_tokens"]]
    return source, context


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    env = environment()
    results = []
    for case in cases:
        try:
            if "tokenizer_dir" in case:
                source, context = tokenizer_case(case)
            else:
                source, context = case["template"], case["context"]
            results.append({"text": env.from_string(source).render(**context)})
        except Exception as e:  # the test compares that both refuse, not the message
            results.append({"error": f"{type(e).__name__}: {e}"})
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
