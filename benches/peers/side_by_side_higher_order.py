#!/usr/bin/env python3
"""The higher-order transforms beside torch.func's in paired rounds
(`paired.py`): `bench_higher_order.py`, then `examples/bench.rs --only
NTK,HO --json`.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_higher_order.py [ROUNDS] [REPS]

from the repository root; ROUNDS default 5, REPS default 5. Ratios of ours
to torch.func below 1 favour this crate.
"""
import sys
from paired import ms, ours, peer, rounds

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"


def ratios(t, o):
    o = ms(o)
    return {
        "NTK, Jacobian contraction: ours / torch.func": o["Jacobian contraction"] / t["NTK jacobian contraction"],
        "NTK, NTK-vector products: ours / torch.func": o["NTK-vector products"] / t["NTK ntk-vector products"],
        "MLP hvp / grad: ours": o["MLP loss, B=64: hvp (forward over reverse)"] / o["MLP loss, B=64: grad"],
        "MLP hvp / grad: torch.func": t["HO MLP hvp"] / t["HO MLP grad"],
        "MLP hvp: ours / torch.func": o["MLP loss, B=64: hvp (forward over reverse)"] / t["HO MLP hvp"],
        "R^16 -> R^1024: jacfwd / jacrev (ours)": o["R^16 -> R^1024: jacfwd"] / o["R^16 -> R^1024: jacrev"],
        "R^1024 -> R^16: jacfwd / jacrev (ours)": o["R^1024 -> R^16: jacfwd"] / o["R^1024 -> R^16: jacrev"],
    }


rounds(ROUNDS, lambda: peer("bench_higher_order.py", REPS), lambda: ours("NTK,HO", REPS), ratios)
