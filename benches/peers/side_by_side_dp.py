#!/usr/bin/env python3
"""One DP-SGD training step (clip + noise + update) beside Opacus's, in
paired rounds (`paired.py`): `bench_dp.py`, then `examples/bench.rs --only
DP --json`, on the tutorial CNN at B=64, the Opacus CNN at B=256 and
`tiny_lm` at B=32.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_dp.py [ROUNDS] [REPS]

from the repository root; ROUNDS default 5, REPS default 7. Below 1
favours this crate. Peak memory is ours only (the interpreter's buffer
accounting plus the updates' parameter-sized temporaries); the peers
report none comparable.
"""
import sys
from paired import our_rows, peer, rounds

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
REPS = sys.argv[2] if len(sys.argv) > 2 else "7"
MODELS = [("tutorial CNN", "PyTorch-tutorial CNN", "CNN-T B=64"), ("Opacus CNN", "Opacus MNIST CNN", "CNN-O B=256"), ("tiny_lm", "tiny_lm", "LM B=32")]


def ours():
    return {(r["workload"], r["variant"]): (r["median_ms"], r["peak_mib"]) for r in our_rows("DP", REPS)}


def find(o, model, variant):
    return next(v for (w, k), v in o.items() if w.startswith(model) and k == variant)


def ratios(t, o):
    out = {}
    for name, ours_tag, peer_tag in MODELS:
        dp, train = find(o, ours_tag, "DP step, ghost (clip + noise + SGD)"), find(o, ours_tag, "batched training step (+ SGD)")
        out[f"{name}: our DP step (ghost) / our training step, time"] = dp[0] / train[0]
        out[f"{name}: our DP step (ghost) / our training step, peak memory"] = dp[1] / train[1]
        halves = find(o, ours_tag, "DP step, ghost, two passes of B/2")
        out[f"{name}: our DP step (ghost, two passes of B/2) / our training step, time"] = halves[0] / train[0]
        out[f"{name}: our DP step (ghost, two passes of B/2) / our training step, peak memory"] = halves[1] / train[1]
        single = find(o, ours_tag, "DP step, ghost, single-draw noise (not secure)")
        out[f"{name}: our DP step (ghost, single-draw noise) / our training step, time"] = single[0] / train[0]
        out[f"{name}: our DP step (ghost) / Opacus ghost clipping step"] = dp[0] / t[f"{peer_tag} (ii) Opacus ghost clipping step"]
        out[f"{name}: our DP step (ghost, single-draw noise, as Opacus's) / Opacus ghost clipping step"] = single[0] / t[f"{peer_tag} (ii) Opacus ghost clipping step"]
        out[f"{name}: our DP step (ghost) / Opacus hooks step"] = dp[0] / t[f"{peer_tag} (iii) Opacus hooks step"]
        out[f"{name}: Opacus ghost step / torch's training step"] = t[f"{peer_tag} (ii) Opacus ghost clipping step"] / t[f"{peer_tag} (i) ordinary step"]
    return out


def show(t, o):
    for k, v in t.items():
        print(f"peer  {k}: {v:.3f}")
    for (w, k), (v, peak) in o.items():
        print(f"ours  {w} / {k}: {v:.3f}  (peak {peak:.1f} MiB)")


rounds(ROUNDS, lambda: peer("bench_dp.py", REPS), ours, ratios, show)
