# Records small, real PyTorch profiler traces to use as test fixtures of `tessera report`:
# one training step of a tiny Llama-style model (RMSNorm, RoPE, GQA attention through SDPA,
# SwiGLU MLP, cross-entropy, fused AdamW) under bf16 autocast, profiled with record_shapes.
#
#   python3 record_torch_trace.py --out DIR                # one process, CPU or GPU
#   torchrun --nproc-per-node 2 record_torch_trace.py --out DIR   # DDP: one trace per rank
#   python3 record_torch_trace.py --out DIR --compile      # torch.compile: Triton kernels
#
# Writes DIR/<name>rank-<r>.pt.trace.json (name: "cpu_", "gpu_", "ddp_", "compiled_").
# The model is tiny on purpose: fixtures must stay small enough to live in tests/data.
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--layers", type=int, default=1)
p.add_argument("--dim", type=int, default=256)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--compile", action="store_true")
a = p.parse_args()

HEADS, KV_HEADS, VOCAB = 4, 2, 1024
HEAD_DIM = a.dim // HEADS
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
dev = "cuda" if torch.cuda.is_available() else "cpu"
if world > 1:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl")


class RMSNorm(nn.Module):  # nn.RMSNorm appeared in PyTorch 2.4; Debian's CPU build is older
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


Norm = getattr(nn, "RMSNorm", RMSNorm)


def attention(q, k, v):  # q: (B, H, T, D), k, v: (B, KV, T, D)
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def rope(x, cos, sin):  # x: (B, H, T, D), rotate-half convention
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        d = a.dim
        self.n1, self.n2 = Norm(d), Norm(d)
        self.q = nn.Linear(d, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(d, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, d, bias=False)
        self.w13 = nn.Linear(d, 2 * 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.n1(x)
        q = self.q(y).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(y).view(b, t, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        att = attention(q, k, v)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, a.dim)
        self.blocks = nn.ModuleList([Block() for _ in range(a.layers)])
        self.norm = Norm(a.dim)
        self.head = nn.Linear(a.dim, VOCAB, bias=False)

    def forward(self, idx, cos, sin):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


torch.manual_seed(0)
model = Model().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if dev == "cuda" else {}))
fwd = model
if world > 1:
    fwd = torch.nn.parallel.DistributedDataParallel(model)
if a.compile:
    fwd = torch.compile(fwd)
inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
freqs = torch.outer(torch.arange(a.seq, device=dev).float(), inv)
cos, sin = torch.cos(freqs), torch.sin(freqs)
amp_dtype = torch.bfloat16


def step():
    idx = torch.randint(0, VOCAB, (a.batch, a.seq + 1), device=dev)
    with torch.autocast(dev, dtype=amp_dtype):
        logits = fwd(idx[:, :-1], cos, sin)
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(3):
    step()
activities = [torch.profiler.ProfilerActivity.CPU]
if dev == "cuda":
    activities.append(torch.profiler.ProfilerActivity.CUDA)
    torch.cuda.synchronize()
with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
    step()
    if dev == "cuda":
        torch.cuda.synchronize()
kind = "compiled_" if a.compile else ("ddp_" if world > 1 else ("gpu_" if dev == "cuda" else "cpu_"))
os.makedirs(a.out, exist_ok=True)
prof.export_chrome_trace(os.path.join(a.out, f"{kind}rank-{rank}.pt.trace.json"))
if world > 1:
    torch.distributed.destroy_process_group()
