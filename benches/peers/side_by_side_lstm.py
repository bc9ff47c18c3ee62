#!/usr/bin/env python3
"""Per-sample gradients of a one-layer LSTM classifier (embedding 64,
hidden 128, T=64, B=64) beside Opacus 1.6's DPLSTM and torch.func, in
paired rounds: each round runs `bench_lstm.py` and then
`examples/bench_lstm.rs`, each in a fresh process (the peak resident
memory each prints is that process's), at one thread each and at two.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_lstm.py [ROUNDS] [REPS]

from the repository root (build first: cargo build --release --example
bench_lstm). Prints each ratio's median, min and max over the rounds and
the last round's figures. Below 1 favours this crate.
"""
import os
import sys

from rounds import PY, ROOT, paired, run

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"


def main():
    ours_bin = os.path.join(ROOT, "target", "release", "examples", "bench_lstm")
    peer = os.path.join(ROOT, "benches", "peers", "bench_lstm.py")

    def one_round(threads):
        got = {
            ("peer", "psg_dplstm"): run([PY, peer, "psg_dplstm", REPS], threads),
            ("peer", "torch_func"): run([PY, peer, "torch_func", REPS], threads),
            ("ours", "psg"): run([ours_bin, "--variant", "psg", "--reps", REPS], threads),
            ("ours", "dp"): run([ours_bin, "--variant", "dp", "--reps", REPS], threads),
            ("ours", "step"): run([ours_bin, "--variant", "step", "--reps", REPS], threads),
        }
        t = lambda side, v: got[(side, v)][0]
        m = lambda side, v: got[(side, v)][2]
        out = {
            "per-sample gradients: ours / Opacus DPLSTM, time": t("ours", "psg") / t("peer", "psg_dplstm"),
            "per-sample gradients: ours / Opacus DPLSTM, peak RSS": m("ours", "psg") / m("peer", "psg_dplstm"),
            "clipped sum (ghost) / Opacus DPLSTM per-sample, time": t("ours", "dp") / t("peer", "psg_dplstm"),
            "per-sample gradients / our training step, time": t("ours", "psg") / t("ours", "step"),
        }
        if got[("peer", "torch_func")] is not None:
            out["per-sample gradients: ours / torch.func, time"] = t("ours", "psg") / t("peer", "torch_func")
            out["per-sample gradients: ours / torch.func, peak RSS"] = m("ours", "psg") / m("peer", "torch_func")
        return out, got

    paired(ROUNDS, one_round)


if __name__ == "__main__":
    main()
