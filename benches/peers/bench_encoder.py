"""The encoder of `examples/bench_attention.rs` in plain PyTorch (no
transformers, no checkpoint: it runs wherever torch does), one variant per
process so that the process's peak resident memory is that variant's:
post-norm BERT layers (separate query/key/value/output projections,
`scaled_dot_product_attention` with the padding mask, GELU feed-forward),
token and position embeddings, a 2-class head on the first position, the
batch `bench_attention.rs` draws (example i keeps T - 32 i tokens, at
least 16).

* forward: the logits (no_grad);
* step: the batch's mean loss and its gradient (`backward`);
* psg: every parameter's per-sample gradient by torch.func
  (`vmap(grad(functional_call))`);
* dp: one Opacus ghost-clipping DP step, where Opacus is installed
  (prints `unsupported` otherwise).

    python3 benches/peers/bench_encoder.py VARIANT [REPS] [minilm|bert-base] [LAYERS] [B] [T]

PEER_THREADS sets torch's threads (default 2).
"""
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from timing import process_result

warnings.filterwarnings("ignore")
THREADS = int(os.environ.get("PEER_THREADS", "2"))
torch.set_num_threads(THREADS)
VOCAB = 30522
SHAPES = {"bert-base": (768, 12, 3072, 12), "minilm": (384, 12, 1536, 6)}


class Layer(torch.nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (torch.nn.Linear(d, d) for _ in range(3))
        self.attention_out = torch.nn.Linear(d, d)
        self.attention_norm = torch.nn.LayerNorm(d, eps=1e-12)
        self.intermediate = torch.nn.Linear(d, ff)
        self.output = torch.nn.Linear(ff, d)
        self.output_norm = torch.nn.LayerNorm(d, eps=1e-12)

    def forward(self, h, keep):
        b, t, d = h.shape
        split = lambda x: x.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # B T D -> B H T Dh
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        a = a.transpose(1, 2).reshape(b, t, d)  # B H T Dh -> B T D
        h = self.attention_norm(h + self.attention_out(a))
        return self.output_norm(h + self.output(F.gelu(self.intermediate(h))))


class Encoder(torch.nn.Module):
    def __init__(self, shape, layers, t):
        super().__init__()
        d, heads, ff, _ = shape
        self.words = torch.nn.Embedding(VOCAB, d)
        self.positions = torch.nn.Embedding(t, d)
        self.norm = torch.nn.LayerNorm(d, eps=1e-12)
        self.layers = torch.nn.ModuleList(Layer(d, heads, ff) for _ in range(layers))
        self.classifier = torch.nn.Linear(d, 2)

    def forward(self, ids, keep):
        # [B, T] positions, not [T]: Opacus reads the batch off every
        # layer's input
        pos = torch.arange(ids.shape[-1]).expand(ids.shape).contiguous()
        h = self.norm(self.words(ids) + self.positions(pos))
        for layer in self.layers:
            h = layer(h, keep)
        return self.classifier(h[:, 0])


def batch(b, t):
    """The ids, mask and labels `bench_attention.rs` draws (the same recurrence)."""
    ids = torch.zeros(b, t, dtype=torch.long)
    keep = torch.zeros(b, t, dtype=torch.bool)
    state = 7
    for i in range(b):
        for j in range(max(t - 32 * i, min(16, t))):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            ids[i, j] = 1000 + (state >> 33) % (VOCAB - 1000)
            keep[i, j] = True
    return ids, keep, torch.arange(b) % 2


def main():
    variant = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    shape = SHAPES[sys.argv[3] if len(sys.argv) > 3 else "bert-base"]
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else shape[3]
    b = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    t = int(sys.argv[6]) if len(sys.argv) > 6 else 1024
    model = Encoder(shape, layers, t)
    ids, keep, labels = batch(b, t)
    if variant == "forward":
        model.eval()

        def run():
            with torch.no_grad():
                model(ids, keep)

    elif variant == "step":

        def run():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(ids, keep), labels).backward()

    elif variant == "psg":
        from torch.func import functional_call, grad, vmap

        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, m, y):
            logits = functional_call(model, p, (x[None], m[None]))
            return F.cross_entropy(logits, y[None])

        per_sample = vmap(grad(loss), in_dims=(None, 0, 0, 0))

        def run():
            per_sample(params, ids, keep, labels)

    elif variant == "dp":
        try:
            from opacus import PrivacyEngine
        except ImportError:
            print("unsupported: opacus is not installed")
            return
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        data = torch.utils.data.TensorDataset(ids, keep, labels)
        loader = torch.utils.data.DataLoader(data, batch_size=b)
        model, opt, crit, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False,
        )

        def run():
            opt.zero_grad()
            crit(model(ids, keep), labels).backward()
            opt.step()

    else:
        raise SystemExit(f"variant {variant}: one of forward, step, psg, dp")
    process_result(variant, run, reps, THREADS)


if __name__ == "__main__":
    main()
