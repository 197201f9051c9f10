#!/usr/bin/env python3
"""Tessera against Hugging Face transformers on tiny random models (needs `transformers`).

For LlamaForCausalLM (GQA, llama3 RoPE scaling, untied head), Qwen2ForCausalLM (QKV bias,
tied head, MQA), MistralForCausalLM (sliding window shorter than the sequence),
Qwen3ForCausalLM (QK norm per head, head_dim wider than hidden / heads, tied head),
Olmo2ForCausalLM (post-norms, QK norm over all heads), MixtralForCausalLM (4 experts, top-2),
Qwen3MoeForCausalLM (QK norm, 8 experts top-2, a dense layer, tied head), DeepseekV3ForCausalLM (multi-latent attention with a query latent,
YaRN RoPE with both mscales, a dense first layer, 8 experts top-4 by sigmoid scores plus a
random nonzero e_score_correction_bias in 2 of 4 groups scaled by 2.5, a shared expert) and
DeepseekV2ForCausalLM (DeepSeek-V2-Lite's attention: queries projected directly, YaRN with
equal mscales; a dense first layer, 8 experts top-2 by a softmax over all of them (greedy, as
V2-Lite; some transformers versions' group_limited_greedy branch reads an attribute
DeepseekV2Moe does not set), scaled by 1.5, two shared experts). transformers versions whose DeepseekV2Attention leaves out YaRN's softmax factor
mscale(factor, mscale_all_dim)^2 (DeepSeek's own code and later transformers apply it, as
Tessera does) get the V2 model without mscale_all_dim, with a notice:

  1. import: build a random model with transformers, save_pretrained it (fp32 in one file,
     and bf16 in small shards with an index), run
       tessera convert --from-hf DIR --check-logits TOKENS.txt --out LOGITS.safetensors
     and compare Tessera's logits and loss with transformers' forward (labels = input ids)
     of the same saved weights;
  2. export: tessera convert --from-hf DIR --to CKPT, then
       tessera convert --from CKPT --to-hf OUT --dtype fp32
     load OUT with from_pretrained (no missing or unexpected weights allowed) and compare
     its logits with the original model's; DeepSeek-V3's e_score_correction_bias must come back
     bit for bit (row "export expert bias": its maximum relative error, which must be 0).

Prints the maximum relative error of each (max |diff| / max |reference|) and exits 1 if
any exceeds --tolerance. Tessera runs in fp32 on its CPU reference backend (the CUDA
backend computes in bf16 and is checked against that reference by the GPU tests),
transformers in fp32 with eager attention.

  3. generation: for each tokenizer of --tokenizers, a tiny model of one family trains for a few
     iterations with it (tessera train, mock data, CPU), and
       tessera convert --from SAVE --to-hf OUT
     exports it with the tokenizer its checkpoint records. AutoTokenizer.from_pretrained(OUT)
     must load, agree with config.json and generation_config.json on the bos/eos/pad ids,
     take model_max_length from max_position_embeddings, and encode and decode a few
     sentences as the `tokenizers` library does from OUT/tokenizer.json (which Tessera's own
     tests compare with Tessera's ids); pipeline("text-generation",
     model=OUT) must load and, under generation_config.json's greedy decoding, give
     model.generate's ids, each the argmax of the model's logits; the text is printed.
     ByteLevel runs have no tokenizer files (docs/checkpoints.md): their model generates from
     the prompt's bytes, checked the same way. --checkpoint adds real checkpoints
     (exported with their recorded tokenizer). Any loading failure fails the check.

  python3 scripts/ckpt/hf_transformers_check.py [--tessera build/tessera]
      [--torch-device cpu|cuda] [--tolerance 1e-4] [--keep DIR]
      [--tokenizers llama3,llama3.1,qwen3,llama2,ByteLevel] [--checkpoint SAVE_DIR ...]
      [--prompt TEXT] [--max-new-tokens 16]
"""
import argparse
import copy
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback

import tokenizers
import torch
import transformers

VOCAB, SEQ, BATCH = 128, 24, 2
# transformers 5 folded rope_theta and rope_scaling into rope_parameters and renamed
# from_pretrained's torch_dtype to dtype.
V5 = int(transformers.__version__.split(".")[0]) >= 5


def rope(theta, scaling=None):
    if V5:
        return {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=theta)}
    return {"rope_theta": theta, "rope_scaling": scaling}


MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        **rope(10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        **rope(1000000.0))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, sliding_window=8, tie_word_embeddings=False, **rope(10000.0))),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        **rope(1000000.0))),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, **rope(500000.0))),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, **rope(1000000.0))),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True, **rope(1000000.0))),
    # max_position_embeddings = factor x original: transformers versions that derive YaRN's
    # factor from the two agree with those that read it.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_interleave=True,
        **rope(10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8,
                         "mscale_all_dim": 0.9}))),
}

V2_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek_v2_kwargs(yarn):
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, topk_method="greedy",
        n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=False, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **rope(10000.0, yarn))


def v2_softmax_has_mscale():
    """Whether this transformers' DeepseekV2Attention scales the softmax by YaRN's
    mscale(factor, mscale_all_dim)^2, as DeepSeek's code and Tessera do."""
    config = transformers.DeepseekV2Config(**deepseek_v2_kwargs(V2_YARN))
    attention = transformers.DeepseekV2ForCausalLM(config).model.layers[0].self_attn
    return abs(attention.scaling - (16 + 16) ** -0.5) > 1e-9


if hasattr(transformers, "DeepseekV2ForCausalLM"):
    if v2_softmax_has_mscale():
        V2_ROPE = V2_YARN
    else:
        # YaRN's table factor is then mscale(factor, 1) on both sides and the softmax unscaled.
        V2_ROPE = {k: v for k, v in V2_YARN.items() if k not in ("mscale", "mscale_all_dim")}
        print(f"note: transformers {transformers.__version__}'s DeepseekV2Attention leaves out YaRN's "
              "softmax factor mscale(factor, mscale_all_dim)^2: deepseek_v2 is checked without "
              "mscale_all_dim")
    MODELS["deepseek_v2"] = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                             deepseek_v2_kwargs(V2_ROPE))
else:
    print(f"note: transformers {transformers.__version__} has no DeepseekV2ForCausalLM: deepseek_v2 "
          "is not checked")

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}


