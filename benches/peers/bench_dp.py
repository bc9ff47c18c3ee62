"""One DP-SGD training step (clip + noise + update) with Opacus beside an
ordinary training step, on the models and batches of `bench --only DP`:
the PyTorch-tutorial CNN at B=64, the Opacus MNIST CNN at B=256 and
`tiny_lm` at B=32. Times, per model,

  (i)   the ordinary step: forward, backward, SGD update;
  (ii)  Opacus's ghost clipping step (`grad_sample_mode="ghost"`: norms
        without per-sample gradients, then a second, reweighted backward),
        noise and the update by its `DPOptimizer`;
  (iii) Opacus's hooks step (per-sample gradients materialised), noise,
        update,

as `benches/peers/bench_torch.py` times its workloads (3 warm-ups, then
REPS repetitions, medians; 2 threads). Every batch is the whole data set
without Poisson sampling, so each step sees the same B examples; clipping
norm 1, noise multiplier 1, SGD with lr 0.05.

    $HOME/peers/bin/python benches/peers/bench_dp.py [REPS]
"""
import os, sys, warnings

warnings.filterwarnings("ignore")
import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus import PrivacyEngine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import CNNO, CNNT  # noqa: E402
from tiny_lm import TinyLM, V, T  # noqa: E402
import timing  # noqa: E402

torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))  # PEER_THREADS=1 for one-thread rounds
torch.manual_seed(0)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15


def bench(name, f):
    timing.bench(name, f, REPS)


class SeqCE(nn.Module):
    """Cross-entropy over `[B, T, V]` logits: each example's loss is its mean
    over positions (the per-example loss of our `tiny_lm` bench)."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, y):
        per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(y.shape[0], -1).mean(1)
        return per.mean() if self.reduction == "mean" else per.sum()


def steps(tag, make, x, y, criterion):
    model = make()

    def plain():
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bench(f"{tag} (i) ordinary step", plain)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    for mode, label in (("ghost", "(ii) Opacus ghost clipping step"), ("hooks", "(iii) Opacus hooks step")):
        m = make()
        o = torch.optim.SGD(m.parameters(), lr=0.05)
        engine = PrivacyEngine()
        out = engine.make_private(
            module=m, optimizer=o, data_loader=loader, criterion=criterion, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode,
        )
        pm, po, crit = out[0], out[1], (out[2] if mode == "ghost" else criterion)

        def dp_step(pm=pm, po=po, crit=crit):
            po.zero_grad(set_to_none=True)
            crit(pm(x), y).backward()
            po.step()

        bench(f"{tag} {label}", dp_step)


def labels(b):
    return torch.tensor([(i * 7 + 3) % 10 for i in range(b)])


steps("CNN-T B=64", CNNT, torch.randn(64, 1, 28, 28), labels(64), nn.CrossEntropyLoss())
steps("CNN-O B=256", CNNO, torch.randn(256, 1, 28, 28), labels(256), nn.CrossEntropyLoss())
ids = lambda k: torch.tensor([(i * k + 3) % V for i in range(32 * T)]).view(32, T)
steps("LM B=32", TinyLM, ids(7), ids(13), SeqCE())
