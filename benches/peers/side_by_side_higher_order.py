#!/usr/bin/env python3
"""The higher-order transforms beside torch.func's, round by round, with
paired ratios (the method of `side_by_side.py`): each round runs
`benches/peers/bench_higher_order.py` and then the crate's `examples/bench.rs
--only NTK,HO --json`, one after the other, and takes the ratios within the
round; the table gives each ratio's median, min and max over the rounds.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_higher_order.py [ROUNDS] [REPS]

from the repository root; ROUNDS default 5, REPS default 5. Ratios of ours
to torch.func below 1 favour this crate.
"""
import json, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PY", "python3")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"


def torch_run():
    script = os.path.join(ROOT, "benches", "peers", "bench_higher_order.py")
    out = subprocess.run([PY, script, REPS], capture_output=True, text=True, check=True).stdout
    return {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"RESULT (.+?)\s+median\s+([0-9.]+) ms", out)}


def ours_run():
    cmd = ["cargo", "run", "--release", "-q", "--example", "bench", "--", "--only", "NTK,HO", "--json", "--reps", REPS]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return {json.loads(l)["variant"]: json.loads(l)["median_ms"] for l in out.splitlines() if l.startswith("{")}


def ratios(t, o):
    return {
        "NTK, Jacobian contraction: ours / torch.func": o["Jacobian contraction"] / t["NTK jacobian contraction"],
        "NTK, NTK-vector products: ours / torch.func": o["NTK-vector products"] / t["NTK ntk-vector products"],
        "MLP hvp / grad: ours": o["MLP loss, B=64: hvp (forward over reverse)"] / o["MLP loss, B=64: grad"],
        "MLP hvp / grad: torch.func": t["HO MLP hvp"] / t["HO MLP grad"],
        "MLP hvp: ours / torch.func": o["MLP loss, B=64: hvp (forward over reverse)"] / t["HO MLP hvp"],
        "R^16 -> R^1024: jacfwd / jacrev (ours)": o["R^16 -> R^1024: jacfwd"] / o["R^16 -> R^1024: jacrev"],
        "R^1024 -> R^16: jacfwd / jacrev (ours)": o["R^1024 -> R^16: jacfwd"] / o["R^1024 -> R^16: jacrev"],
    }


table, last = {}, None
for r in range(ROUNDS):
    t, o = torch_run(), ours_run()
    for k, v in ratios(t, o).items():
        table.setdefault(k, []).append(v)
    last = (t, o)
    print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
print(f"| ratio | median of {ROUNDS} rounds | min | max |")
print("| --- | --- | --- | --- |")
for k, v in table.items():
    print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
t, o = last
print("\nlast round, milliseconds:\n")
for k, v in t.items():
    print(f"torch.func  {k}: {v:.3f}")
for k, v in o.items():
    print(f"ours        {k}: {v:.3f}")
