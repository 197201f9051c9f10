"""PyTorch reference for Tessera's model parity test.

Reads weights, batches and a config from a safetensors file written by the C++ test, runs
a Hugging Face-style Llama (rotate-half RoPE with optional Llama 3.1 scaling, RMSNorm,
grouped-query attention with optional sliding window and QKV bias, SwiGLU, tied or untied
head) in float64, and writes logits, loss, every parameter gradient and a short AdamW
training curve back as safetensors. Written independently of Tessera's kernels: separate
q/k/v and gate/up projections, torch autograd, torch.optim.AdamW.
"""
import json
import math
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "I32": torch.int32, "F64": torch.float64}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = {}
    for name, v in header.items():
        a, b = v["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[v["dtype"]])
        tensors[name] = t.reshape(v["shape"]) if v["shape"] else t.reshape(())
    return tensors, meta


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().to(torch.float32).contiguous()
        b = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def inverse_frequencies(c):
    hd = c["head_dim"]
    inv = 1.0 / (c["rotary_base"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if not c["rope_scaling"]:
        return inv
    factor, low, high, old = c["rope_factor"], c["rope_low"], c["rope_high"], c["rope_original"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Llama(torch.nn.Module):
    def __init__(self, c, weights):
        super().__init__()
        self.c = c
        H, KV, hd, F = c["heads"], c["kv_heads"], c["head_dim"], c["ffn"]
        self.p = torch.nn.ParameterDict()

        def param(name, t):
            self.p[name.replace(".", "__")] = torch.nn.Parameter(t.to(torch.float64).clone())

        for name, t in weights.items():
            # Split Tessera's fused projections into Hugging Face's separate ones.
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                base, kind = name.rsplit("qkv_proj.", 1)
                q, k, v = torch.split(t, [H * hd, KV * hd, KV * hd], dim=0)
                param(base + "q_proj." + kind, q)
                param(base + "k_proj." + kind, k)
                param(base + "v_proj." + kind, v)
            elif name.endswith("gate_up_proj.weight"):
                base = name[: -len("gate_up_proj.weight")]
                g, u = torch.split(t, [F, F], dim=0)
                param(base + "gate_proj.weight", g)
                param(base + "up_proj.weight", u)
            else:
                param(name, t)

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def has(self, name):
        return name.replace(".", "__") in self.p

    def forward(self, tokens):
        c = self.c
        B, T = tokens.shape
        H, KV, hd = c["heads"], c["kv_heads"], c["head_dim"]
        x = torch.nn.functional.embedding(tokens.long(), self.w("model.embed_tokens.weight"))
        pos = torch.arange(T, dtype=torch.float64)
        freqs = torch.outer(pos, inverse_frequencies(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        i = torch.arange(T)
        visible = i[None, :] <= i[:, None]
        if c["window"] > 0:
            visible &= (i[:, None] - i[None, :]) < c["window"]
        for l in range(c["layers"]):
            p = f"model.layers.{l}."
            h = rms_norm(x, self.w(p + "input_layernorm.weight"), c["eps"])

            def proj(name, inp):
                b = self.w(p + name + ".bias") if self.has(p + name + ".bias") else None
                return torch.nn.functional.linear(inp, self.w(p + name + ".weight"), b)

            q = proj("self_attn.q_proj", h).view(B, T, H, hd).transpose(1, 2)
            k = proj("self_attn.k_proj", h).view(B, T, KV, hd).transpose(1, 2)
            v = proj("self_attn.v_proj", h).view(B, T, KV, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~visible, float("-inf"))
            att = torch.softmax(scores, dim=-1) @ v
            x = x + proj("self_attn.o_proj", att.transpose(1, 2).reshape(B, T, H * hd))
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c["eps"])
            gate = torch.nn.functional.linear(h, self.w(p + "mlp.gate_proj.weight"))
            up = torch.nn.functional.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               self.w(p + "mlp.down_proj.weight"))
        x = rms_norm(x, self.w("model.norm.weight"), c["eps"])
        head = self.w("lm_head.weight") if self.has("lm_head.weight") else self.w("model.embed_tokens.weight")
        return torch.nn.functional.linear(x, head)


def fused_grad(model, name, c):
    """Gradient in Tessera's layout (fused qkv / gate_up) for parameter `name`."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        base, kind = name.rsplit("qkv_proj.", 1)
        return torch.cat([model.w(base + s + "_proj." + kind).grad for s in "qkv"], dim=0)
    if name.endswith("gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return torch.cat([model.w(base + "gate_proj.weight").grad, model.w(base + "up_proj.weight").grad], dim=0)
    return model.w(name).grad


def learning_rate(c, it):
    warm, decay_end = c["warmup"], c["decay_iters"]
    if warm > 0 and it <= warm:
        return c["lr"] * it / warm
    if it > decay_end:
        return c["min_lr"]
    ratio = (it - warm) / (decay_end - warm)
    return c["min_lr"] + 0.5 * (math.cos(math.pi * ratio) + 1) * (c["lr"] - c["min_lr"])


def mean_loss(model, tokens, targets, V):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long())


def main(inp, out):
    tensors, meta = read_safetensors(inp)
    c = json.loads(meta["config"])
    V = c["vocab"]
    weights = {k: v for k, v in tensors.items() if not k.startswith("batch.")}
    model = Llama(c, weights)
    results = {}

    tokens, targets = tensors["batch.0.tokens"], tensors["batch.0.targets"]
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long())
    loss.backward()
    results["logits"] = logits.reshape(-1, V)
    results["loss"] = loss.reshape(1)
    for name in weights:
        results["grad." + name] = fused_grad(model, name, c)

    # A short training run: gradient accumulation, clipping, warm-up + cosine, AdamW with
    # decay on weight matrices only, exactly the trainer's recipe.
    model = Llama(c, weights)
    decay = [p for n, p in model.p.items() if p.dim() == 2]
    no_decay = [p for n, p in model.p.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c["lr"], betas=(c["beta1"], c["beta2"]), eps=c["adam_eps"])
    curve, norms = [], []
    batch = 0
    for it in range(1, c["steps"] + 1):
        opt.zero_grad()
        total = 0.0
        for _ in range(c["accum"]):
            l = mean_loss(model, tensors[f"batch.{batch}.tokens"], tensors[f"batch.{batch}.targets"], V) / c["accum"]
            l.backward()
            total += l.item()
            batch += 1
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip_grad"]).item())
        for g in opt.param_groups:
            g["lr"] = learning_rate(c, it)
        opt.step()
        curve.append(total)
    results["curve"] = torch.tensor(curve)
    results["grad_norms"] = torch.tensor(norms)
    write_safetensors(out, results)


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main(sys.argv[1], sys.argv[2])