def read_safetensors(path):
    """By hand, so that the check does not depend on the `safetensors` package's version."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, v in header.items():
        a, b = v["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=ST_DTYPES[v["dtype"]]).reshape(v["shape"])
    return out


def max_relative_error(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def random_model(kind):
    config_cls, model_cls, kwargs = MODELS[kind]
    config = config_cls(**kwargs, initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed({"llama": 1, "qwen2": 2, "mistral": 3, "mixtral": 4, "qwen3_moe": 5,
                       "deepseek_v3": 6, "deepseek_v2": 7, "qwen3": 8, "olmo2": 9}[kind])
    model = model_cls(config).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide mistakes in their mapping
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
        # A trained router's expert bias (zero in a new model), large enough to change choices.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def expert_biases(directory):
    """Every e_score_correction_bias tensor a saved directory holds, by name."""
    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            out.update({k: v for k, v in read_safetensors(os.path.join(directory, file)).items()
                        if k.endswith("e_score_correction_bias")})
    return out


def reference(model_cls, directory, tokens, device):
    dtype = {"dtype" if V5 else "torch_dtype": torch.float32}
    model, info = model_cls.from_pretrained(directory, output_loading_info=True, attn_implementation="eager",
                                            **dtype)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{directory}: transformers reports {bad}")
    model = model.to(device).eval()
    with torch.no_grad():
        out = model(input_ids=tokens.to(device), labels=tokens.to(device))
    return model, out.logits.float().cpu(), out.loss.float().cpu()


def tessera(args, *cli):
    cmd = [args.tessera, "convert", *cli]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")


def tessera_logits(args, source_flag, source, tokens_file, work):
    out = os.path.join(work, f"logits_{len(os.listdir(work))}.safetensors")
    tessera(args, source_flag, source, "--check-logits", tokens_file, "--out", out)
    t = read_safetensors(out)
    return t["logits"], t["loss"][0]


def check(args, kind, work, rows):
    _, model_cls, _ = MODELS[kind]
    model = random_model(kind)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    tokens_file = os.path.join(work, "tokens.txt")
    with open(tokens_file, "w") as f:
        f.writelines(" ".join(str(int(i)) for i in row) + "\n" for row in tokens)

    variants = {
        "fp32": dict(safe_serialization=True),
        "bf16 sharded": dict(safe_serialization=True, max_shard_size="20KB"),
    }
    for variant, save_kwargs in variants.items():
        hf_dir = os.path.join(work, variant.replace(" ", "_"))
        saved = copy.deepcopy(model).to(torch.bfloat16) if variant.startswith("bf16") else model
        saved.save_pretrained(hf_dir, **save_kwargs)
        _, ref_logits, ref_loss = reference(model_cls, hf_dir, tokens, args.torch_device)
        logits, loss = tessera_logits(args, "--from-hf", hf_dir, tokens_file, work)
        rows.append((kind, f"import {variant}", max_relative_error(logits, ref_logits),
                     max_relative_error(loss.reshape(1), ref_loss.reshape(1))))

    # Export: HF (fp32) -> Tessera checkpoint -> HF, loaded back by transformers.
    ckpt, exported = os.path.join(work, "ckpt"), os.path.join(work, "exported")
    tessera(args, "--from-hf", os.path.join(work, "fp32"), "--to", ckpt)
    tessera(args, "--from", ckpt, "--to-hf", exported, "--dtype", "fp32")
    with open(os.path.join(exported, "config.json")) as f:
        written = json.load(f)
    if written["model_type"] != kind:
        raise RuntimeError(f"exported model_type {written['model_type']}, expected {kind}")
    _, original_logits, original_loss = reference(model_cls, os.path.join(work, "fp32"), tokens, args.torch_device)
    reloaded, logits, loss = reference(model_cls, exported, tokens, args.torch_device)
    if type(reloaded).__name__ != model_cls.__name__:
        raise RuntimeError(f"exported directory loads as {type(reloaded).__name__}")
    rows.append((kind, "export fp32 round trip", max_relative_error(logits, original_logits),
                 max_relative_error(loss.reshape(1), original_loss.reshape(1))))
    if kind == "deepseek_v3":
        source, written = expert_biases(os.path.join(work, "fp32")), expert_biases(exported)
        if not source or sorted(source) != sorted(written):
            raise RuntimeError(f"e_score_correction_bias tensors {sorted(source)} saved, {sorted(written)} exported")
        if not any(t.abs().max() > 0 for t in source.values()):
            raise RuntimeError("the saved e_score_correction_bias is zero: the check would not see it")
        error = max(max_relative_error(written[k].float(), source[k].float()) for k in source)
        # Exact: any difference fails the tolerance.
        rows.append((kind, "export expert bias", error if error == 0 else float("inf"), 0.0))


# Encoded with AutoTokenizer and with the `tokenizers` library from the same tokenizer.json.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, a tab\tand numbers 1234567 and 3.14159\n\nnew paragraph",
    "Unicode: naïve café, 日本語のテキスト, emoji 🙂",
    "Special tokens in the text: <|end_of_text|> <|endoftext|> <s> </s>",
]

# The tokenizer each generation check trains with, and the model family its tiny model has.
GENERATION_MODELS = {
    "llama3": ["--num_query_groups", "2"],
    "llama3.1": ["--num_query_groups", "2", "--use_rope_scaling", "true",
                 "--rope_original_max_position_embeddings", "32"],
    "qwen3": ["--model_family", "qwen3", "--qk_layernorm", "true", "--num_query_groups", "1",
              "--kv_channels", "32", "--untie_embeddings_and_output_weights", "false"],
    "llama2": ["--num_query_groups", "4", "--sliding_window", "16"],
    "ByteLevel": ["--model_family", "olmo2", "--qk_layernorm", "true", "--num_query_groups", "2"],
}


def train_tiny(args, tokenizer, work):
    """A few iterations on mock data over the tokenizer's vocabulary; returns the save dir."""
    save = os.path.join(work, "ckpt")
    tokenizer_args = (["--tokenizer_type", "ByteLevel"] if tokenizer == "ByteLevel" else
                      ["--tokenizer_type", "HuggingFaceTokenizer", "--tokenizer_model", tokenizer])
    cmd = [args.tessera, "train", "--model", "tiny_llama", "--num_layers", "2", "--hidden_size", "64",
           "--ffn_hidden_size", "128", "--num_attention_heads", "4", "--max_position_embeddings", "128",
           "--seq_length", "32", "--micro_batch_size", "2", "--global_batch_size", "2",
           "--train_iters", "3", "--lr_warmup_iters", "0", "--eval_interval", "0", "--mock_data", "true",
           "--vocab_size", "0", "--device", "cpu", "--log_progress", "false", "--save", save,
           "--workspace", os.path.join(work, "workspace"), *tokenizer_args, *GENERATION_MODELS[tokenizer]]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return save


