"""PyTorch reference for Tessera's model parity test.

Reads weights, batches and a config from a safetensors file written by the C++ test, runs
a Hugging Face-style Llama (rotate-half RoPE with optional Llama 3.1 scaling, RMSNorm,
grouped-query attention with optional sliding window, QKV bias and per-head QK norm (Qwen3),
SwiGLU, tied or untied head) in float64, with Megatron-style mixture-of-experts MLPs in the
layers the config lists (router top-k over softmax or sigmoid scores, group-limited, scaled,
a shared expert; Switch / sequence aux loss and z-loss added to the objective), or Hugging
Face's DeepseekV3Attention (multi-latent attention: query and key/value latents with their
norms, RoPE on part of each head in DeepSeek's interleaved layout, YaRN frequencies and
softmax scale) instead of GQA, and writes logits, loss, every parameter gradient, each MoE
layer's aux and z losses and a short AdamW training curve back as safetensors. Written
independently of Tessera's kernels: separate q/k/v, latent and gate/up projections, one module
per expert, torch autograd, torch.optim.AdamW.
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


def yarn_get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(c):
    """Inverse frequencies of MLA's RoPE part and the cos/sin factor: transformers'
    _compute_yarn_parameters (DeepSeek's YaRN) when the config has yarn, else plain RoPE."""
    dim, base = c["mla"]["rope"], c["rotary_base"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    y = c.get("yarn")
    if not y:
        return extrapolation, 1.0
    factor = y["factor"]
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(y["original"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(y["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    if y["mscale"] and y["mscale_all_dim"]:
        attention_factor = yarn_get_mscale(factor, y["mscale"]) / yarn_get_mscale(factor, y["mscale_all_dim"])
    else:
        attention_factor = yarn_get_mscale(factor)
    return inv, attention_factor


def mla_softmax_scale(c):
    """DeepseekV3Attention.scaling: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2."""
    m, y = c["mla"], c.get("yarn")
    scale = (m["qk"] + m["rope"]) ** -0.5
    if y and y["mscale_all_dim"]:
        scale *= yarn_get_mscale(y["factor"], y["mscale_all_dim"]) ** 2
    return scale


def rope_interleave(x, cos, sin):
    """transformers' apply_rotary_pos_emb_interleave on one tensor (..., T, d)."""
    b, h, t, d = x.shape
    x = x.view(b, h, t, d // 2, 2).transpose(4, 3).reshape(b, h, t, d)
    return x * cos + rotate_half(x) * sin


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
            if name.endswith("q_kv_a_proj.weight"):
                m = c["mla"]
                base = name[: -len("q_kv_a_proj.weight")]
                q_rows = m["q_lora"] if m["q_lora"] else H * (m["qk"] + m["rope"])
                q, kv = torch.split(t, [q_rows, m["kv_lora"] + m["rope"]], dim=0)
                param(base + ("q_a_proj.weight" if m["q_lora"] else "q_proj.weight"), q)
                param(base + "kv_a_proj_with_mqa.weight", kv)
            elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                base, kind = name.rsplit("qkv_proj.", 1)
                q, k, v = torch.split(t, [H * hd, KV * hd, KV * hd], dim=0)
                param(base + "q_proj." + kind, q)
                param(base + "k_proj." + kind, k)
                param(base + "v_proj." + kind, v)
            elif name.endswith("experts.gate_up_proj.weight"):
                base = name[: -len("gate_up_proj.weight")]
                f = t.shape[1] // 2
                for e in range(t.shape[0]):
                    param(f"{base}{e}.gate_proj.weight", t[e, :f])
                    param(f"{base}{e}.up_proj.weight", t[e, f:])
            elif name.endswith("experts.down_proj.weight"):
                base = name[: -len("down_proj.weight")]
                for e in range(t.shape[0]):
                    param(f"{base}{e}.down_proj.weight", t[e])
            elif name.endswith("gate_up_proj.weight"):
                base = name[: -len("gate_up_proj.weight")]
                g, u = torch.split(t, [t.shape[0] // 2, t.shape[0] // 2], dim=0)
                param(base + "gate_proj.weight", g)
                param(base + "up_proj.weight", u)
            else:
                param(name, t)

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def has(self, name):
        return name.replace(".", "__") in self.p

    def moe_layers(self):
        m = self.c.get("moe")
        return [l for l in range(self.c["layers"]) if m and m["layers"][l]]

    def swiglu(self, x, base):
        gate = torch.nn.functional.linear(x, self.w(base + "gate_proj.weight"))
        up = torch.nn.functional.linear(x, self.w(base + "up_proj.weight"))
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                          self.w(base + "down_proj.weight"))

    def route(self, logits, bias=None):
        """Megatron's topk_softmax_with_capacity (dropless): experts (N, K), weights (N, K).
        bias (E): the expert bias of aux-loss-free balancing, added to the sigmoid scores for
        choosing the experts only."""
        m = self.c["moe"]
        E, K = m["experts"], m["topk"]
        if m["sigmoid"]:
            scores = torch.sigmoid(logits)
            select = scores if bias is None else scores + bias
        elif m["pre_softmax"]:
            scores = torch.softmax(logits, dim=-1)
            select = scores
        else:
            select = logits
        select = select.detach()
        if m["groups"]:
            G = m["groups"]
            grouped = select.view(-1, G, E // G)
            group_scores = grouped.topk(K // m["group_topk"], dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(m["group_topk"], dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter(1, keep, 1.0).bool()
            mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            select = select.masked_fill(~mask, float("-inf"))
        experts = select.topk(K, dim=-1).indices
        if m["sigmoid"]:
            weights = scores.gather(1, experts)
            if K > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif m["pre_softmax"]:
            weights = scores.gather(1, experts)
        else:
            weights = torch.softmax(logits.gather(1, experts), dim=-1)
        if m["scaling"]:
            weights = weights * m["scaling"]
        return experts, weights

    def balance_losses(self, logits, experts, B, T):
        """The layer's aux loss (Switch, or per sequence) and z-loss, unweighted."""
        m = self.c["moe"]
        E, K = m["experts"], m["topk"]
        if m["sigmoid"]:
            P = torch.sigmoid(logits)
            if K > 1:
                P = P / (P.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            P = torch.softmax(logits, dim=-1)
        one_hot = torch.zeros_like(P).scatter_add(1, experts, torch.ones_like(P[:, :K]))
        if m["seq_aux"]:
            f = one_hot.view(B, T, E).sum(dim=1)  # (B, E)
            aux = ((f * E / (T * K)) * P.view(B, T, E).mean(dim=1)).sum(dim=1).mean()
        else:
            N = logits.shape[0]
            aux = E / (K * N * N) * (one_hot.sum(dim=0) * P.sum(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return aux, z

    def moe(self, h, p, B, T):
        m = self.c["moe"]
        x = h.reshape(-1, h.shape[-1])
        logits = torch.nn.functional.linear(x, self.w(p + "mlp.router.weight"))
        bias = self.w(p + "mlp.router.expert_bias") if self.has(p + "mlp.router.expert_bias") else None
        experts, weights = self.route(logits, bias)
        out = torch.zeros_like(x)
        for e in range(m["experts"]):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = self.swiglu(x[token], f"{p}mlp.experts.{e}.")
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
        if m["shared_ffn"]:
            out = out + self.swiglu(x, p + "mlp.shared_expert.")
        self.balance.append(self.balance_losses(logits, experts, B, T))
        return out.view_as(h)

    def mla(self, h, p, B, T, visible):
        """transformers' DeepseekV3Attention (eager): the latents, interleaved RoPE, attention."""
        c, m = self.c, self.c["mla"]
        H, Dn, Dr, Dv = c["heads"], m["qk"], m["rope"], m["v"]
        lin = torch.nn.functional.linear
        if m["q_lora"]:
            q_a = rms_norm(lin(h, self.w(p + "self_attn.q_a_proj.weight")),
                           self.w(p + "self_attn.q_a_layernorm.weight"), c["eps"])
            q = lin(q_a, self.w(p + "self_attn.q_b_proj.weight"))
        else:
            q = lin(h, self.w(p + "self_attn.q_proj.weight"))
        q = q.view(B, T, H, Dn + Dr).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [Dn, Dr], dim=-1)
        compressed = lin(h, self.w(p + "self_attn.kv_a_proj_with_mqa.weight"))
        k_pass, k_rot = torch.split(compressed, [m["kv_lora"], Dr], dim=-1)
        k_pass = lin(rms_norm(k_pass, self.w(p + "self_attn.kv_a_layernorm.weight"), c["eps"]),
                     self.w(p + "self_attn.kv_b_proj.weight"))
        k_pass = k_pass.view(B, T, H, Dn + Dv).transpose(1, 2)
        k_pass, v = torch.split(k_pass, [Dn, Dv], dim=-1)
        k_rot = k_rot.view(B, 1, T, Dr)
        inv, factor = mla_rope(c)
        freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * factor)[None, None], (emb.sin() * factor)[None, None]
        q_rot = rope_interleave(q_rot, cos, sin)
        k_rot = rope_interleave(k_rot, cos, sin).expand(B, H, T, Dr)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot), dim=-1)
        scores = (q @ k.transpose(-1, -2)) * mla_softmax_scale(c)
        scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v
        return lin(att.transpose(1, 2).reshape(B, T, H * Dv), self.w(p + "self_attn.o_proj.weight"))

    def forward(self, tokens):
        c = self.c
        B, T = tokens.shape
        H, KV, hd = c["heads"], c["kv_heads"], c["head_dim"]
        x = torch.nn.functional.embedding(tokens.long(), self.w("model.embed_tokens.weight"))
        pos = torch.arange(T, dtype=torch.float64)
        freqs = torch.outer(pos, inverse_frequencies(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        self.balance = []  # (aux, z) of each MoE layer, in order
        i = torch.arange(T)
        visible = i[None, :] <= i[:, None]
        if c["window"] > 0:
            visible &= (i[:, None] - i[None, :]) < c["window"]
        for l in range(c["layers"]):
            p = f"model.layers.{l}."
            h = rms_norm(x, self.w(p + "self_attn.norm.weight"), c["eps"])

            def proj(name, inp):
                b = self.w(p + name + ".bias") if self.has(p + name + ".bias") else None
                return torch.nn.functional.linear(inp, self.w(p + name + ".weight"), b)

            if c.get("mla"):
                x = x + self.mla(h, p, B, T, visible)
                h = rms_norm(x, self.w(p + "mlp.norm.weight"), c["eps"])
                x = x + (self.moe(h, p, B, T) if l in self.moe_layers() else self.swiglu(h, p + "mlp."))
                continue
            q = proj("self_attn.q_proj", h).view(B, T, H, hd).transpose(1, 2)
            k = proj("self_attn.k_proj", h).view(B, T, KV, hd).transpose(1, 2)
            v = proj("self_attn.v_proj", h).view(B, T, KV, hd).transpose(1, 2)
            if c.get("qk_norm"):
                q = rms_norm(q, self.w(p + "self_attn.q_norm.weight"), c["eps"])
                k = rms_norm(k, self.w(p + "self_attn.k_norm.weight"), c["eps"])
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~visible, float("-inf"))
            att = torch.softmax(scores, dim=-1) @ v
            x = x + proj("self_attn.o_proj", att.transpose(1, 2).reshape(B, T, H * hd))
            h = rms_norm(x, self.w(p + "mlp.norm.weight"), c["eps"])
            if l in self.moe_layers():
                x = x + self.moe(h, p, B, T)
            else:
                x = x + self.swiglu(h, p + "mlp.")
        x = rms_norm(x, self.w("model.norm.weight"), c["eps"])
        head = self.w("lm_head.weight") if self.has("lm_head.weight") else self.w("model.embed_tokens.weight")
        return torch.nn.functional.linear(x, head)


def fused_grad(model, name, c):
    """Gradient in Tessera's layout (fused qkv / gate_up, stacked experts) for `name`."""
    E = c["moe"]["experts"] if c.get("moe") else 0

    def grad_or_zero(n):  # an expert no token reached has no gradient
        g = model.w(n).grad
        return torch.zeros_like(model.w(n)) if g is None else g

    if name.endswith("experts.gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return torch.stack([torch.cat([grad_or_zero(f"{base}{e}.gate_proj.weight"),
                                       grad_or_zero(f"{base}{e}.up_proj.weight")], dim=0)
                            for e in range(E)])
    if name.endswith("experts.down_proj.weight"):
        base = name[: -len("down_proj.weight")]
        return torch.stack([grad_or_zero(f"{base}{e}.down_proj.weight") for e in range(E)])
    if name.endswith("q_kv_a_proj.weight"):
        base = name[: -len("q_kv_a_proj.weight")]
        q = "q_a_proj.weight" if c["mla"]["q_lora"] else "q_proj.weight"
        return torch.cat([model.w(base + q).grad, model.w(base + "kv_a_proj_with_mqa.weight").grad], dim=0)
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


def balance_objective(model, c):
    """The MoE layers' aux and z losses as the objective weighs them."""
    m = c.get("moe")
    if not m:
        return 0.0
    total = 0.0
    for aux, z in model.balance:
        if m["aux_coeff"] and m["load_balancing"]:
            total = total + m["aux_coeff"] * aux
        if m["z_coeff"]:
            total = total + m["z_coeff"] * z
    return total


def mean_loss(model, tokens, targets, V):
    """The language-model loss (the curve), and the objective it is trained with."""
    logits = model(tokens)
    lm = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long())
    return lm, lm + balance_objective(model, model.c)


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
    (loss + balance_objective(model, c)).backward()
    results["logits"] = logits.reshape(-1, V)
    results["loss"] = loss.reshape(1)
    for l, (aux, z) in zip(model.moe_layers(), model.balance):
        results[f"aux.{l}"] = aux.reshape(1)
        results[f"z.{l}"] = z.reshape(1)
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
            lm, objective = mean_loss(model, tensors[f"batch.{batch}.tokens"],
                                      tensors[f"batch.{batch}.targets"], V)
            (objective / c["accum"]).backward()
            total += lm.item() / c["accum"]
            batch += 1
        for p in model.parameters():  # an expert no token reached: a zero gradient, as in
            if p.grad is None:         # Tessera's flat buffer (AdamW still decays it)
                p.grad = torch.zeros_like(p)
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
