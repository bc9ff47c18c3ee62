#!/usr/bin/env python3
"""PyTorch's side of the ensemble workloads in `examples/bench.rs --only ENS`.

Ten models, forward only, B=64, f32, 2 threads: a Python for-loop over the
models, and torch.func's ensembling recipe (`stack_module_state` +
`functional_call` under `vmap`, as in the "Model ensembling" tutorial), each
with one shared batch (`in_dims=(0, 0, None)`) and with a batch per model
(`in_dims=(0, 0, 0)`). The models: the per-sample-gradients tutorial CNN and
the Opacus MNIST CNN from `benches/peers/models.py`, and the tutorial's MLP
784-128-128-10 defined here.

Prints `RESULT <name> median <ms> ...` lines as `benches/peers/bench_torch.py`
does, and a CHECK line per workload (vmap against the loop).

    "$HOME/peers/bin/python" benches/peers/bench_ensembles.py [WHICH] [REPS]

WHICH: all (default), CNN-T, CNN-O or MLP.
"""
import copy, os, statistics, sys, time, warnings

warnings.filterwarnings("ignore")
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))  # PEER_THREADS=1 for one-thread rounds
HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.environ.get("PEERS", HERE)
if not os.path.exists(os.path.join(PEERS, "models.py")):
    sys.exit(f"bench_ensembles.py: no models.py in {PEERS}; set PEERS to the folder that holds it")
sys.path.insert(0, PEERS)
from models import CNNO, CNNT  # noqa: E402


class MLP(nn.Module):
    """The torch.func ensembling tutorial's model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


WHICH = sys.argv[1] if len(sys.argv) > 1 else "all"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 11
M, B = 10, 64
print("torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)


def bench(name, f, reps=REPS, warm=3):
    with torch.no_grad():
        for _ in range(warm):
            f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t) * 1e3)
    med = statistics.median(ts)
    print(f"RESULT {name:<55} median {med:10.3f} ms  min {min(ts):10.3f}  max {max(ts):10.3f}  (n={reps})", flush=True)
    return med


def ensemble(tag, make, example):
    torch.manual_seed(0)
    models = [make() for _ in range(M)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def fmodel(p, b, x):
        return functional_call(base, (p, b), (x,))

    x = torch.randn(B, *example)
    xs = torch.randn(M, B, *example)
    shared = vmap(fmodel, in_dims=(0, 0, None))
    own = vmap(fmodel, in_dims=(0, 0, 0))
    bench(f"{tag} single model fwd B={B}", lambda: models[0](x))
    bench(f"{tag} shared-batch for-loop over M={M}", lambda: [m(x) for m in models])
    bench(f"{tag} shared-batch torch.func vmap", lambda: shared(params, buffers, x))
    bench(f"{tag} own-batch for-loop over M={M}", lambda: [m(xs[i]) for i, m in enumerate(models)])
    bench(f"{tag} own-batch torch.func vmap", lambda: own(params, buffers, xs))
    with torch.no_grad():
        d1 = (shared(params, buffers, x) - torch.stack([m(x) for m in models])).abs().max().item()
        d2 = (own(params, buffers, xs) - torch.stack([m(xs[i]) for i, m in enumerate(models)])).abs().max().item()
    print(f"CHECK {tag} vmap-vs-loop shared {d1:.3e} own {d2:.3e}", flush=True)


WORK = {"CNN-T": (CNNT, (1, 28, 28)), "CNN-O": (CNNO, (1, 28, 28)), "MLP": (MLP, (784,))}
for tag, (make, example) in WORK.items():
    if WHICH in ("all", tag):
        ensemble(f"ENS {tag}", make, example)
