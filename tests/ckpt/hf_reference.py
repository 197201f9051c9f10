"""Hugging Face-side reference for Tessera's interop tests (tests/ckpt/hf_test.cpp and the
MoE families' mixtral, qwen3_moe, deepseek_v3 and deepseek_v2, with one tensor per expert as on
the Hub; DeepSeek's multi-latent attention as transformers' DeepseekV3Attention computes it,
V3's routing with its e_score_correction_bias, V2's softmax routing).

Reads and writes Hugging Face model directories by hand (config.json, model.safetensors or
shards listed by model.safetensors.index.json; this machine has no `safetensors` or
`transformers` package) and computes logits in float64 with the independent Llama of
tests/model/torch_reference.py, configured from config.json the way transformers reads it
(defaults of its config classes, Qwen2's built-in QKV bias, Mistral's window, tied heads).

  hf_reference.py logits HF_DIR TOKENS.txt OUT.safetensors
      logits [B, T, V] and the mean next-token loss (transformers' loss with labels = ids)
  hf_reference.py make {llama,qwen2,mistral,mixtral,qwen3_moe,deepseek_v3,deepseek_v2} HF_DIR {F32,BF16,F16} SHARDS
      a tiny random model with Hugging Face names (separate q/k/v, gate/up); deepseek_v3's
      e_score_correction_bias is random (a trained one), not zero
"""
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from torch_reference import Llama, write_safetensors  # noqa: E402

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    tensors = {}
    for name, v in header.items():
        a, b = v["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[v["dtype"]]).reshape(v["shape"])
    return tensors


def write_typed_safetensors(path, tensors, dtype_name):
    """Writes every tensor as dtype_name (F32, BF16 or F16) with transformers' metadata."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        t = t.to(DTYPES[dtype_name]).contiguous()
        raw = (t.view(torch.int16) if t.element_size() == 2 else t).numpy().tobytes()
        header[name] = {"dtype": dtype_name, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def read_hf_dir(d):
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(d, name)))
    return config, weights


def deepseek_config(hf):
    """torch_reference's config of a deepseek_v3 or deepseek_v2 config.json, with transformers'
    defaults (DeepseekV3Config's, DeepseekV2Config's)."""
    v2 = hf["model_type"] == "deepseek_v2"
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    assert rope_type in ("default", "yarn"), rope_type
    yarn = None
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
        yarn = {"factor": rope.get("factor") or hf["max_position_embeddings"] / original,
                "original": original, "beta_fast": rope.get("beta_fast") or 32,
                "beta_slow": rope.get("beta_slow") or 1, "mscale": rope.get("mscale") or 0,
                "mscale_all_dim": rope.get("mscale_all_dim") or 0}
    E, K, Fe = hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    if v2:
        # DeepseekV2Moe: softmax over all experts, top-k (within the topk_group groups whose best
        # expert scores highest), scaled by routed_scaling_factor, not renormalised. The
        # reference's Megatron routing scores a group by its best K / topk_group experts.
        limited = hf.get("topk_method", "greedy") == "group_limited_greedy"
        assert not limited or K == hf["topk_group"], "group scores of one expert"
        groups = hf["n_group"] if limited and hf["n_group"] > 1 else 0
        moe = {"experts": E, "topk": K, "sigmoid": False, "pre_softmax": True,
               "groups": groups, "group_topk": hf["topk_group"] if groups else 0,
               "scaling": hf.get("routed_scaling_factor", 1.0),
               "shared_ffn": Fe * hf.get("n_shared_experts", 2), "first_dense": hf.get("first_k_dense_replace", 0)}
    else:
        groups = hf.get("n_group", 8)
        assert not groups or groups == 1 or K == 2 * hf["topk_group"], "group scores of two experts"
        assert hf.get("norm_topk_prob", True) == (K > 1)
        moe = {"experts": E, "topk": K, "sigmoid": True, "pre_softmax": False,
               "groups": groups if groups > 1 else 0, "group_topk": hf["topk_group"] if groups > 1 else 0,
               "scaling": hf.get("routed_scaling_factor", 2.5),
               "shared_ffn": Fe * hf.get("n_shared_experts", 1), "first_dense": hf.get("first_k_dense_replace", 3)}
    first_dense = moe.pop("first_dense")
    moe.update({"layers": [l >= first_dense for l in range(layers)],
                "load_balancing": False, "seq_aux": False, "aux_coeff": 0, "z_coeff": 0})
    mla = {"q_lora": hf.get("q_lora_rank") or 0, "kv_lora": hf["kv_lora_rank"],
           "qk": hf["qk_nope_head_dim"], "rope": hf["qk_rope_head_dim"], "v": hf["v_head_dim"]}
    return {"moe": moe, "mla": mla, "yarn": yarn, "layers": layers, "heads": heads,
            "kv_heads": heads, "head_dim": mla["rope"], "ffn": hf["intermediate_size"],
            "eps": hf.get("rms_norm_eps", 1e-6),
            "rotary_base": rope.get("rope_theta") or hf.get("rope_theta", 10000.0),
            "rope_scaling": False, "window": 0}


def reference_config(hf):
    """torch_reference's config from a Hugging Face config.json, with transformers' defaults."""
    kind = hf["model_type"]
    if kind in ("deepseek_v3", "deepseek_v2"):
        return deepseek_config(hf)
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    assert rope_type in ("default", "llama3"), rope_type
    window = 0
    if kind == "mistral":
        window = hf.get("sliding_window", 4096) or 0
    if kind == "qwen2":
        assert not hf.get("use_sliding_window", False)
    moe = None
    if kind in ("mixtral", "qwen3_moe"):
        layers = hf["num_hidden_layers"]
        if kind == "mixtral":
            sparse = [True] * layers
        else:  # transformers' Qwen3-MoE rule for sparse layers
            step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
            sparse = [l not in dense and (l + 1) % step == 0 for l in range(layers)]
        moe = {"experts": hf["num_local_experts"] if kind == "mixtral" else hf["num_experts"],
               "topk": hf["num_experts_per_tok"], "layers": sparse, "sigmoid": False,
               "pre_softmax": kind == "qwen3_moe" and not hf.get("norm_topk_prob", False),
               "groups": 0, "group_topk": 0, "scaling": 0, "shared_ffn": 0,
               "load_balancing": False, "seq_aux": False, "aux_coeff": 0, "z_coeff": 0}
    # Qwen3's QK norms are per head; OLMo 2's span all of q and all of k.
    qk_norm = "whole" if kind == "olmo2" else kind in ("qwen3", "qwen3_moe")
    return {
        "moe": moe, "qk_norm": qk_norm, "post_norms": kind == "olmo2",
        "layers": hf["num_hidden_layers"], "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or (128 if kind == "qwen3" else hf["hidden_size"] // heads),
        "ffn": hf["intermediate_size"], "eps": hf.get("rms_norm_eps", 1e-6),
        "rotary_base": hf.get("rope_theta", 10000.0), "rope_scaling": rope_type == "llama3",
        "rope_factor": rope.get("factor"), "rope_low": rope.get("low_freq_factor"),
        "rope_high": rope.get("high_freq_factor"),
        "rope_original": rope.get("original_max_position_embeddings"), "window": window,
    }


def logits(hf_dir, tokens_path, out):
    config, weights = read_hf_dir(hf_dir)
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    # transformers ties the head to the embedding by the config, whatever the file holds.
    if config.get("tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    else:
        assert "lm_head.weight" in weights, "untied model without lm_head.weight"
    if config["model_type"] == "qwen2":  # Qwen2 always has q/k/v biases
        assert all(f"model.layers.{l}.self_attn.{p}_proj.bias" in weights
                   for l in range(config["num_hidden_layers"]) for p in "qkv")
    # Hugging Face's MoE names to the reference's: the router, then one module per expert.
    renamed = {}
    for name, t in weights.items():
        # DeepSeek-V3's router bias: added to the sigmoid scores for choosing experts.
        name = name.replace("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")
        name = name.replace("block_sparse_moe.gate.weight", "mlp.router.weight")
        if config["model_type"] in ("qwen3_moe", "deepseek_v3", "deepseek_v2"):
            name = name.replace("mlp.gate.weight", "mlp.router.weight")
            name = name.replace("mlp.shared_experts.", "mlp.shared_expert.")
        name = name.replace("block_sparse_moe.experts.", "mlp.experts.")
        # The blocks' norms: OLMo 2's post-norms, everyone else's pre-norms.
        if config["model_type"] == "olmo2":
            name = name.replace("post_attention_layernorm.", "self_attn.post_norm.")
            name = name.replace("post_feedforward_layernorm.", "mlp.post_norm.")
        else:
            name = name.replace("input_layernorm.", "self_attn.norm.")
            name = name.replace("post_attention_layernorm.", "mlp.norm.")
        for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            if "mlp.experts." in name:
                name = name.replace(old, new)
        renamed[name] = t
    weights = renamed
    with open(tokens_path) as f:
        tokens = torch.tensor([[int(x) for x in line.split()] for line in f if line.strip()])
    model = Llama(reference_config(config), weights)
    with torch.no_grad():
        out_logits = model(tokens)
        V = out_logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(out_logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    write_safetensors(out, {"logits": out_logits, "loss": loss.reshape(1)})


# The same shapes as the C++ test's experiments (tests/ckpt/hf_test.cpp, kHfCases).
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
              "tie_word_embeddings": False, "attention_bias": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
              "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 96,
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "hidden_act": "silu", "sliding_window": 5, "tie_word_embeddings": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96,
                "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu",
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                "tie_word_embeddings": False},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40,
                  "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
                  "num_experts": 8, "num_experts_per_tok": 4, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": [1], "tie_word_embeddings": True,
                  "use_sliding_window": False, "sliding_window": None, "attention_bias": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": None, "attention_bias": False},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "attention_bias": False},
    # DeepSeek-V3: query latent, YaRN with both mscales (max_position_embeddings = factor x the
    # original, which transformers versions that derive the factor from them agree with),
    # a dense first layer, sigmoid routing in 2 of 4 groups scaled by 2.5, a shared expert.
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40,
                    "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 20, "q_lora_rank": 24,
                    "qk_rope_head_dim": 8, "v_head_dim": 10, "qk_nope_head_dim": 6, "n_group": 4,
                    "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
                    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 256,
                    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.9},
                    "rope_interleave": True, "tie_word_embeddings": False, "attention_bias": False},
    # DeepSeek-V2-Lite's shape: queries projected directly (q_lora_rank null), YaRN with equal
    # mscales, a dense first layer, then 8 experts top-2 by a softmax over all of them (greedy),
    # scaled by 1.5, and two shared experts.
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40,
                    "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_shared_experts": 2, "n_routed_experts": 8,
                    "routed_scaling_factor": 1.5, "kv_lora_rank": 20, "q_lora_rank": None,
                    "qk_rope_head_dim": 8, "v_head_dim": 10, "qk_nope_head_dim": 6,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": False,
                    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                    "tie_word_embeddings": False, "attention_bias": False},
}


def make_deepseek(c, rand):
    """A tiny random DeepseekV3ForCausalLM's or DeepseekV2ForCausalLM's tensors, named as
    modeling_deepseek_v3 / modeling_deepseek_v2 name them."""
    C, F, V, H = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_attention_heads"]
    Dn, Dr, Dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    Qr, Kr, E, Fe = c["q_lora_rank"], c["kv_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"]
    w = {"model.embed_tokens.weight": rand(V, C)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = rand(C, mean=1.0)
        if Qr:
            w[p + "self_attn.q_a_proj.weight"] = rand(Qr, C)
            w[p + "self_attn.q_a_layernorm.weight"] = rand(Qr, mean=1.0)
            w[p + "self_attn.q_b_proj.weight"] = rand(H * (Dn + Dr), Qr)
        else:
            w[p + "self_attn.q_proj.weight"] = rand(H * (Dn + Dr), C)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rand(Kr + Dr, C)
        w[p + "self_attn.kv_a_layernorm.weight"] = rand(Kr, mean=1.0)
        w[p + "self_attn.kv_b_proj.weight"] = rand(H * (Dn + Dv), Kr)
        w[p + "self_attn.o_proj.weight"] = rand(C, H * Dv)
        w[p + "post_attention_layernorm.weight"] = rand(C, mean=1.0)
        if l < c["first_k_dense_replace"]:
            w[p + "mlp.gate_proj.weight"] = rand(F, C)
            w[p + "mlp.up_proj.weight"] = rand(F, C)
            w[p + "mlp.down_proj.weight"] = rand(C, F)
            continue
        w[p + "mlp.gate.weight"] = rand(E, C)
        if c["model_type"] == "deepseek_v3":  # a trained bias, large enough to change choices
            w[p + "mlp.gate.e_score_correction_bias"] = 3 * rand(E)
        for e in range(E):
            w[f"{p}mlp.experts.{e}.gate_proj.weight"] = rand(Fe, C)
            w[f"{p}mlp.experts.{e}.up_proj.weight"] = rand(Fe, C)
            w[f"{p}mlp.experts.{e}.down_proj.weight"] = rand(C, Fe)
        S = Fe * c["n_shared_experts"]
        w[p + "mlp.shared_experts.gate_proj.weight"] = rand(S, C)
        w[p + "mlp.shared_experts.up_proj.weight"] = rand(S, C)
        w[p + "mlp.shared_experts.down_proj.weight"] = rand(C, S)
    w["model.norm.weight"] = rand(C, mean=1.0)
    w["lm_head.weight"] = rand(V, C)
    return w


def make(kind, out_dir, dtype_name, shards):
    c = CONFIGS[kind]
    g = torch.Generator().manual_seed(7)
    C, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or C // H

    def rand(*shape, mean=0.0):
        return mean + 0.1 * torch.randn(*shape, generator=g, dtype=torch.float32)

    w = {"model.embed_tokens.weight": rand(V, C)}
    deepseek = kind in ("deepseek_v3", "deepseek_v2")
    for l in range(c["num_hidden_layers"] if not deepseek else 0):
        p = f"model.layers.{l}."
        if kind != "olmo2":
            w[p + "input_layernorm.weight"] = rand(C, mean=1.0)
        for name, rows in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
            w[p + f"self_attn.{name}_proj.weight"] = rand(rows, C)
            if kind == "qwen2":
                w[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        w[p + "self_attn.o_proj.weight"] = rand(C, H * hd)
        w[p + "post_attention_layernorm.weight"] = rand(C, mean=1.0)
        if kind == "olmo2":
            w[p + "post_feedforward_layernorm.weight"] = rand(C, mean=1.0)
            w[p + "self_attn.q_norm.weight"] = rand(H * hd, mean=1.0)
            w[p + "self_attn.k_norm.weight"] = rand(KV * hd, mean=1.0)
        if kind in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = rand(hd, mean=1.0)
            w[p + "self_attn.k_norm.weight"] = rand(hd, mean=1.0)
        sparse = kind == "mixtral" or (kind == "qwen3_moe" and l not in c["mlp_only_layers"])
        if sparse:
            E = c.get("num_local_experts") or c["num_experts"]
            Fe = c.get("moe_intermediate_size") or F
            moe = p + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
            w[moe + "gate.weight"] = rand(E, C)
            for e in range(E):
                names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
                w[f"{moe}experts.{e}.{names[0]}.weight"] = rand(Fe, C)
                w[f"{moe}experts.{e}.{names[1]}.weight"] = rand(Fe, C)
                w[f"{moe}experts.{e}.{names[2]}.weight"] = rand(C, Fe)
            continue
        w[p + "mlp.gate_proj.weight"] = rand(F, C)
        w[p + "mlp.up_proj.weight"] = rand(F, C)
        w[p + "mlp.down_proj.weight"] = rand(C, F)
    w["model.norm.weight"] = rand(C, mean=1.0)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(V, C)
    if deepseek:
        w = make_deepseek(c, rand)
    if kind == "llama":  # old Llama checkpoints carry this buffer; loaders must skip it
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = rand(hd // 2)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(c, torch_dtype={"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype_name]), f, indent=2)
    names = list(w)
    if shards == 1:
        write_typed_safetensors(os.path.join(out_dir, "model.safetensors"), w, dtype_name)
        return
    weight_map, per = {}, (len(names) + shards - 1) // shards
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: w[n] for n in names[k * per:(k + 1) * per]}
        write_typed_safetensors(os.path.join(out_dir, file), part, dtype_name)
        weight_map.update({n: file for n in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    if sys.argv[1] == "logits":
        logits(*sys.argv[2:5])
    elif sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
