#!/usr/bin/env python3
"""PyTorch's side of `scripts/gpu_check.sh`: the seed's workloads on a CUDA
GPU, timed as `examples/bench.rs` times ours there (warm-up calls, then the
median of REPS, each call followed by `torch.cuda.synchronize()`).

* per-sample gradients of the tutorial CNN (B=64) and the Opacus MNIST CNN
  (B=64, 256): the ordinary batched gradient step, `torch.func`'s
  `vmap(grad)` and a per-example loop of backward passes;
* ensembles of 10 of each CNN, forward, B=64, one shared batch and a batch
  per model: a Python loop over the models and `torch.func`'s recipe
  (`stack_module_state` + `functional_call` under `vmap`).

Prints `RESULT <workload> | <variant> | <median ms>` lines that
`benches/peers/gpu_table.py` reads beside ours.

    python3 benches/peers/bench_gpu.py [REPS]
"""
import copy, os, statistics, sys, time, warnings

warnings.filterwarnings("ignore")
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.environ.get("PEERS", HERE)
if not os.path.exists(os.path.join(PEERS, "models.py")):
    sys.exit(f"bench_gpu.py: no models.py in {PEERS}; set PEERS to the folder that holds it")
sys.path.insert(0, PEERS)
from models import CNNO, CNNT  # noqa: E402

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 11
# PEER_DEVICE=cpu runs it here, to check the script and the table
DEV = torch.device(os.environ.get("PEER_DEVICE", "cuda"))
if DEV.type == "cuda" and not torch.cuda.is_available():
    sys.exit("bench_gpu.py: no CUDA device")
torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))
name = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "the CPU"
print("torch", torch.__version__, "on", name, flush=True)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench(workload, variant, f, reps=REPS, warm=3):
    for _ in range(warm):
        f()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    med = statistics.median(ts)
    print(f"RESULT {workload} | {variant} | {med:.3f}", flush=True)
    return med


def per_sample(tag, make, b, with_loop):
    torch.manual_seed(0)
    model = make().to(DEV)
    x = torch.randn(b, 1, 28, 28, device=DEV)
    y = torch.arange(b, device=DEV) * 7 % 10
    loss = model.loss
    workload = f"{tag}, B={b}: per-sample gradients"

    def step():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    bench(workload, "batched gradient step", step)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def lf(p, xi, yi):
        return loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    ft = vmap(grad(lf), in_dims=(None, 0, 0))
    bench(workload, "torch.func vmap(grad)", lambda: ft(params, x, y))
    if with_loop:

        def loop():
            for i in range(b):
                model.zero_grad(set_to_none=True)
                loss(model(x[i : i + 1]), y[i : i + 1]).backward()

        bench(workload, "torch per-example loop", loop, reps=max(3, REPS // 3))


def ensemble(tag, make, own):
    torch.manual_seed(0)
    m, b = 10, 64
    models = [make().to(DEV) for _ in range(m)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def fmodel(p, bu, x):
        return functional_call(base, (p, bu), (x,))

    kind = "a batch per model" if own else "one shared batch"
    workload = f"ensemble of {m} {tag}, forward, {kind} of {b}"
    x = torch.randn(m, b, 1, 28, 28, device=DEV) if own else torch.randn(b, 1, 28, 28, device=DEV)
    with torch.no_grad():
        xi = (lambda i: x[i]) if own else (lambda i: x)
        bench(workload, "torch loop over the models", lambda: [mm(xi(i)) for i, mm in enumerate(models)])
        f = vmap(fmodel, in_dims=(0, 0, 0 if own else None))
        bench(workload, "torch.func vmap", lambda: f(params, buffers, x))


per_sample("PyTorch-tutorial CNN", CNNT, 64, True)
for b in (64, 256):
    per_sample("Opacus MNIST CNN", CNNO, b, True)
for tag, make in (("tutorial CNNs", CNNT), ("Opacus MNIST CNNs", CNNO)):
    for own in (False, True):
        ensemble(tag, make, own)
