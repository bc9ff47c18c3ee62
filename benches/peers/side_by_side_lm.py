#!/usr/bin/env python3
"""Per-sample gradients of `tiny_lm` beside torch.func's and Opacus's in
paired rounds (`paired.py`): `bench_lm.py`, then `examples/bench.rs --only
LM --json`.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_lm.py [ROUNDS] [REPS]

from the repository root; ROUNDS default 5, REPS default 7. Below 1
favours this crate.
"""
import sys
from paired import ms, ours, peer, rounds

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
REPS = sys.argv[2] if len(sys.argv) > 2 else "7"


def ratios(t, o):
    o = ms(o)
    return {
        "tiny_lm vmap(grad): ours / torch.func": o["vmap(grad)"] / t["LM B=32 (ii) torch.func vmap(grad)"],
        "tiny_lm vmap(grad): ours / Opacus": o["vmap(grad)"] / t["LM B=32 (iii) Opacus GradSampleModule hooks"],
        "tiny_lm: our vmap(grad) / our batched step": o["vmap(grad)"] / o["batched gradient step"],
        "tiny_lm: our batched step / torch's": o["batched gradient step"] / t["LM B=32 (i) standard fwd+bwd"],
    }


rounds(ROUNDS, lambda: peer("bench_lm.py", REPS), lambda: ours("LM", REPS), ratios)
