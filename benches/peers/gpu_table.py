#!/usr/bin/env python3
"""The table of `scripts/gpu_check.sh`: our routes beside PyTorch on one GPU.

Reads `examples/bench --json` lines (ours) and `bench_gpu.py`'s `RESULT`
lines (PyTorch's), matched by workload name, and prints one markdown table
per workload kind: per-sample gradients (each route of `vmap(grad)`, the
best fixed route, what `Auto` ran and its ratio to the best, and the ratios
to `torch.func` and the per-example loop) and ensembles (likewise, with the
loop over the models).

    python3 benches/peers/gpu_table.py OURS.jsonl TORCH.txt
"""
import json, sys

ROUTES = ["Grouped", "Unfold", "Loop"]


def load(ours_path, torch_path):
    ours, torch = {}, {}
    for line in open(ours_path):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            ours.setdefault(r["workload"], {})[r["variant"]] = r["median_ms"]
    for line in open(torch_path):
        if line.startswith("RESULT "):
            w, v, ms = [p.strip() for p in line[len("RESULT "):].split("|")]
            torch.setdefault(w, {})[v] = float(ms)
    return ours, torch


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(ours, torch, kind, prefix, tf_name, loop_name, ours_loop):
    rows = []
    for w, r in ours.items():
        if kind not in w:
            continue
        t = torch.get(w, {})
        fixed = {k: r.get(f"{prefix}{k}") for k in ROUTES}
        fixed = {k: v for k, v in fixed.items() if v is not None}
        best = min(fixed, key=fixed.get) if fixed else None
        auto = r.get(f"{prefix}Auto")
        rows.append(
            [w]
            + [fmt(fixed.get(k)) for k in ROUTES]
            + [fmt(auto), best or "-", fmt(ratio(auto, fixed.get(best))), fmt(t.get(tf_name)),
               fmt(ratio(fixed.get(best), t.get(tf_name))), fmt(t.get(loop_name)), fmt(r.get(ours_loop))]
        )
    head = ["workload"] + [f"{k} ms" for k in ROUTES] + [
        "Auto ms", "best route", "Auto / best", "torch.func ms", "best / torch.func", "torch loop ms", "our loop ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def main():
    ours, torch = load(sys.argv[1], sys.argv[2])
    print("#### Per-sample gradients\n")
    table(ours, torch, "per-sample gradients", "vmap(grad) ", "torch.func vmap(grad)", "torch per-example loop",
          "per-example loop")
    print("#### Ensembles (forward)\n")
    table(ours, torch, "ensemble of", "vmap batched, ", "torch.func vmap", "torch loop over the models",
          "loop over the 10 models")


if __name__ == "__main__":
    main()
