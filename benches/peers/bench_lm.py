"""Per-sample gradients of `tiny_lm` (the model of `tests/fixtures/README.md`)
at the size of `bench --only LM`: V=64, D=64, H=4, L=2, F=256, T=64, B=32,
LayerNorm, GELU, causal. Times (i) one ordinary batched gradient step,
(ii) torch.func `vmap(grad)` and (iii) Opacus's `GradSampleModule` hooks,
as `benches/peers/bench_torch.py` times its workloads (3 warm-ups, then
REPS repetitions, medians; 2 threads), and prints the peak memory the
process's allocator reports beside time (CPU: the growth of the resident
set while the variant runs, from /proc).

    $HOME/peers/bin/python benches/peers/bench_lm.py [REPS]
"""
import copy, os, sys, warnings

warnings.filterwarnings("ignore")
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from opacus import GradSampleModule
from tiny_lm import TinyLM, V, T
import timing

torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))  # PEER_THREADS=1 for one-thread rounds
torch.manual_seed(0)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
B = 32


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench(name, f):
    timing.bench(name, f, REPS, extra=lambda: f"  process peak RSS {rss_mib():.0f} MiB")


model = TinyLM()
x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
lm_loss = lambda logits, y: F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def std():
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()


params = {k: v.detach() for k, v in model.named_parameters()}
per_example = vmap(grad(lambda p, xi, yi: lm_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))), in_dims=(None, 0, 0))
gm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")


def opacus_hooks():
    gm.zero_grad(set_to_none=True)
    logits = gm(x)
    # each example's loss is its mean over positions; summed over the batch
    F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="sum").div(T).backward()
    return [p.grad_sample for p in gm.parameters()]


bench(f"LM B={B} (i) standard fwd+bwd", std)
bench(f"LM B={B} (ii) torch.func vmap(grad)", lambda: per_example(params, x, y))
bench(f"LM B={B} (iii) Opacus GradSampleModule hooks", opacus_hooks)
a = per_example(params, x, y)
b = dict(zip([k.removeprefix("_module.") for k, _ in gm.named_parameters()], opacus_hooks()))
print(f"CHECK LM maxabs opacus-vs-func {max((a[k] - b[k]).abs().max().item() for k in a):.3e}")
