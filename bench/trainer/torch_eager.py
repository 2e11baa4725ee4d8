"""Plain PyTorch eager training of the same Llama-3 debug model, batch and seq_len as titan-train:
the baseline for bench/trainer/run.sh.

Same architecture as torchtitan's llama3 (complex RoPE with llama3 scaling, RMSNorm, SwiGLU, causal
SDPA), fp32 (or with `--autocast`: fp32 master weights and AdamW, forward and loss under
torch.autocast("cpu", bfloat16) as torchtitan 0.3.0 trains), loss = summed CE / valid tokens, clip_grad_norm_(1.0), torch.optim.AdamW with
torchtitan's hyper-parameters, same intra-op thread count. Tokens are random ids (data loading
is not what is measured; titan-train's tokenization is included in its own numbers).

Prints one JSON line: tokens/s over the timed steps (after warmup) and peak RSS.
"""

import argparse
import json
import math
import resource
import time

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = rope(q, freqs_cis), rope(k, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k[:, :, :, None, :].expand(b, s, self.n_kv_heads, n_rep, self.head_dim).reshape(b, s, -1, self.head_dim)
            v = v[:, :, :, None, :].expand(b, s, self.n_kv_heads, n_rep, self.head_dim).reshape(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def rope(x, freqs_cis):
    b, s, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(xc * freqs_cis[:s].view(1, s, 1, d // 2)).flatten(3).type_as(x)


def freqs(head_dim, end, theta=500000.0):
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / f
    smooth = (old / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old / low, f / factor, f)
    mid = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = torch.where(mid, (1 - smooth) * f / factor + smooth * f, scaled)
    t = torch.arange(end).float()
    angles = torch.outer(t, scaled)
    return torch.polar(torch.ones_like(angles), angles)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, eps):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab=2048, multiple_of=256, seq_len=256,
                 ffn_dim_multiplier=None, tie=False):
        super().__init__()
        hidden = int(2 * 4 * dim / 3)
        if ffn_dim_multiplier is not None:
            hidden = int(ffn_dim_multiplier * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden, 1e-5) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight
        self.full_ac = False
        self.register_buffer("freqs_cis", freqs(dim // n_heads, seq_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.full_ac and torch.is_grad_enabled():
                # torchtitan's FullAC: checkpoint_wrapper around each block (non-reentrant).
                h = torch.utils.checkpoint.checkpoint(layer, h, self.freqs_cis, use_reentrant=False)
            else:
                h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()


# torchtitan 0.3.0's llama3 flavors as this model's arguments.
FLAVORS = {
    "debugmodel": {},
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab=128256, multiple_of=1024,
               ffn_dim_multiplier=1.5, tie=True),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--autocast", action="store_true", help="bf16 autocast forward (fp32 weights)")
    p.add_argument("--full_ac", action="store_true", help="recompute every block in backward")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the GPU baseline)")
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS),
                   help="torchtitan's llama3 flavor of the same name")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Llama(seq_len=a.seq_len, **FLAVORS[a.flavor]).to(a.device)
    vocab = model.output.weight.shape[0]
    model.full_ac = a.full_ac
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    start = None
    for step in range(1, a.steps + 1):
        if step == a.warmup + 1:
            start = time.perf_counter()
        window = torch.randint(0, vocab, (a.batch, a.seq_len + 1), device=a.device)
        inputs, labels = window[:, :-1], window[:, 1:]
        ntokens = (labels != -100).sum()
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.autocast):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100) / ntokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss.item()
    if a.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = (a.steps - a.warmup) * a.batch * a.seq_len
    print(json.dumps({
        "impl": ("torch_eager_autocast" if a.autocast else "torch_eager") + ("_full_ac" if a.full_ac else ""),
        "tps": tokens / elapsed,
        "threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "device": a.device,
        "flavor": a.flavor,
        "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