def check_generation(args, label, save, work, results):
    """Exports checkpoint `save` with its tokenizer and generates from it with transformers."""
    out = os.path.join(work, "exported")
    cmd = [args.tessera, "convert", "--from", save, "--to-hf", out]
    exported = subprocess.run(cmd, capture_output=True, text=True)
    if exported.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({exported.returncode}):\n{exported.stdout}{exported.stderr}")
    print(f"[{label}] {exported.stdout.strip()}")
    for line in exported.stderr.splitlines():
        print(f"[{label}] {line}")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "generation_config.json")) as f:
        generation = json.load(f)
    ids = {k: config.get(f"{k}_token_id") for k in ("bos", "eos", "pad")}
    if {k: generation.get(f"{k}_token_id") for k in ids} != ids:
        raise RuntimeError(f"generation_config.json {generation} and config.json {ids} disagree on token ids")
    if generation.get("do_sample", False):
        raise RuntimeError(f"generation_config.json samples: {generation}")

    dtype = {"dtype" if V5 else "torch_dtype": torch.float32}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, **dtype)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{out}: transformers reports {bad}")
    model = model.to(args.torch_device).eval()

    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        # A byte-level run: no tokenizer files (docs/checkpoints.md); the prompt's bytes are its ids.
        if ids["eos"] != 256 or ids["bos"] is not None:
            raise RuntimeError(f"{out} has no tokenizer.json but token ids {ids}, not a byte-level run's")
        prompt = torch.tensor([list(args.prompt.encode("utf-8"))], device=args.torch_device)
        with torch.no_grad():
            generated = model.generate(prompt, max_new_tokens=args.max_new_tokens,
                                       attention_mask=torch.ones_like(prompt))[0]
        check_greedy(model, generated, prompt.shape[1], args)
        check_tessera_generate(args, label, out, generated.tolist(), prompt.shape[1], results)
        text = bytes(i for i in generated.tolist() if i < 256).decode("utf-8", "replace")
        results.append((label, "generate from bytes", text))
        return

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    got = {k: getattr(tokenizer, f"{k}_token_id") for k in ids}
    if got != ids:
        raise RuntimeError(f"AutoTokenizer has token ids {got}, config.json {ids}")
    if tokenizer.model_max_length != config["max_position_embeddings"]:
        raise RuntimeError(f"model_max_length {tokenizer.model_max_length}, expected "
                           f"max_position_embeddings {config['max_position_embeddings']}")
    reference = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    for sentence in SENTENCES:
        for add in (False, True):
            want = reference.encode(sentence, add_special_tokens=add).ids
            encoded = tokenizer(sentence, add_special_tokens=add)["input_ids"]
            if encoded != want:
                raise RuntimeError(f"{type(tokenizer).__name__} encodes {sentence!r} (add_special_tokens={add}) "
                                   f"as {encoded}, tokenizer.json as {want}")
            if tokenizer.decode(want, clean_up_tokenization_spaces=False) != reference.decode(
                    want, skip_special_tokens=False):
                raise RuntimeError(f"{type(tokenizer).__name__} decodes {want} otherwise than tokenizer.json")
    generator = transformers.pipeline("text-generation", model=out, device=args.torch_device, **dtype)
    piped = [int(i) for i in generator(args.prompt, max_new_tokens=args.max_new_tokens,
                                       return_tensors=True)[0]["generated_token_ids"]]
    text = generator(args.prompt, max_new_tokens=args.max_new_tokens, return_full_text=False)[0]["generated_text"]
    # The pipeline's prompt ids, with or without the special tokens the tokenizer adds
    # (transformers versions differ in what the pipeline asks for).
    prompts = [tokenizer(args.prompt, add_special_tokens=add)["input_ids"] for add in (True, False)]
    prompt_ids = next((p for p in prompts if piped[:len(p)] == p), None)
    if prompt_ids is None:
        raise RuntimeError(f"pipeline output {piped} starts with neither tokenization of the prompt {prompts}")
    prompt = torch.tensor([prompt_ids], device=args.torch_device)
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=args.max_new_tokens)[0]
    if piped != generated.tolist():
        raise RuntimeError(f"pipeline generated {piped}, model.generate {generated.tolist()}")
    check_greedy(model, generated, len(prompt_ids), args)
    check_tessera_generate(args, label, out, generated.tolist(), len(prompt_ids), results)
    results.append((label, f"pipeline ({type(tokenizer).__name__})", text))


