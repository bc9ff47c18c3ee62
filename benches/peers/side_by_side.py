#!/usr/bin/env python3
"""Our benchmark beside PyTorch's, round by round, with paired ratios.

Each round runs, one after another (never two at once on two cores):
`benches/peers/bench_torch.py` (per-sample gradients and the ordinary
batched step), `benches/peers/bench_ensembles.py` (the three ensembles, a
for-loop and torch.func's vmap) and the crate's `examples/bench.rs --json`
on the same workloads. A ratio is taken within each round, so load on the
machine during one round falls on both sides of that round's ratios; the
table gives each ratio's median, min and max over the rounds.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side.py [ROUNDS] [REPS] [FEATURES] [ONLY]

from the repository root; ROUNDS default 3, REPS (timed repetitions per
run) default 5, FEATURES passed to cargo (for instance `mimalloc`; `""`
for none), ONLY the workloads (default `T,O,C3D,ENS`).
Ratios below 1 favour this crate.
"""
import json, os, subprocess, sys
from paired import results, rounds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS = os.environ.get("PEERS", os.path.join(ROOT, "benches", "peers"))
PY = os.environ.get("PY", "python3")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"
FEATURES = sys.argv[3] if len(sys.argv) > 3 else ""
ONLY = sys.argv[4] if len(sys.argv) > 4 else "T,O,C3D,ENS"

# torch's per-sample tag -> our workload name's prefix
PER_SAMPLE = {"CNN-T B=64": "PyTorch-tutorial CNN, B=64", "CNN-O B=64": "Opacus MNIST CNN, B=64",
              "CNN-O B=256": "Opacus MNIST CNN, B=256", "C3D B=16": "conv3d net, B=16"}
# torch's ensemble tag -> the words our ensemble workload's name contains
ENSEMBLES = {"CNN-T": "tutorial CNNs", "CNN-O": "Opacus MNIST CNNs", "MLP": "MLPs"}


def torch_run():
    run = lambda script, *a: subprocess.run([PY, script, *a], capture_output=True, text=True, check=True).stdout
    t = {}
    for which in ONLY.split(","):
        script = "bench_ensembles.py" if which == "ENS" else "bench_torch.py"
        t.update(results(run(os.path.join(PEERS, script), "all" if which == "ENS" else which, REPS)))
    return t


def ours_run():
    cmd = ["cargo", "run", "--release", "-q", "--example", "bench"]
    if FEATURES:
        cmd += ["--features", FEATURES]
    cmd += ["--", "--only", ONLY, "--json", "--reps", REPS]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            res.setdefault(r["workload"], {})[r["variant"]] = r["median_ms"]
    return res


def find(ours, *words):
    return next((v for k, v in ours.items() if all(w in k for w in words)), None)


def ratios(t, o):
    rows = {}
    for tag, name in PER_SAMPLE.items():
        wl = next((v for k, v in o.items() if k.startswith(name)), None)
        func, std = t.get(f"{tag} (ii) torch.func vmap(grad)"), t.get(f"{tag} (i) standard fwd+bwd")
        opacus = t.get(f"{tag} (iii) Opacus GradSampleModule hooks")
        if not wl or not func:
            continue
        auto = wl.get("vmap(grad) Auto")
        rows[f"{tag}: our vmap(grad), Auto / torch.func"] = auto / func
        if opacus:
            rows[f"{tag}: our vmap(grad), Auto / Opacus"] = auto / opacus
        rows[f"{tag}: our batched step / torch's"] = wl["batched gradient step"] / std
    for tag, words in ENSEMBLES.items():
        for kind, ours_kind in (("shared", "one shared batch"), ("own", "a batch per model")):
            wl = find(o, "ensemble", words, ours_kind)
            tl, tv = t.get(f"ENS {tag} {kind}-batch for-loop over M=10"), t.get(f"ENS {tag} {kind}-batch torch.func vmap")
            if not wl or not tl:
                continue
            loop, vm = wl["loop over the 10 models"], wl["vmap default"]
            rows[f"ENS {tag} {kind}: our vmap / our loop"] = vm / loop
            rows[f"ENS {tag} {kind}: our vmap / torch loop"] = vm / tl
            rows[f"ENS {tag} {kind}: our vmap / torch.func vmap"] = vm / tv
            rows[f"ENS {tag} {kind}: our loop / torch loop"] = loop / tl
    return rows


def show(t, o):
    for k, v in t.items():
        print(f"torch  {k}: {v:.3f}")
    for wl, variants in o.items():
        for k, v in variants.items():
            print(f"ours   {wl} | {k}: {v:.3f}")


rounds(ROUNDS, torch_run, ours_run, ratios, show, heading="ratio (below 1 favours candle-func)")
