"""`tiny_lm` in PyTorch (the model of `tests/fixtures/README.md`) at the
size of `bench --only LM`: V=64, D=64, H=4, L=2, F=256, T=64, LayerNorm,
GELU, causal. Shared by `bench_lm.py` and `bench_dp.py`."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, L, FF, T = 64, 64, 4, 2, 256, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ff1, self.ff2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        n, t, _ = x.shape
        h = self.ln1(x)
        split = lambda z: z.view(n, t, H, D // H).transpose(1, 2)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        s = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        a = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(n, t, D))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        n, t = x.shape
        # positions with a batch axis, as Opacus's embedding hook needs, and
        # contiguous, as its ghost-clipping embedding norm needs
        h = self.tok(x) + self.pos(torch.arange(t).expand(n, t).contiguous())
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))