def check_tessera_generate(args, label, exported, sequence, prompt_length, results):
    """`tessera generate` (KV cache) on the exported directory (the weights transformers ran)
    continues the prompt with transformers' greedy tokens:
    exactly in fp32 on the CPU; on the GPU in bf16, where a near tie may flip a token, the
    agreement is reported."""
    prompt, want = sequence[:prompt_length], sequence[prompt_length:]
    for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        cmd = [args.tessera, "generate", "--from", exported, "--prompt_ids", " ".join(map(str, prompt)),
               "--max_new_tokens", str(len(want)), "--ignore_eos", "--device", device,
               "--precision", precision]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
        ids_line = next(l for l in run.stderr.splitlines() if l.startswith("ids:"))
        got = [int(t) for t in ids_line.split()[1:]]
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        rate = next((l for l in run.stderr.splitlines() if "tokens/s" in l), "").split(";")[-1].strip()
        results.append((label, f"tessera generate {device} {precision}",
                        f"{agree}/{len(want)} tokens as transformers ({rate})"))
        if device == "cpu" and got[:len(want)] != want:
            raise RuntimeError(f"tessera generate (cpu, fp32) {got}, transformers greedy {want}")


def check_greedy(model, sequence, prompt_length, args):
    """Each generated token is the argmax of the logits before it (to rounding)."""
    with torch.no_grad():
        logits = model(sequence[None].to(args.torch_device)).logits[0].float()
    for t in range(prompt_length, sequence.shape[0]):
        row = logits[t - 1]
        gap = (row.max() - row[sequence[t]]).item()
        if gap > 1e-4 * row.abs().max().item():
            raise RuntimeError(f"token {t} ({int(sequence[t])}) is {gap:.3g} below the argmax "
                               f"({int(row.argmax())}): not greedy decoding")


def run_generation_checks(args, work_root):
    """Returns (label, check, output text or the error) per model, and whether all passed."""
    results, failed = [], False
    jobs = [(name, None) for name in args.tokenizers.split(",") if name]
    jobs += [(f"checkpoint {path}", path) for path in args.checkpoint]
    for k, (label, save) in enumerate(jobs):
        work = os.path.join(work_root, f"generation_{k}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        try:
            check_generation(args, label, save or train_tiny(args, label, work), work, results)
        except Exception as e:  # noqa: BLE001 - reported, and the check fails
            traceback.print_exc()
            results.append((label, "FAILED", f"{type(e).__name__}: {e}"))
            failed = True
    return results, failed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--tessera", default=os.path.join(root, "build", "tessera"))
    parser.add_argument("--torch-device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--keep", help="keep the work files in this directory")
    parser.add_argument("--tokenizers", default=",".join(GENERATION_MODELS),
                        help="tokenizers of the generation checks, comma-separated (empty: none)")
    parser.add_argument("--checkpoint", action="append", default=[],
                        help="also export and generate from this Tessera checkpoint (repeatable)")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    unknown = [t for t in args.tokenizers.split(",") if t and t not in GENERATION_MODELS]
    if unknown:
        parser.error(f"--tokenizers: {unknown} not among {list(GENERATION_MODELS)}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, tessera {args.tessera}")
    rows = []
    work_root = args.keep or tempfile.mkdtemp(prefix="tessera_hf_check_")
    try:
        for kind in MODELS:
            work = os.path.join(work_root, kind)
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            check(args, kind, work, rows)
        generated, generation_failed = run_generation_checks(args, work_root)
    finally:
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)
    failed = False
    print(f"{'model':<8} {'check':<24} {'logits max rel err':>18} {'loss rel err':>13}")
    for kind, what, logits_err, loss_err in rows:
        ok = logits_err < args.tolerance and loss_err < args.tolerance
        failed |= not ok
        print(f"{kind:<8} {what:<24} {logits_err:>18.3e} {loss_err:>13.3e}  {'ok' if ok else 'FAIL'}")
    print(f"tolerance {args.tolerance:g}: {'FAILED' if failed else 'all passed'}")
    print(f"greedy generation, prompt {args.prompt!r}, {args.max_new_tokens} new tokens:")
    for label, what, text in generated:
        print(f"  {label:<10} {what:<36} {text!r}")
    print(f"generation: {'FAILED' if generation_failed else 'all loaded and generated'}")
    return 1 if failed or generation_failed else 0


if __name__ == "__main__":
    sys.exit(main())
